"""Shared pytest setup: GPU tests skip, with a reason, where no CUDA device is present, and Triton
kernels run in interpreter mode there (set before any kernel module is imported); the stock and
the patched sglang wheels, each installed once per machine into a folder named by its hash
(session fixtures)."""

from __future__ import annotations

import os
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
    # SGLang wraps gpt-oss's and MiniMax-M2's MoE routing in torch.compile: each CPU server a test
    # starts would compile it with inductor again (~15 CPU s each), on no path AKV changes.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
# Nothing a test loads comes from the Hugging Face hub: without this, transformers probes the hub
# for local files too, and a run stalled for minutes where the network does not answer.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tag() -> str:
    return _build.python_tag()


@pytest.fixture(scope="session")
def stock_wheel(tag: str) -> Path:
    return _build.fetch_stock_wheel(tag, _build.default_cache_dir())


@pytest.fixture(scope="session")
def patched(tag: str) -> _build.BuildResult:
    return _build.cached_build(tag)


@pytest.fixture(scope="session")
def stock_site(stock_wheel: Path) -> Path:
    return _build.installed_site(stock_wheel)


@pytest.fixture(scope="session")
def patched_site(patched: _build.BuildResult) -> Path:
    return _build.installed_site(patched.wheel)


# The files that took longest in a whole-suite run (tests/README.md), longest first.
_LONGEST = ("sglang_cpu/test_demo_models.py", "sglang_cpu/test_scheduler.py", "bench/test_replay_sglang_cpu.py",
            "bench/test_pd_check_dry_run.py", "bench/test_soak_dry_run.py", "sglang_cpu/test_models.py")


def _file_rank(item: pytest.Item, slow_files: set[Path]) -> int:
    """The measured longest files first, then files with slow tests, then the rest."""
    relative = Path(str(item.path)).resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    if relative in _LONGEST:
        return _LONGEST.index(relative)
    return len(_LONGEST) + (item.path not in slow_files)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tiers: every test not marked ``slow`` or ``gpu`` is also ``quick`` (before ``-m`` selects);
    GPU tests skip where no CUDA device is present. Files run longest first (``--no-loadscope-reorder``
    keeps this order on the xdist workers): with a file to a worker, a long file started last would
    run alone at the end."""
    for item in items:
        if "slow" not in item.keywords and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.quick)
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: _file_rank(item, slow_files))
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
