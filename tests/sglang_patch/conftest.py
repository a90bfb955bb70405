"""Session fixtures: the stock and the patched sglang wheels, each installed into its own folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from akv.system import _build

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


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


def run_probe(site: Path, payload: dict) -> dict:
    """Run ``protocol_probe.py`` against the sglang installed in ``site`` (own process, CPU shim)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(HERE)])}
    done = subprocess.run(
        [sys.executable, str(HERE / "protocol_probe.py")],
        input=json.dumps(payload), capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
