"""A session-scoped tiny MiniMax-M2 directory (official template fetched once, cached), its reference
model, and the device kernels run on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from akv.system.models.minimax_m2 import make_minimax_m2_tiny
from akv.system.models.sdist_templates import TemplateFetchError
from akv.system.reference.minimax_m2 import MiniMaxM2Model


@pytest.fixture(scope="session")
def minimax_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return make_minimax_m2_tiny(tmp_path_factory.mktemp("minimax-m2-tiny"))
    except TemplateFetchError as exc:
        pytest.skip(f"official MiniMax-M2 template unavailable: {exc}")


@pytest.fixture(scope="session")
def minimax(minimax_dir: Path) -> MiniMaxM2Model:
    return MiniMaxM2Model.from_pretrained(minimax_dir)


@pytest.fixture
def device() -> torch.device:
    """CUDA if present, else the CPU through the Triton interpreter (set by the root conftest)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
