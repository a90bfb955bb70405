"""``bench/kernels.py --smoke`` runs end to end (tiny sizes, any device) and writes the JSON the H200
run will write: the command, every comparison row, and the launch sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "kernels.json"
    command = [sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["command"] == f"python bench/kernels.py --smoke --out {out}"
    rows = result["rerotation"]["rows"]
    assert [(r["mode"], r["tokens"]) for r in rows] == [("in_place", 16), ("in_place", 40), ("moved", 16), ("moved", 40)]
    for row in rows:
        assert row["fraction_of_copy_bandwidth"] == row["copy_ms"] / row["rerotate_ms"]
    in_place_16, moved_16 = rows[0], rows[2]
    assert moved_16["bytes_read_plus_written"] == 2 * in_place_16["bytes_read_plus_written"] == 2 * 2 * 16 * 2 * 8 * 128 * 2
    assert len(result["rerotation"]["launch_sweep"]) == 2 * 8
    assert result["index_build"]["keep_mask_ms"] > 0
    assert [(r["batch"], r["live_tokens"]) for r in result["decode_attention"]["rows"]] == [(1, 32)]
