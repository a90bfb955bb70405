"""Bad inputs to the re-rotation kernel are refused with errors that name the field and value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import RerotateLaunch, rerotate_kv
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec, RopeTable

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="builds CPU tensors for the Triton interpreter (CI); the H200 runs the gpu-marked tests",
)

SPEC = RopeSpec(theta=10000.0, head_dim=8, rotary_dim=8)


def pools(layers: int = 2, slots: int = 10) -> tuple[LayerBuffers, LayerBuffers]:
    return (LayerBuffers.of([torch.zeros(slots, 2, 8) for _ in range(layers)]),
            LayerBuffers.of([torch.zeros(slots, 2, 8) for _ in range(layers)]))


def call(src, dst, old, new, *, k=None, v=None, rope=None):
    k_default, v_default = pools()
    rerotate_kv(k or k_default, v or v_default, torch.tensor(src), torch.tensor(dst), torch.tensor(old),
                torch.tensor(new), rope or RopeTable.build(SPEC, 100))


@pytest.mark.parametrize(
    ("src", "dst", "old", "new", "message"),
    [
        ([1, 2], [3, 3], [0, 0], [1, 1], "dst slot 3 is written by 2 copies"),
        ([1, 3], [3, 4], [0, 0], [1, 1], r"dst\[0\] = 3 is the src slot of another copy"),
        ([1], [10], [0], [1], r"dst\[0\] = 10 is outside \[0, 10\)"),
        ([-1], [2], [0], [1], r"src\[0\] = -1 is outside"),
        ([1], [2], [0], [100], r"new_positions\[0\] = 100 is outside \[0, 100\)"),
        ([1, 2], [3], [0, 0], [1, 1], "dst has 1 entries, src has 2"),
    ],
)
def test_bad_copy_lists(src, dst, old, new, message):
    with pytest.raises(ValueError, match=message):
        call(src, dst, old, new)


def test_one_source_may_feed_several_destinations():
    """Accepted, and each destination gets the source re-rotated to its own position (against the
    PyTorch reference), the source left as it was."""
    torch.manual_seed(0)
    layers = [[torch.randn(10, 2, 8) for _ in range(2)] for _ in range(2)]
    expected = [[t.clone() for t in kind] for kind in layers]
    src, dst, old, new = (torch.tensor(x) for x in ([1, 1], [4, 5], [3, 3], [0, 9]))
    rerotate_kv(LayerBuffers.of(layers[0]), LayerBuffers.of(layers[1]), src, dst, old, new, RopeTable.build(SPEC, 100))
    rerotate_kv_reference(LayerBuffers.of(expected[0]), LayerBuffers.of(expected[1]), src, dst, old, new, SPEC)
    for got, want in zip(layers[0] + layers[1], expected[0] + expected[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.equal(layers[0][0][4], layers[0][0][5]), "the two destinations hold different rotations"


def test_rewriting_a_slot_in_place_while_another_copy_reads_it_is_refused():
    with pytest.raises(ValueError, match=r"dst\[0\] = 1 is the src slot of another copy"):
        call([1, 1], [1, 5], [3, 3], [0, 0])


def test_float_positions_rejected():
    k, v = pools()
    with pytest.raises(ValueError, match="old_positions must be a 1-D int32/int64 tensor"):
        rerotate_kv(k, v, torch.tensor([1]), torch.tensor([2]), torch.tensor([1.0]), torch.tensor([2]),
                    RopeTable.build(SPEC, 10))


def test_mismatched_pools_and_rope():
    k, _ = pools(layers=2)
    _, v3 = pools(layers=3)
    with pytest.raises(ValueError, match="v has 3 layers"):
        call([1], [2], [0], [1], k=k, v=v3)
    with pytest.raises(ValueError, match="head_dim 8 differs from rope.spec.head_dim 16"):
        call([1], [2], [0], [1], rope=RopeTable.build(RopeSpec(theta=1e4, head_dim=16, rotary_dim=16), 10))


def test_layer_buffers_must_agree():
    with pytest.raises(ValueError, match=r"k\[1\]: shape \(5, 2, 8\) differs"):
        LayerBuffers.of([torch.zeros(4, 2, 8), torch.zeros(5, 2, 8)], name="k")
    with pytest.raises(ValueError, match=r"k\[1\]: dtype torch.float16 differs"):
        LayerBuffers.of([torch.zeros(4, 2, 8), torch.zeros(4, 2, 8, dtype=torch.float16)], name="k")
    with pytest.raises(ValueError, match="dtype torch.int32 is not one of"):
        LayerBuffers.of([torch.zeros(4, 2, 8, dtype=torch.int32)])
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        LayerBuffers.of([torch.zeros(4, 8, 2).transpose(1, 2)])
    with pytest.raises(ValueError, match="stacked buffer must be 4-D"):
        LayerBuffers.of(torch.zeros(4, 2, 8))


def test_launch_shape_and_table_checks():
    with pytest.raises(ValueError, match="block_copies must be a positive power of two, got 3"):
        RerotateLaunch(block_copies=3, layers_per_program=1)
    with pytest.raises(ValueError, match="layers_per_program must be > 0, got 0"):
        RerotateLaunch(block_copies=4, layers_per_program=0)
    with pytest.raises(ValueError, match="table must be float32"):
        RopeTable(SPEC, torch.zeros(10, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"rotary_dim=8\] with a contiguous"):
        RopeTable(SPEC, torch.zeros(10, 6))


def test_cpu_tensors_without_the_interpreter_are_refused():
    script = (
        "import torch\n"
        "from akv.system.kernels import LayerBuffers, RopeSpec, RopeTable, rerotate_kv\n"
        "k = LayerBuffers.of([torch.zeros(4, 1, 8)])\n"
        "t = torch.tensor\n"
        "rerotate_kv(k, k, t([1]), t([2]), t([0]), t([1]), RopeTable.build(RopeSpec(1e4, 8, 8), 4))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert "ValueError: k is on cpu, where these Triton kernels cannot run (set TRITON_INTERPRET=1" in done.stderr
