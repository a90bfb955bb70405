"""SGLang's real scheduler on the CPU: the patched wheel, a tiny random Qwen3, one driver process per
scheduler mode, and the oracle/cache-core references the served results are checked against."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from akv.system.models.tiny import make_tiny_model

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
          "AKV_CHECK_HOST_ROWS": "1"}


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sglang-cpu") / "tiny-qwen3", seed=3)


def serve(site: Path, model: Path, waves: list[dict], *, overlap: bool = False, chunk: int = 4,
          backend: str | None = "akv", env: dict[str, str] | None = None, max_total_tokens: int = 4096,
          timeout: int = 1500, server_args: dict[str, Any] | None = None,
          flashinfer_probe: bool = False, audit: bool = False) -> dict[str, Any]:
    """Run ``waves`` through a fresh scheduler in its own process; the driver's JSON report.
    ``server_args`` are extra ``ServerArgs`` fields (model-specific flags); ``flashinfer_probe`` also
    plans FlashInfer for every context forward (see flashinfer_probe.py); ``audit`` checks every
    cache read against the brute force while it runs."""
    job = {"model": str(model), "overlap": overlap, "chunk": chunk, "backend": backend,
           "env": {**STRICT, **(env or {})}, "waves": waves, "max_total_tokens": max_total_tokens,
           "server_args": server_args or {}, "flashinfer_probe": flashinfer_probe, "audit": audit}
    process_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(HERE / "scheduler_driver.py")], input=json.dumps(job),
                          capture_output=True, text=True, env=process_env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
