"""A tiny random-weight Qwen3 reference model for the end-to-end cache tests."""

from __future__ import annotations

import pytest

from akv.system.models.tiny import make_tiny_model
from akv.system.reference.model import ReferenceModel


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> ReferenceModel:
    return ReferenceModel.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("cache-tiny"), arch="qwen3", seed=3))
