"""Per-batch AKV metadata: what a forward over a batch that holds context requests needs.

Scheduler side (``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode``): commit context
requests and give each round its prefix view before SGLang writes ``req_to_token``; after SGLang
allocated the round's slots, bind them as births and collect positions, the visibility rows and the
copy jobs due. Model side (the triton backend): the KV index lists, built on the device by
:mod:`akv.system.kernels.kv_indices` from ``req_to_token`` and a per-request ``visible_until`` table.
Plain requests in the same batch read row 0 of that table, where every column is visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from akv.system.adapter import host_rows, tp_check
from akv.system.adapter.device import to_device
from akv.system.adapter.context_request import VISIBLE_ALWAYS, AkvRequest
from akv.system.cache.plan import CopyJob
from akv.system.kernels import VisibleUntil, decode_kv_indices, extend_kv_indices


@dataclass(frozen=True)
class CopyBatch:
    """Re-rotation copies of one forward, on the KV device (int64)."""

    src: torch.Tensor
    dst: torch.Tensor
    old_positions: torch.Tensor
    new_positions: torch.Tensor


@dataclass(frozen=True)
class AkvForward:
    """A forward's AKV inputs: ``positions`` per token; per entry (request) the ``visible_until``
    table row and the index of its first query, and on the host the number of keys before that
    query it reads (sizes the index lists without a device read-back); the copies to run before
    attention; ``key_positions``, for models with sliding-window layers, the position of every
    column (:class:`akv.system.adapter.window_lists.PositionTable`, rows as in ``visibility``)."""

    positions: torch.Tensor
    visibility: VisibleUntil
    visible_prefix: np.ndarray
    copies: CopyBatch | None
    key_positions: torch.Tensor | None = None


class VisibilityTable:
    """``visible_until`` per ``req_to_token`` column, one row per request slot plus row 0 (all visible)."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        rows, width = req_to_token.shape
        self.table = torch.full((rows + 1, width), VISIBLE_ALWAYS, dtype=torch.int32, device=req_to_token.device)

    def write(self, req_pool_idx: int, state: AkvRequest) -> None:
        row = state.visibility_row(self.table.shape[1])
        self.table[req_pool_idx + 1] = to_device(row.astype(np.int32), self.table.device)


def before_alloc(batch: Any) -> None:
    """Commit each context request of an extend batch and set its round's prefix view."""
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return
    core = batch.tree_cache.core
    for req in batch.reqs:
        state = getattr(req, "akv", None)
        if state is None:
            continue
        first = state.first_usage is None
        state.commit(core)
        if first:
            batch.tree_cache.metrics.admitted(state.program, state.active.plan)
        view = state.prefix_view(req.extend_range.start)
        req.prefix_indices = to_device(view, batch.device)


def for_extend(batch: Any, out_cache_loc: torch.Tensor) -> AkvForward | None:
    """Bind the rounds' births and build the forward's metadata (None for an all-plain batch); every
    request's new slots go to its host row."""
    host_rows.record(batch.reqs, list(batch.prefix_lens), list(batch.extend_lens), out_cache_loc)
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return None
    cache = batch.tree_cache
    slots = out_cache_loc.cpu().numpy().astype(np.int64)
    positions, rows, queries, prefix, copies = [], [], [], [], []
    offset = 0
    for req, lo, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        state = getattr(req, "akv", None)
        hi = lo + ext
        if state is None:
            positions.append(np.arange(lo, hi, dtype=np.int64))
            rows.append(0)
            queries.append(0)
            prefix.append(lo)
        else:
            if lo == state.first_start:
                cache.visibility.write(req.req_pool_idx, state)
            if cache.positions is not None and lo == state.current(lo).start:
                cache.positions.write_segment(req.req_pool_idx, state.current(lo))
            state.bind(cache.core, lo, slots[offset : offset + ext])
            # SGLang counts columns past cache_protected_len as KV outside the tree's accounting; a
            # context request's prompt KV (reused, copied, born) is all in the core's pool
            req.cache_protected_len = hi
            req.cached_tokens = state.first_usage.cached_tokens
            positions.append(state.round_positions(lo, hi))
            rows.append(req.req_pool_idx + 1)
            queries.append(lo)
            prefix.append(state.visible_before(lo))
            job = state.round_copies(lo)
            if job is not None:
                copies.append(job)
        offset += ext
    return _forward(cache, batch.device, np.concatenate(positions), rows, queries, prefix, copies)


