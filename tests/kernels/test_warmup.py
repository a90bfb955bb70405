"""The start-up warm-up's kernel side (akv.system.adapter.warmup): the copy counts it launches cover
every specialization of the re-rotation kernel a copy list can take (checked against every count),
and the launch watcher counts a specialization's first launch only."""

from __future__ import annotations

import pytest
import torch

from akv.system.adapter import warmup
from akv.system.kernels import rerotate
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import RerotateLaunch, rerotate_kv
from akv.system.kernels.rope_spec import RopeSpec, RopeTable


def _specialization(n: int, k: LayerBuffers) -> tuple:
    return RerotateLaunch.default(n, k), n == 1, n % 16 == 0


@pytest.mark.parametrize(("layers", "heads", "head_dim", "slots"),
                         [(36, 8, 128, 20_000), (2, 2, 16, 300), (61, 4, 64, 9_000)])
def test_copy_counts_cover_every_specialization_of_every_count(layers, heads, head_dim, slots):
    k = LayerBuffers.of(torch.empty(layers, slots, heads, head_dim, device="meta"))
    counts = warmup.copy_counts(k)
    every = {_specialization(n, k) for n in range(1, slots)}
    assert {_specialization(n, k) for n in counts} == every
    assert len(counts) == len(every) and max(counts) < slots


def test_watcher_counts_first_launches_of_a_specialization_only(device):
    shapes = warmup.LaunchShapes()
    rerotate._rerotate_kernel.pre_run_hooks.append(hook := shapes._hook("rerotate"))
    try:
        k = LayerBuffers.of(torch.randn(2, 40, 2, 16, device=device))
        v = LayerBuffers.of(torch.randn(2, 40, 2, 16, device=device))
        rope = RopeTable.build(RopeSpec(theta=10000.0, head_dim=16, rotary_dim=16, neox=True), 64, device)

        def launch(n: int) -> None:
            slots = torch.arange(1, n + 1, device=device)
            rerotate_kv(k, v, slots, slots, slots * 0, slots * 0 + 3, rope)

        launch(5)
        launch(7)  # same specialization: not a first launch
        assert shapes.first_launches == 1
        launch(16)  # a multiple of 16
        launch(1)  # a single copy
        assert shapes.first_launches == 3
        launch(32)
        assert shapes.first_launches == 3
    finally:
        rerotate._rerotate_kernel.pre_run_hooks.remove(hook)


def test_context_bodies_drop_before_their_anchor_and_reposition_there():
    bodies = warmup.context_bodies("m")
    assert "drop_message" not in bodies[0]
    for body in bodies[1:]:
        last = len(body["messages"]) - 1
        assert body["reposition"] == [last]
        assert all(m < int(anchor) <= last for anchor, ms in body["drop_message"].items() for m in ms)
    assert len(bodies[2]["drop_message"]) == 2  # the cold request runs in several rounds
