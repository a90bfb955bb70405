"""Re-rotation copies of a forward, run on the forward stream before attention reads them (and
before ``ModelRunner._forward_raw`` decides on a CUDA graph)."""

from __future__ import annotations

from typing import Any

from akv.system.kernels import LayerBuffers, RopeTable, rerotate_kv


class CopyExecutor:
    """SGLang's per-layer K/V buffers and the model's RoPE table, described once per model runner."""

    def __init__(self, model_runner: Any) -> None:
        pool = model_runner.token_to_kv_pool
        self.k = LayerBuffers.of(pool.k_buffer, name="k_buffer")
        self.v = LayerBuffers.of(pool.v_buffer, name="v_buffer")
        self.rope = RopeTable.from_sglang(_rotary_embedding(model_runner.model))

    def run(self, copies: Any) -> None:
        rerotate_kv(self.k, self.v, copies.src, copies.dst, copies.old_positions, copies.new_positions, self.rope)


def run_copies(model_runner: Any, forward_batch: Any) -> None:
    """Run the forward's copy jobs, if it carries any."""
    akv = getattr(forward_batch, "akv", None)
    if akv is None or akv.copies is None:
        return
    executor = getattr(model_runner, "akv_copy_executor", None)
    if executor is None:
        executor = model_runner.akv_copy_executor = CopyExecutor(model_runner)
    executor.run(akv.copies)


def _rotary_embedding(model: Any) -> Any:
    for module in model.modules():
        rotary = getattr(module, "rotary_emb", None)
        if rotary is not None:
            return rotary
    raise ValueError(f"model: {type(model).__name__} has no rotary embedding; AKV re-rotation needs RoPE")