def for_decode(batch: Any) -> AkvForward | None:
    """Before each decode step: terminal views into ``req_to_token`` (once), positions, copies; every
    request's new slot goes to its host row."""
    seq_lens = batch.seq_lens_cpu.numpy().astype(np.int64)
    host_rows.record(batch.reqs, (seq_lens - 1).tolist(), [1] * len(batch.reqs), batch.out_cache_loc)
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return None
    cache = batch.tree_cache
    offsets, rows, prefix, copies = [], [], [], []
    for req, seq_len in zip(batch.reqs, seq_lens):
        state = getattr(req, "akv", None)
        if state is None:
            offsets.append(0)
            rows.append(0)
            prefix.append(seq_len - 1)
            continue
        if not state.terminal_written:
            tokens, slots, job = state.terminal()
            table = batch.req_to_token_pool.req_to_token
            table[req.req_pool_idx, to_device(tokens, table.device)] = to_device(slots, table.device, table.dtype)
            state.terminal_written = True
            if cache.positions is not None:
                cache.positions.write_terminal(req.req_pool_idx, state.active.plan.terminal, state.program.n_tokens)
            if job is not None:
                copies.append(job)
        offsets.append(state.decode_offset())
        rows.append(req.req_pool_idx + 1)
        prefix.append(state.visible_before(int(seq_len) - 1))
    positions = seq_lens - 1 + np.asarray(offsets, dtype=np.int64)
    return _forward(cache, batch.device, positions, rows, (seq_lens - 1).tolist(), prefix, copies)


def _forward(cache: Any, device: Any, positions: np.ndarray, rows: list[int], queries: list[int],
             prefix: list[int], copies: list[CopyJob]) -> AkvForward:
    def dev(values: Any, dtype: torch.dtype) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), device, dtype)

    tp_check.check_plan(positions, np.asarray(rows), np.asarray(queries), np.asarray(prefix),
                        *(getattr(job, name) for job in copies for name in ("src", "dst", "new_positions")))
    visibility = VisibleUntil(visible_until=cache.visibility.table, rows=dev(rows, torch.int64),
                              query_index=dev(queries, torch.int64))
    batch_copies = None
    if copies:
        cat = lambda name: dev(np.concatenate([getattr(job, name) for job in copies]), torch.int64)  # noqa: E731
        batch_copies = CopyBatch(cat("src"), cat("dst"), cat("old_positions"), cat("new_positions"))
    key_positions = None if cache.positions is None else cache.positions.table
    return AkvForward(positions=dev(positions, torch.int64), visibility=visibility,
                      visible_prefix=np.asarray(prefix, dtype=np.int64), copies=batch_copies,
                      key_positions=key_positions)


def triton_kv_lists(forward_batch: Any, req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_indptr`` / ``kv_indices`` of SGLang's triton backend with AKV visibility: decode reads
    every visible column; extend reads the visible prefix (the round's own keys come causally)."""
    akv: AkvForward = forward_batch.akv
    if forward_batch.forward_mode.is_decode_or_idle():
        out = _index_buffer(akv.visible_prefix + 1, req_to_token.device, torch.int64)
        lists = decode_kv_indices(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                  akv.visibility, out=out, validate=False)
    else:
        out = _index_buffer(akv.visible_prefix, req_to_token.device, torch.int64)
        lists = extend_kv_indices(req_to_token, forward_batch.req_pool_indices,
                                  forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, akv.visibility,
                                  include_extend=False, out=out, validate=False).kv
    return lists.kv_indptr, lists.kv_indices


def _index_buffer(counts: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An index list sized from host counts (no device read-back)."""
    return torch.empty(int(counts.sum()), dtype=dtype, device=device)
