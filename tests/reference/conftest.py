"""Session-scoped tiny model directories and loaded reference models for the oracle tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from akv.system.models.tiny import make_tiny_model
from akv.system.reference.model import ReferenceModel

# arch -> make_tiny_model overrides; Llama is untied and uses an explicit head_dim != hidden / heads.
ARCH_VARIANTS: dict[str, dict[str, object]] = {
    "qwen3": {"arch": "qwen3"},
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": False},
    "llama": {"arch": "llama", "tie_word_embeddings": False, "head_dim": 32},
}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(root / name, **kwargs) for name, kwargs in ARCH_VARIANTS.items()}


@pytest.fixture(scope="session")
def qwen3_dir(tiny_dirs: dict[str, Path]) -> Path:
    return tiny_dirs["qwen3"]


@pytest.fixture(scope="session")
def qwen3(qwen3_dir: Path) -> ReferenceModel:
    return ReferenceModel.from_pretrained(qwen3_dir)
