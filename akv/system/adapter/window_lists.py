"""Sliding-window KV lists of SGLang's triton backend for batches with context requests (gpt-oss).

Contract (the oracle's, :mod:`akv.system.reference.gpt_oss`): a query at position ``p`` of a layer
with window ``W`` (``config.sliding_window``; SGLang stores the radius ``W - 1``) reads the visible
keys whose current position is greater than ``p - W``. Key positions come from a
:class:`PositionTable` (current position per ``req_to_token`` column, written from the plan), cut
out of the full visible lists by :func:`akv.system.kernels.window_indices.window_kv_indices`.

An extend entry's list is exact for its first query; SGLang's extend kernel gives the later queries
a suffix of it by list index. Where that differs from the positional window (the listed positions
have a gap, left by a Drop without a reposition), :func:`exact_round_end` ends the round early, so
every round is exact.

Plain entries keep stock SGLang 0.5.16 semantics, so a plain request's tokens never depend on its
batch: extend reads the window above, decode one key fewer (stock caps the decode list at the
radius, sgl-project/sglang#32087).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from akv.system.adapter.device import to_device
from akv.system.cache.plan import Segment, TerminalView
from akv.system.kernels import decode_kv_indices, extend_kv_indices
from akv.system.kernels.kv_indices import KVIndexLists
from akv.system.kernels.window_indices import window_kv_indices


def window_from_radius(radius: int | None) -> int | None:
    """``W`` from SGLang's ``sliding_window_size`` (``W - 1``; None or < 1: no sliding layers)."""
    return None if radius is None or radius < 1 else int(radius) + 1


class PositionTable:
    """Current position per ``req_to_token`` column: row 0 is the identity (plain requests), row
    ``req_pool_idx + 1`` a context request's, written at each segment's first round and at its
    terminal view (the rows of :class:`akv.system.adapter.batch_metadata.VisibilityTable`)."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        rows, width = req_to_token.shape
        columns = torch.arange(width, dtype=torch.int32, device=req_to_token.device)
        self.table = columns.repeat(rows + 1, 1)

    def write_segment(self, req_pool_idx: int, segment: Segment) -> None:
        """Positions a segment's rounds read: its prefix at the stage's positions, then its own."""
        row = self.table[req_pool_idx + 1]
        prefix = to_device(segment.prefix_tokens, row.device, torch.int64)
        row[prefix] = to_device(segment.prefix_positions, row.device, torch.int32)
        row[segment.start : segment.end] = to_device(segment.positions, row.device, torch.int32)

    def write_terminal(self, req_pool_idx: int, view: TerminalView, n_tokens: int) -> None:
        """The kept prompt at its final positions; generated columns continue at ``next_position``."""
        row = self.table[req_pool_idx + 1]
        row[to_device(view.tokens, row.device, torch.int64)] = to_device(view.positions, row.device, torch.int32)
        generated = torch.arange(row.shape[0] - n_tokens, dtype=torch.int32, device=row.device)
        row[n_tokens:] = generated + view.next_position



def exact_round_end(key_positions: np.ndarray, query_positions: np.ndarray, window: int) -> int:
    """How many leading queries of a round SGLang's extend kernel serves exactly (at least 1).

    ``key_positions``: the round's visible prefix keys in list order; ``query_positions``: its queries.
    The kernel keeps for query ``j`` the prefix keys of list index ``>= L + j - (W - 1)`` (``L`` keys
    listed: those in the first query's window) and the round's own keys ``k`` with ``j - k <= W - 1``;
    the contract keeps every key whose position is greater than ``query_positions[j] - W``."""
    keys = np.asarray(key_positions, dtype=np.int64)
    queries = np.asarray(query_positions, dtype=np.int64)
    if queries.size == 0:
        raise ValueError("query_positions: a round has at least one query")
    ok = queries == queries[0] + np.arange(queries.size)  # own keys: index distance = position distance
    listed = keys[keys > queries[0] - window]
    j = np.arange(min(queries.size, window))  # from j = W - 1 on, both rules keep no prefix key
    by_index = np.arange(listed.size)[None, :] >= listed.size + j[:, None] - (window - 1)
    by_position = listed[None, :] > queries[j, None] - window
    ok[j] &= (by_index == by_position).all(axis=1)
    bad = np.flatnonzero(~ok)
    return max(1, int(bad[0])) if bad.size else int(queries.size)


def segment_round_end(segment: Segment, lo: int, hi: int, window: int) -> int:
    """End (at most ``hi``) of the exact round of ``segment`` that starts at column ``lo``."""
    order = np.argsort(segment.prefix_tokens, kind="stable")
    keys = np.concatenate([segment.prefix_positions[order], segment.positions[: lo - segment.start]])
    return lo + exact_round_end(keys, segment.positions[lo - segment.start : hi - segment.start], window)


def triton_window_lists(forward_batch: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                        radius: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``window_kv_indptr``, ``window_kv_indices``, ``window_kv_lens`` and ``window_kv_offsets`` of
    the triton backend, cut from the batch's full AKV lists (``kv_indptr`` / ``kv_indices``)."""
    akv = forward_batch.akv
    if akv.key_positions is None:
        raise RuntimeError("AKV: a sliding-window batch carries no key positions (the cache was built "
                           "without the model's sliding window)")
    visibility, rows = akv.visibility, akv.visibility.rows
    plain = rows == 0
    if forward_batch.forward_mode.is_decode_or_idle():
        keys = decode_kv_indices(akv.key_positions, rows, forward_batch.seq_lens, visibility,
                                 index_dtype=torch.int64)
        queries = akv.positions + plain.to(akv.positions.dtype)
    else:
        keys = extend_kv_indices(akv.key_positions, rows, forward_batch.extend_prefix_lens,
                                 forward_batch.extend_seq_lens, visibility, include_extend=False,
                                 index_dtype=torch.int64).kv
        first = torch.cumsum(forward_batch.extend_seq_lens, 0) - forward_batch.extend_seq_lens
        queries = akv.positions[first.long()]
    n_listed = int(kv_indptr[-1])
    full = KVIndexLists(kv_indptr=kv_indptr, kv_indices=kv_indices[:n_listed], kv_last_page_len=keys.kv_last_page_len)
    cut = window_kv_indices(full, keys.kv_indices[:n_listed], queries, window_from_radius(radius))
    lens = (cut.kv_indptr[1:] - cut.kv_indptr[:-1]).to(torch.int32)
    return cut.kv_indptr, cut.kv_indices, lens, torch.zeros_like(lens)
