"""The prefill server of a PD pair (``--disaggregation-mode prefill``): what SGLang's transfer path
sends for a context request.

SGLang sends a request's ``req_to_token[start:end]`` as its chunks are computed and counts its
prompt's length of pages. A context request's columns are not what generation reads (dropped tokens,
versions at their birth positions, recovered segments), so it is sent once, at its last round: the
terminal copies run first, then the plan's send list goes out (:func:`akv.system.adapter.
disaggregation.prefill_send`), ``V`` pages, with its usage and layout in the metadata row. Its KV stays
in the prefill server's tree, published when the transfer completes, as a plain request's does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.copy_executor import CopyBatch, CopyExecutor
from akv.system.adapter.device import to_device
from akv.system.adapter.disaggregation import METADATA_COLUMNS, DecodeLayout, prefill_send
from akv.system.cache.plan import CopyJob


def kv_len(req: Any) -> int:
    """KV entries the decode server receives for ``req``: a context request's kept count ``V``, a
    plain request's prompt (stock)."""
    state: AkvRequest | None = req.akv
    if state is None:
        return len(req.origin_input_ids)
    return DecodeLayout.of(state.program).visible


def send_context(scheduler: Any, req: Any, last_chunk: bool) -> None:
    """SGLang's ``send_kv_chunk`` for a context request: nothing before its last round; then its
    terminal copies, its metadata row and its send list, in the decode server's column order."""
    if not last_chunk:
        return
    state: AkvRequest = req.akv
    send = prefill_send(state)
    if send.copies is not None and not state.terminal_written:
        run_terminal_copies(scheduler, send.copies)
    state.terminal_written = True
    buffers = scheduler.disagg_metadata_buffers
    buffers.set_buf(req)
    send.metadata.write(buffers.cached_tokens[req.metadata_buffer_index])
    pages = send.slots.astype(np.int32)  # page size 1: a slot is a page
    state_types = scheduler.disagg_prefill_bootstrap_queue.kv_manager.kv_args.state_types
    # models with per-request state (sliding-window pools, mamba) are refused by the decode server
    state_indices = [None] * len(state_types)
    if not req.disagg_kv_sender.should_send_kv_chunk(len(pages), True):
        return
    req.disagg_kv_sender.send(pages, state_indices)
    req.start_send_idx = len(req.origin_input_ids)


def clear_metadata(buffers: Any, req: Any) -> None:
    """A plain request's metadata row carries no context-request columns (the buffer's row may hold
    an earlier request's)."""
    buffers.cached_tokens[req.metadata_buffer_index, METADATA_COLUMNS.start : METADATA_COLUMNS.stop] = 0


def run_terminal_copies(scheduler: Any, job: CopyJob) -> None:
    """Run ``job`` on the KV pool, on the forward stream after the prefill that wrote its sources,
    and wait for it: the transfer engine reads the pool outside any stream."""
    runner = scheduler.tp_worker.model_runner
    pool = runner.token_to_kv_pool
    executor = getattr(pool, "akv_copy_executor", None)
    if executor is None:
        executor = pool.akv_copy_executor = CopyExecutor(runner)
    device = pool.device
    if torch.device(device).type != "cuda":
        executor.run(_on(job, device))
        return
    stream = scheduler.forward_stream
    with torch.cuda.stream(stream):
        executor.run(_on(job, device))
    stream.synchronize()


def _on(job: CopyJob, device: Any) -> CopyBatch:
    return CopyBatch(*(to_device(getattr(job, name), device, torch.int64)
                       for name in ("src", "dst", "old_positions", "new_positions")))
