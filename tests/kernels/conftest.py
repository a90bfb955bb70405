"""Kernel tests: Triton runs in interpreter mode where no CUDA device exists (set before any kernel
module is imported); ``device`` is where the kernels run."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
