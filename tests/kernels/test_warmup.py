"""The start-up warm-up's kernel side (akv.system.adapter.warmup): the copy counts it launches cover
every specialization of the re-rotation kernel a copy list can take (checked against every count),
and the launch watcher counts a specialization's first launch only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from akv.system.adapter import warmup
from akv.system.adapter.copy_executor import CopyBatch, CopyExecutor
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
    assert len(bodies[2]["drop_message"]) == 2  # the cold request's prefill has several segments


class RotaryEmbedding(torch.nn.Module):
    """Stands in for SGLang's unscaled RoPE module (what the copy executor reads of it)."""

    def __init__(self, head_dim: int, device: torch.device) -> None:
        super().__init__()
        self.base, self.head_size, self.rotary_dim, self.is_neox_style = 10000.0, head_dim, head_dim, True
        self.cos_sin_cache = RopeTable.build(RopeSpec(theta=10000.0, head_dim=head_dim, rotary_dim=head_dim,
                                                      neox=True), 512, device).table


def test_after_warm_up_no_copy_of_a_decode_step_or_an_extend_layer_is_a_first_launch(device):
    """A decode step's copies run over every layer at once, an extend forward's per layer: the
    warm-up launches both, so neither compiles while serving, whatever the copy count."""
    layers, slots, heads, head_dim = 3, 300, 2, 16
    pool = SimpleNamespace(k_buffer=[torch.zeros(slots, heads, head_dim, device=device) for _ in range(layers)],
                           v_buffer=[torch.zeros(slots, heads, head_dim, device=device) for _ in range(layers)])
    model = torch.nn.Sequential(torch.nn.Module())
    model[0].rotary_emb = RotaryEmbedding(head_dim, device)
    runner = SimpleNamespace(server_args=SimpleNamespace(radix_cache_backend="akv"), token_to_kv_pool=pool, model=model)
    shapes = warmup.LaunchShapes()
    rerotate._rerotate_kernel.pre_run_hooks.append(hook := shapes._hook("rerotate"))
    try:
        assert warmup.warm_kernels(runner) > 0
        warm = shapes.first_launches
        executor = CopyExecutor(runner)
        for n in (1, 2, 15, 16, 17, 64, 200, slots - 1):
            src = torch.arange(n, dtype=torch.int64, device=device)
            copies = CopyBatch(src, src, src * 0, src * 0 + 1)
            executor.run(copies)
            executor.run_layer(layers - 1, copies)
        assert shapes.first_launches == warm
    finally:
        rerotate._rerotate_kernel.pre_run_hooks.remove(hook)
