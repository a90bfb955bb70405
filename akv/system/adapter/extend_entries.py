"""An extend forward's attention entries and per-layer copy levels.

A context request's prefill round may cover several contiguous segments in one forward. Each
segment's part is an attention entry of its own, reading the slots the plan lists for that segment
(host lists, sent once per forward); plain requests are one entry each, reading their
``req_to_token`` row. The segments' re-rotation copies run per layer after the layer's new KV is
written and before its attention (their sources may be KV born in the same forward), in levels: a
copy that reads a slot another copy writes runs in a later level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from akv.system.adapter.device import to_device
from akv.system.cache.plan import CopyJob, Segment


@dataclass(frozen=True)
class ExtendEntries:
    """The attention entries of an extend forward, in query order: a plain request (``rows[i]``, its
    ``req_to_token`` row, whose first ``n_prefix[i]`` columns it reads) or one segment's part of a
    context request's round (``rows[i] == -1``: it reads the next ``n_prefix[i]`` slots of
    ``context_prefix``). Entry ``i`` has ``n_own[i]`` queries (``qo_indptr``, int32 on the device),
    whose own slots follow its prefix in ``req_to_token`` or are the next ones of ``context_own``."""

    rows: np.ndarray
    n_prefix: np.ndarray
    n_own: np.ndarray
    qo_indptr: torch.Tensor
    context_prefix: torch.Tensor
    context_own: torch.Tensor

    def kv_lists(self, req_to_token: torch.Tensor, *, include_own: bool,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_indptr`` / ``kv_indices``: each entry's prefix, followed (``include_own``) by its own slots."""
        parts, p, o = [], 0, 0
        for row, n_prefix, n_own in zip(self.rows.tolist(), self.n_prefix.tolist(), self.n_own.tolist()):
            if row >= 0:
                parts.append(req_to_token[row, : n_prefix + (n_own if include_own else 0)])
                continue
            parts.append(self.context_prefix[p : p + n_prefix])
            if include_own:
                parts.append(self.context_own[o : o + n_own])
            p, o = p + n_prefix, o + n_own
        counts = self.n_prefix + self.n_own if include_own else self.n_prefix
        indptr = to_device(np.concatenate([[0], np.cumsum(counts)]), req_to_token.device, torch.int32)
        indices = torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype, device=req_to_token.device)
        return indptr, indices


def pieces(state: Any, lo: int, hi: int) -> Iterator[tuple[int, int, Segment]]:
    """``(a, b, segment)``: the columns ``[a, b)`` of ``[lo, hi)`` that each segment covers, in order."""
    while lo < hi:
        segment = state.current(lo)
        end = min(hi, segment.end)
        yield lo, end, segment
        lo = end


def context_round(entries: EntryLists, state: Any, lo: int, hi: int,
                  on_segment: Callable[[Segment], None] | None = None) -> tuple[list[np.ndarray], list[CopyJob]]:
    """A context request's columns ``[lo, hi)`` of a prefill round: each segment piece's attention
    entry goes to ``entries`` (the segment's visible columns in column order, then its earlier
    queries); returns the pieces' query positions and the copies that run before them.
    ``on_segment`` sees each segment the round starts."""
    positions, jobs = [], []
    for a, b, segment in pieces(state, lo, hi):
        if on_segment is not None and a == segment.start:
            on_segment(segment)
        positions.append(state.round_positions(a, b))
        prefix = np.concatenate([state.resolve(segment.prefix_slots), state.active.births[segment.start : a]])
        entries.context(prefix, state.active.births[a:b])
        job = state.round_copies(a)
        if job is not None:
            jobs.append(job)
    return positions, jobs


def add_layer_jobs(levels: list[list[CopyJob]], jobs: list[CopyJob]) -> None:
    """Add one request's copy jobs to the forward's launch levels: a job that reads a slot an earlier
    job of the level writes goes one level further (levels run in order, each in one launch)."""
    level, written = 0, np.zeros(0, dtype=np.int64)
    for job in jobs:
        if np.isin(job.src, written).any():
            level, written = level + 1, job.dst
        else:
            written = np.concatenate([written, job.dst])
        while len(levels) <= level:
            levels.append([])
        levels[level].append(job)


class EntryLists:
    """Host side of :class:`ExtendEntries` while a batch is walked."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.n_prefix: list[int] = []
        self.n_own: list[int] = []
        self.prefix: list[np.ndarray] = []
        self.own: list[np.ndarray] = []

    def plain(self, row: int, n_prefix: int, n_own: int) -> None:
        self.rows.append(row)
        self.n_prefix.append(n_prefix)
        self.n_own.append(n_own)

    def context(self, prefix: np.ndarray, own: np.ndarray) -> None:
        self.plain(-1, prefix.size, own.size)
        self.prefix.append(prefix)
        self.own.append(own)

    def build(self, device: Any) -> ExtendEntries:
        def cat(arrays: list[np.ndarray]) -> torch.Tensor:
            return to_device(np.concatenate(arrays) if arrays else np.zeros(0, np.int64), device, torch.int32)

        n_own = np.asarray(self.n_own, dtype=np.int64)
        qo_indptr = to_device(np.concatenate([[0], np.cumsum(n_own)]), device, torch.int32)
        return ExtendEntries(rows=np.asarray(self.rows, dtype=np.int64), n_prefix=np.asarray(self.n_prefix, dtype=np.int64),
                             n_own=n_own, qo_indptr=qo_indptr, context_prefix=cat(self.prefix), context_own=cat(self.own))
