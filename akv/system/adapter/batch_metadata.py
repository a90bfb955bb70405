"""Per-batch AKV metadata: what a forward over a batch that holds context requests needs.

Scheduler side (``ScheduleBatch.prepare_for_extend`` / ``prepare_for_decode``): commit context
requests and give each round its prefix view before SGLang writes ``req_to_token``; after SGLang
allocated the round's slots, bind them as births and collect positions, the attention entries and the
copy jobs due. A context request's round may cover several segments (one forward for all of them):
each segment's part is an attention entry of its own that reads the slots the plan lists for that
segment (host lists, sent once per forward); the segments' copies run per layer, after the layer's new
KV is written and before its attention (:func:`akv.system.adapter.copy_executor.run_layer_copies`),
since their sources may be KV born in the same forward. Model side: the extend KV lists of SGLang's
triton / FlashInfer backends from those entries; the decode lists built on the device by
:mod:`akv.system.kernels.kv_indices` from ``req_to_token`` and a per-request ``visible_until`` table
(plain requests read row 0 of that table, where every column is visible).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from akv.system.adapter import host_rows, tp_check
from akv.system.adapter.device import to_device
from akv.system.adapter.context_request import VISIBLE_ALWAYS, AkvRequest
from akv.system.adapter.copy_executor import CopyBatch
from akv.system.adapter.extend_entries import EntryLists, ExtendEntries, add_layer_jobs, context_round
from akv.system.adapter.prefill_timing import ForwardTimer
from akv.system.cache.plan import CopyJob
from akv.system.kernels import VisibleUntil, decode_kv_indices


@dataclass(frozen=True)
class AkvForward:
    """A forward's AKV inputs: ``positions`` per token; per request the ``visible_until`` table row
    and the index of its first query; per entry (a request at decode, :class:`ExtendEntries` at
    extend) on the host the number of keys before its first query it reads (sizes the index lists
    without a device read-back); the copies to run before the forward (decode) and, level by level,
    those to run per layer between its KV write and its attention (extend); ``key_positions``, for
    models with sliding-window layers, the position of every column
    (:class:`akv.system.adapter.window_lists.PositionTable`, rows as in ``visibility``)."""

    positions: torch.Tensor
    visibility: VisibleUntil
    visible_prefix: np.ndarray
    copies: CopyBatch | None
    key_positions: torch.Tensor | None = None
    entries: ExtendEntries | None = None
    layer_copies: tuple[CopyBatch, ...] = ()
    timer: ForwardTimer | None = None


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
        if state.active is None:
            state.prefill.admitted(req.time_stats.wait_queue_entry_time)
        state.commit(core)
        if first:
            batch.tree_cache.metrics.admitted(state.program, state.active.plan)
        view = state.prefix_view(req.extend_range.start)
        req.prefix_indices = to_device(view, batch.device)


def for_extend(batch: Any, out_cache_loc: torch.Tensor) -> AkvForward | None:
    """Bind the rounds' births and build the forward's metadata (None for an all-plain batch); every
    request's new slots go to its host row. A context request's round becomes one attention entry
    per segment it covers, each reading that segment's own visible slots."""
    host_rows.record(batch.reqs, list(batch.prefix_lens), list(batch.extend_lens), out_cache_loc)
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return None
    cache = batch.tree_cache
    slots = out_cache_loc.cpu().numpy().astype(np.int64)
    positions, rows, queries = [], [], []
    entries = EntryLists()
    layer_jobs: list[list[CopyJob]] = []
    timer = ForwardTimer(batch.device) if cache.metrics.timing() else None
    offset = 0
    for req, lo, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        state = getattr(req, "akv", None)
        hi = lo + ext
        if state is None:
            positions.append(np.arange(lo, hi, dtype=np.int64))
            rows.append(0)
            queries.append(0)
            entries.plain(req.req_pool_idx, lo, ext)
            offset += ext
            continue
        started = time.perf_counter()
        if lo == state.first_start:
            cache.visibility.write(req.req_pool_idx, state)
        state.bind(cache.core, lo, slots[offset : offset + ext])
        # SGLang counts columns past cache_protected_len as KV outside the tree's accounting; a
        # context request's prompt KV (reused, copied, born) is all in the core's pool
        req.cache_protected_len = hi
        req.cached_tokens = state.first_usage.cached_tokens
        write_segment = None if cache.positions is None else partial(cache.positions.write_segment, req.req_pool_idx)
        round_positions, jobs = context_round(entries, state, lo, hi, write_segment)
        positions.extend(round_positions)
        add_layer_jobs(layer_jobs, jobs)
        rows.append(req.req_pool_idx + 1)
        queries.append(lo)
        state.prefill.round(time.perf_counter() - started, hi == state.program.n_tokens, timer)
        offset += ext
    return _forward(cache, batch.device, np.concatenate(positions), rows, queries, entries.n_prefix, [],
                    entries.build(batch.device), layer_jobs, timer)


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
    return _forward(cache, batch.device, positions, rows, (seq_lens - 1).tolist(), prefix, copies, None, [])


def _forward(cache: Any, device: Any, positions: np.ndarray, rows: list[int], queries: list[int],
             prefix: list[int], copies: list[CopyJob], entries: ExtendEntries | None,
             layer_jobs: list[list[CopyJob]], timer: ForwardTimer | None = None) -> AkvForward:
    def dev(values: Any, dtype: torch.dtype) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), device, dtype)

    def batch_of(jobs: list[CopyJob]) -> CopyBatch:
        cat = lambda name: dev(np.concatenate([getattr(job, name) for job in jobs]), torch.int64)  # noqa: E731
        return CopyBatch(cat("src"), cat("dst"), cat("old_positions"), cat("new_positions"))

    every_job = copies + [job for level in layer_jobs for job in level]
    tp_check.check_plan(positions, np.asarray(rows), np.asarray(queries), np.asarray(prefix),
                        *(getattr(job, name) for job in every_job for name in ("src", "dst", "new_positions")))
    visibility = VisibleUntil(visible_until=cache.visibility.table, rows=dev(rows, torch.int64),
                              query_index=dev(queries, torch.int64))
    key_positions = None if cache.positions is None else cache.positions.table
    return AkvForward(positions=dev(positions, torch.int64), visibility=visibility,
                      visible_prefix=np.asarray(prefix, dtype=np.int64), copies=batch_of(copies) if copies else None,
                      key_positions=key_positions, entries=entries,
                      layer_copies=tuple(batch_of(level) for level in layer_jobs), timer=timer)


def triton_kv_lists(forward_batch: Any, req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_indptr`` / ``kv_indices`` of SGLang's triton backend with AKV visibility: decode reads
    every visible column; extend each entry's prefix (its own keys come causally)."""
    akv: AkvForward = forward_batch.akv
    if forward_batch.forward_mode.is_decode_or_idle():
        out = _index_buffer(akv.visible_prefix + 1, req_to_token.device, torch.int64)
        lists = decode_kv_indices(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                  akv.visibility, out=out, validate=False)
        return lists.kv_indptr, lists.kv_indices
    return akv.entries.kv_lists(req_to_token, include_own=False, dtype=torch.int64)


def triton_qo_indptr(forward_batch: Any, qo_indptr: torch.Tensor) -> torch.Tensor:
    """The extend kernel's query segments: SGLang's one per request, or AKV's entries."""
    akv: AkvForward | None = forward_batch.akv
    return qo_indptr if akv is None or akv.entries is None else akv.entries.qo_indptr


def _index_buffer(counts: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An index list sized from host counts (no device read-back)."""
    return torch.empty(int(counts.sum()), dtype=dtype, device=device)
