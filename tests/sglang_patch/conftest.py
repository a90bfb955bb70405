"""The protocol probe: runs against an installed sglang in its own process (the wheel fixtures
are in tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_probe(site: Path, payload: dict) -> dict:
    """Run ``protocol_probe.py`` against the sglang installed in ``site`` (own process, CPU shim)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(HERE)])}
    done = subprocess.run(
        [sys.executable, str(HERE / "protocol_probe.py")],
        input=json.dumps(payload), capture_output=True, text=True, env=env, timeout=600, check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
