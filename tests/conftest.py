"""Shared pytest setup: GPU tests skip, with a reason, where no CUDA device is present, and Triton
kernels run in interpreter mode there (set before any kernel module is imported); the stock and
the patched sglang wheels, each installed into its own folder (session fixtures)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from akv.system import _build


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tag() -> str:
    return _build.python_tag()


@pytest.fixture(scope="session")
def stock_wheel(tag: str) -> Path:
    return _build.fetch_stock_wheel(tag, _build.default_cache_dir())


@pytest.fixture(scope="session")
def patched(tmp_path_factory: pytest.TempPathFactory, tag: str) -> _build.BuildResult:
    return _build.build(tmp_path_factory.mktemp("dist"), tag)


def _pip_target(wheel: Path, target: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target", str(target),
         str(wheel)],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def stock_site(tmp_path_factory: pytest.TempPathFactory, stock_wheel: Path) -> Path:
    return _pip_target(stock_wheel, tmp_path_factory.mktemp("stock-site"))


@pytest.fixture(scope="session")
def patched_site(tmp_path_factory: pytest.TempPathFactory, patched: _build.BuildResult) -> Path:
    return _pip_target(patched.wheel, tmp_path_factory.mktemp("patched-site"))


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
    narrowed = any(config.getoption(name) for name in ("keyword", "markexpr", "ignore", "ignore_glob", "deselect"))
    if [Path(a).resolve() for a in config.args] != [tests_dir] or narrowed:
        return
    on_disk = {p.resolve() for p in tests_dir.rglob("test_*.py")}
    collected = {Path(str(item.path)).resolve() for item in session.items}
    missing = sorted(str(p.relative_to(tests_dir)) for p in on_disk - collected)
    if missing:
        raise pytest.UsageError(f"test files not collected (check norecursedirs and names): {', '.join(missing)}")
