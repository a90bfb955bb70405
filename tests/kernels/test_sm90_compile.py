"""Every kernel compiles for the H200 (sm_90) with the arguments its wrapper passes, on a machine
without a GPU (Triton's ahead-of-time compiler and bundled ptxas, in a subprocess that is not in
interpreter mode). The re-rotation kernel must move K and V with 16-byte vector accesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("h200_compile_check.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, int]]:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, str(SCRIPT)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("n_copies", [1024, 65536])
def test_rerotation_at_qwen3_8b_shapes_uses_vector_accesses(compiled, dtype, n_copies):
    counts = compiled[f"rerotate_qwen3_8b_{dtype}_{n_copies}"]
    assert counts["vector_loads"] >= 8 and counts["vector_stores"] >= 8, counts
    assert counts["b16_loads"] == 0 and counts["b16_stores"] == 0, counts


def test_gpt_j_partial_rotary_compiles(compiled):
    assert "rerotate_gptj_partial_bf16" in compiled


@pytest.mark.parametrize("visibility", ["all", "keep_mask", "visible_until", "hidden_ranges"])
def test_index_list_kernels_compile(compiled, visibility):
    assert compiled[f"kv_indices_{visibility}"]["kernels"] == (1 if visibility == "hidden_ranges" else 2)
