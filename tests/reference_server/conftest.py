"""A tiny random Qwen3 model served by the reference server on a free local port."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server import Engine, ReferenceServer

MODEL_NAME = "tiny-test"


@dataclass(frozen=True)
class Served:
    url: str
    engine: Engine
    model_dir: Path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    engine = Engine(tiny_model_dir, name=MODEL_NAME, kv_slots=8192)
    server = ReferenceServer(engine)
    with server.running():
        yield Served(server.url, engine, tiny_model_dir)
