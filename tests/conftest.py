"""Shared pytest setup: GPU tests skip, with a reason, where no CUDA device is present, and Triton
kernels run in interpreter mode there (set before any kernel module is imported)."""

from __future__ import annotations

import os
from pathlib import Path

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


def pytest_collection_finish(session: pytest.Session) -> None:
    """A whole-suite run must collect every test file under tests/ (pytest's ``norecursedirs``
    silently skips folders such as ``build``); fail the run naming any file left out."""
    config = session.config
    tests_dir = Path(__file__).resolve().parent
    if [Path(a).resolve() for a in config.args] != [tests_dir] or config.getoption("-k") or config.getoption("-m"):
        return
    on_disk = {p.resolve() for p in tests_dir.rglob("test_*.py")}
    collected = {Path(str(item.path)).resolve() for item in session.items}
    missing = sorted(str(p.relative_to(tests_dir)) for p in on_disk - collected)
    if missing:
        raise pytest.UsageError(f"test files not collected (check norecursedirs and names): {', '.join(missing)}")
