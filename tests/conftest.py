"""Shared pytest setup: GPU tests skip, with a reason, where no CUDA device is present, and Triton
kernels run in interpreter mode there (set before any kernel module is imported)."""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; runs on the H200 through tools/gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
