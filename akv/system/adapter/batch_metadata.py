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
    table row and the index of its first query; the copies to run before attention;
    ``key_positions``, for models with sliding-window layers, the position of every column
    (:class:`akv.system.adapter.window_lists.PositionTable`, rows as in ``visibility``)."""

    positions: torch.Tensor
    visibility: VisibleUntil
    copies: CopyBatch | None
    key_positions: torch.Tensor | None = None


class VisibilityTable:
    """``visible_until`` per ``req_to_token`` column, one row per request slot plus row 0 (all visible)."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        rows, width = req_to_token.shape
        self.table = torch.full((rows + 1, width), VISIBLE_ALWAYS, dtype=torch.int32, device=req_to_token.device)

    def write(self, req_pool_idx: int, state: AkvRequest) -> None:
        row = state.visibility_row(self.table.shape[1])
        self.table[req_pool_idx + 1] = torch.from_numpy(row.astype(np.int32)).to(self.table.device)


def _settle(batch: Any) -> None:
    """Before a context batch rewrites ``req_to_token`` rows on the host side, let the forward in
    flight (overlap scheduling) finish reading them."""
    if torch.device(batch.device).type == "cuda":
        torch.cuda.synchronize(batch.device)


def before_alloc(batch: Any) -> None:
    """Commit each context request of an extend batch and set its round's prefix view."""
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return
    _settle(batch)
    core = batch.tree_cache.core
    for req in batch.reqs:
        state = getattr(req, "akv", None)
        if state is None:
            continue
        state.commit(core)
        view = state.prefix_view(req.extend_range.start)
        req.prefix_indices = torch.from_numpy(view).to(batch.device)


def for_extend(batch: Any, out_cache_loc: torch.Tensor) -> AkvForward | None:
    """Bind the rounds' births and build the forward's metadata (None for an all-plain batch)."""
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return None
    cache = batch.tree_cache
    slots = out_cache_loc.cpu().numpy().astype(np.int64)
    positions, rows, queries, copies = [], [], [], []
    offset = 0
    for req, lo, ext in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        state = getattr(req, "akv", None)
        hi = lo + ext
        if state is None:
            positions.append(np.arange(lo, hi, dtype=np.int64))
            rows.append(0)
            queries.append(0)
        else:
            if lo == state.first_start:
                cache.visibility.write(req.req_pool_idx, state)
            if cache.positions is not None and lo == state.current(lo).start:
                cache.positions.write_segment(req.req_pool_idx, state.current(lo))
            state.bind(cache.core, lo, slots[offset : offset + ext])
            req.cached_tokens = state.first_usage.cached_tokens
            positions.append(state.round_positions(lo, hi))
            rows.append(req.req_pool_idx + 1)
            queries.append(lo)
            job = state.round_copies(lo)
            if job is not None:
                copies.append(job)
        offset += ext
    return _forward(cache, batch.device, np.concatenate(positions), rows, queries, copies)


def for_decode(batch: Any) -> AkvForward | None:
    """Before each decode step: terminal views into ``req_to_token`` (once), positions, copies."""
    if not any(getattr(r, "akv", None) is not None for r in batch.reqs):
        return None
    _settle(batch)
    cache = batch.tree_cache
    seq_lens = batch.seq_lens_cpu.numpy().astype(np.int64)
    offsets, rows, copies = [], [], []
    for req in batch.reqs:
        state = getattr(req, "akv", None)
        if state is None:
            offsets.append(0)
            rows.append(0)
            continue
        if not state.terminal_written:
            tokens, slots, job = state.terminal()
            table = batch.req_to_token_pool.req_to_token
            table[req.req_pool_idx, torch.from_numpy(tokens).to(table.device)] = torch.from_numpy(slots).to(
                table.device, table.dtype)
            state.terminal_written = True
            if cache.positions is not None:
                cache.positions.write_terminal(req.req_pool_idx, state.active.plan.terminal, state.program.n_tokens)
            if job is not None:
                copies.append(job)
        offsets.append(state.decode_offset())
        rows.append(req.req_pool_idx + 1)
    positions = seq_lens - 1 + np.asarray(offsets, dtype=np.int64)
    return _forward(cache, batch.device, positions, rows, (seq_lens - 1).tolist(), copies)


def _forward(cache: Any, device: Any, positions: np.ndarray, rows: list[int], queries: list[int],
             copies: list[CopyJob]) -> AkvForward:
    def dev(values: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device=device, dtype=dtype)

    visibility = VisibleUntil(visible_until=cache.visibility.table, rows=dev(rows, torch.int64),
                              query_index=dev(queries, torch.int64))
    batch_copies = None
    if copies:
        cat = lambda name: dev(np.concatenate([getattr(job, name) for job in copies]), torch.int64)  # noqa: E731
        batch_copies = CopyBatch(cat("src"), cat("dst"), cat("old_positions"), cat("new_positions"))
    key_positions = None if cache.positions is None else cache.positions.table
    return AkvForward(positions=dev(positions, torch.int64), visibility=visibility, copies=batch_copies,
                      key_positions=key_positions)


def triton_kv_lists(forward_batch: Any, req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_indptr`` / ``kv_indices`` of SGLang's triton backend with AKV visibility: decode reads
    every visible column; extend reads the visible prefix (the round's own keys come causally)."""
    akv: AkvForward = forward_batch.akv
    if forward_batch.forward_mode.is_decode_or_idle():
        lists = decode_kv_indices(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
                                  akv.visibility, index_dtype=torch.int64)
    else:
        lists = extend_kv_indices(req_to_token, forward_batch.req_pool_indices,
                                  forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, akv.visibility,
                                  include_extend=False, index_dtype=torch.int64).kv
    return lists.kv_indptr, lists.kv_indices
