"""What the server needs from an HF model directory besides the weights: tokenizer, chat template,
end-of-sequence ids and the context length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelDirError(ValueError):
    """The model directory lacks a file or field the server needs; the message names it."""


@dataclass(frozen=True)
class ModelDir:
    """A loaded directory: ``tokenizer`` is a ``tokenizers.Tokenizer``."""

    path: Path
    tokenizer: Any
    chat_template: str
    eos_token_ids: frozenset[int]
    max_context: int


def load_model_dir(path: str | Path) -> ModelDir:
    from tokenizers import Tokenizer

    root = Path(path)
    if not root.is_dir():
        raise ModelDirError(f"model directory {str(root)!r} is not a directory")
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelDirError(f"{str(tokenizer_file)!r} is missing (a fast tokenizer is required)")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    config = _json(root / "config.json", required=True)
    tokenizer_config = _json(root / "tokenizer_config.json", required=False)
    generation = _json(root / "generation_config.json", required=False)

    eos: set[int] = set()
    for source in (config, generation):
        value = source.get("eos_token_id")
        eos.update([value] if isinstance(value, int) else value or [])
    eos_text = tokenizer_config.get("eos_token")
    if isinstance(eos_text, dict):
        eos_text = eos_text.get("content")
    if isinstance(eos_text, str) and tokenizer.token_to_id(eos_text) is not None:
        eos.add(tokenizer.token_to_id(eos_text))
    if not eos:
        raise ModelDirError(f"no eos_token_id in {str(root)!r} "
                            "(config.json, generation_config.json, tokenizer_config.json)")

    max_context = config.get("max_position_embeddings")
    if type(max_context) is not int or max_context <= 0:
        raise ModelDirError(f"config.json max_position_embeddings must be a positive int, got {max_context!r}")
    return ModelDir(root, tokenizer, _chat_template(root, tokenizer_config), frozenset(eos), max_context)


def _chat_template(root: Path, tokenizer_config: dict[str, Any]) -> str:
    file = root / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ModelDirError(f"no chat template in {str(root)!r} (chat_template.jinja or tokenizer_config.json)")
    return template


def _json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelDirError(f"{str(path)!r} is missing")
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ModelDirError(f"{str(path)!r} is not a JSON object")
    return value
