"""Character offsets of token ids the server already encoded a prompt to, read from the tokens' bytes
instead of encoding the prompt a second time.

Only for byte-level BPE tokenizers whose pipeline keeps the text as it is: no normalizer,
pre-tokenizers that only split (and keep what they split on) around one ``ByteLevel`` without an
added prefix space, no added token that strips the whitespace around it, no offset trimming, no BPE
dropout. There, the tokens of ``encode(s)`` spell ``s`` byte for byte, each token its own span of
the UTF-8 text in order; so ids the tokenizer produced for some text that spell ``text`` are
``encode(text)``'s, and their character offsets are each span's first character and one past its
last (a character split between two tokens belongs to both), as ``encode`` reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

_SPLITTERS = frozenset({"Split", "Digits", "Punctuation", "ByteLevel"})
_KEPT_POST = frozenset({"ByteLevel", "TemplateProcessing"})  # add nothing when encoding without special tokens


def _byte_of_char() -> dict[int, int]:
    """``ByteLevel``'s alphabet: the code point standing for each byte (GPT-2's ``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return dict(zip(printable + [256 + k for k in range(len(others))], printable + others))


_BYTE_OF_CHAR = _byte_of_char()
_ALPHABET = frozenset(map(chr, _BYTE_OF_CHAR))


@dataclass(frozen=True)
class _ByteVocab:
    """The bytes of token id ``i``: ``blob[starts[i]:starts[i] + lengths[i]]`` (length 0: unknown id)."""

    blob: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def spelled_offsets(backend: Any, ids: np.ndarray, text: str) -> np.ndarray | None:
    """The ``(n, 2)`` character offsets of ``ids`` in ``text``, None when the tokenizer is not one this
    module reads or the ids do not spell ``text`` byte for byte.

    ``backend`` is a ``tokenizers.Tokenizer``; ``ids`` is an int64 vector.
    """
    n_added = len(backend.get_added_tokens_decoder())
    vocab = _byte_vocab(backend, backend.get_vocab_size(with_added_tokens=False), n_added)
    if vocab is None or (ids.size and (ids.min() < 0 or ids.max() >= vocab.lengths.size)):
        return None
    try:
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    except UnicodeEncodeError:
        return None
    lengths = vocab.lengths[ids]
    ends = np.cumsum(lengths)
    if (ids.size and lengths.min() == 0) or (int(ends[-1]) if ids.size else 0) != data.size:
        return None
    starts = ends - lengths
    at = np.repeat(vocab.starts[ids] - starts, lengths) + np.arange(data.size, dtype=np.int64)
    if not np.array_equal(vocab.blob[at], data):
        return None
    if data.size == len(text):
        return np.stack([starts, ends], axis=1)
    char_of = np.cumsum((data & 0xC0) != 0x80, dtype=np.int64) - 1
    return np.stack([char_of[starts], char_of[ends - 1] + 1], axis=1)


@lru_cache(maxsize=8)
def _byte_vocab(backend: Any, n_model: int, n_added: int) -> _ByteVocab | None:
    """The bytes of every token of ``backend``, None when its pipeline is not one that keeps the text;
    its model and added token counts key the cache, so a tokenizer that gained tokens is read again."""
    added_tokens = backend.get_added_tokens_decoder()
    if not _keeps_text(backend) or any(t.lstrip or t.rstrip for t in added_tokens.values()):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)
    if not set("".join(vocab)) <= _ALPHABET:
        return None
    added = {i: token.content for i, token in added_tokens.items()}
    n = max([0, *vocab.values(), *added]) + 1
    pieces = [""] * n  # one character per byte: ByteLevel's alphabet, or latin-1 for added tokens
    for piece, i in vocab.items():
        pieces[i] = piece
    for i, content in added.items():
        pieces[i] = content.encode("utf-8").decode("latin-1")  # bytes < 256 the alphabet leaves as they are
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=n)
    blob = "".join(pieces).translate(_BYTE_OF_CHAR).encode("latin-1")
    return _ByteVocab(blob=np.frombuffer(blob, dtype=np.uint8), starts=np.cumsum(lengths) - lengths, lengths=lengths)


def _keeps_text(backend: Any) -> bool:
    """True when the pipeline around the BPE model can neither change the text nor trim offsets."""
    model = backend.model
    if type(model).__name__ != "BPE" or model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        return False
    normalizer, pre, post = (_state(c) for c in (backend.normalizer, backend.pre_tokenizer, backend.post_processor))
    if normalizer not in (None, {"type": "Sequence", "normalizers": []}):
        return False
    members = pre["pretokenizers"] if pre is not None and pre["type"] == "Sequence" else [pre]
    levels = [p for p in members if p is not None and p["type"] == "ByteLevel"]
    if len(levels) != 1 or levels[0]["add_prefix_space"]:
        return False
    if any(p["type"] not in _SPLITTERS or p.get("behavior") == "Removed" for p in members):
        return False
    return post is None or (post["type"] in _KEPT_POST and not post.get("trim_offsets", False))


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())
