"""Re-rotation copies of a forward: a decode step's run on the forward stream before the forward (and
before ``ModelRunner._forward_raw`` decides on a CUDA graph); an extend forward's run per layer, after
the layer's new KV is written and before its attention reads them (their sources may be KV born in
the same forward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from akv.system.kernels import LayerBuffers, RopeTable, rerotate_kv


@dataclass(frozen=True)
class CopyBatch:
    """Re-rotation copies of one forward, on the KV device (int64)."""

    src: torch.Tensor
    dst: torch.Tensor
    old_positions: torch.Tensor
    new_positions: torch.Tensor


class CopyExecutor:
    """SGLang's per-layer K/V buffers and the model's RoPE table, described once per model runner."""

    def __init__(self, model_runner: Any) -> None:
        pool = model_runner.token_to_kv_pool
        self.k_buffers, self.v_buffers = pool.k_buffer, pool.v_buffer
        self.k = LayerBuffers.of(pool.k_buffer, name="k_buffer")
        self.v = LayerBuffers.of(pool.v_buffer, name="v_buffer")
        self.rope = RopeTable.from_sglang(_rotary_embedding(model_runner.model))
        self.layers: dict[int, tuple[LayerBuffers, LayerBuffers]] = {}

    def run(self, copies: CopyBatch) -> None:
        rerotate_kv(self.k, self.v, copies.src, copies.dst, copies.old_positions, copies.new_positions, self.rope)

    def layer(self, layer_id: int) -> tuple[LayerBuffers, LayerBuffers]:
        """Layer ``layer_id``'s K and V buffers, described for a one-layer launch."""
        buffers = self.layers.get(layer_id)
        if buffers is None:
            buffers = self.layers[layer_id] = (LayerBuffers.of([self.k_buffers[layer_id]], name="k_buffer"),
                                               LayerBuffers.of([self.v_buffers[layer_id]], name="v_buffer"))
        return buffers

    def run_layer(self, layer_id: int, copies: CopyBatch) -> None:
        rerotate_kv(*self.layer(layer_id), copies.src, copies.dst, copies.old_positions, copies.new_positions,
                    self.rope, validate=False)


def run_copies(model_runner: Any, forward_batch: Any) -> None:
    """Run the forward's copies due before it, if it carries any (and have the executor ready for
    its per-layer copies)."""
    akv = getattr(forward_batch, "akv", None)
    if akv is None or (akv.copies is None and not akv.layer_copies):
        return
    pool = model_runner.token_to_kv_pool
    executor = getattr(pool, "akv_copy_executor", None)
    if executor is None:
        executor = pool.akv_copy_executor = CopyExecutor(model_runner)
    if akv.copies is not None:
        executor.run(akv.copies)


def run_layer_copies(pool: Any, forward_batch: Any, layer: Any) -> None:
    """Run the forward's per-layer copies for ``layer``, level by level (called by the attention
    backend once the layer's new KV is in ``pool``), timed when the forward carries a timer."""
    akv = getattr(forward_batch, "akv", None)
    if akv is None or not akv.layer_copies:
        return
    interval = None if akv.timer is None else akv.timer.copy()
    if interval is not None:
        interval.mark()
    for copies in akv.layer_copies:
        pool.akv_copy_executor.run_layer(layer.layer_id, copies)
    if interval is not None:
        interval.mark()


def _rotary_embedding(model: Any) -> Any:
    for module in model.modules():
        rotary = getattr(module, "rotary_emb", None)
        if rotary is not None:
            return rotary
    raise ValueError(f"model: {type(model).__name__} has no rotary embedding; AKV re-rotation needs RoPE")
