"""A tiny random Qwen3-layout model directory (tokenizer + chat template) shared by the bench tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from akv.system.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="session")
def tiny_counter(tiny_model_dir: Path):
    from akv.agent.tokens import ChatTemplateTokenCounter

    return ChatTemplateTokenCounter.from_pretrained(str(tiny_model_dir))
