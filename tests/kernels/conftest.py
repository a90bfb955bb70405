"""Kernel tests: ``device`` is where the kernels run (the root conftest sets TRITON_INTERPRET on CPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
