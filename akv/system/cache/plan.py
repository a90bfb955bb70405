"""Plan objects handed from the cache core to an engine (frozen; arrays are int64 and read-only).

Vocabulary: a *version* of a token's KV is one slot holding its K rotated for one position (V is the
same in every version). Slots are written once and never rewritten while referenced, so versions
can be shared between requests and tree branches freely.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from akv.system.arrays import frozen, in_sorted


class VersionRuns:
    """The versions a match found, as the tree held them then: runs of consecutive records, each
    ``(slots, positions, held)``: arrays of shape (records, width) that nothing writes again (the tree
    copies a node's arrays before editing them while a match holds them) and whether each record
    holds a version (None: computed here); ``starts[i]`` is the first record of run ``i``,
    ``token_record[t]`` the record of matched token ``t``; versions in ``hidden`` (ascending slots)
    count as absent."""

    __slots__ = ("runs", "starts", "token_record", "hidden", "width")

    def __init__(self, runs: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]], starts: np.ndarray,
                 token_record: np.ndarray, hidden: np.ndarray | None = None) -> None:
        self.runs = runs
        self.starts = starts
        self.token_record = token_record
        self.hidden = hidden if hidden is not None and hidden.size else None
        self.width = max((r[0].shape[1] for r in runs), default=1)

    def gather(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Versions of matched ``tokens``, -1 padded to ``width`` columns; reads only their rows."""
        rows = self.token_record[tokens]
        if rows.size > 1 and (rows[1:] < rows[:-1]).any():
            order = np.argsort(rows, kind="stable")
            slots, positions = np.empty((rows.size, self.width), np.int64), np.empty((rows.size, self.width), np.int64)
            slots[order], positions[order] = self.gather(tokens[order])
            return slots, positions
        slots = np.full((rows.size, self.width), -1, dtype=np.int64)
        positions = np.full((rows.size, self.width), -1, dtype=np.int64)
        if rows.size == 0:
            return slots, positions
        bounds = np.searchsorted(rows, np.append(self.starts, np.iinfo(np.int64).max)).tolist()
        for i, (run_slots, run_positions, _) in enumerate(self.runs):
            lo, hi = bounds[i], bounds[i + 1]
            if hi == lo:
                continue
            local = rows[lo:hi] - self.starts[i]
            first, last = int(local[0]), int(local[-1])
            index = slice(first, last + 1) if last - first + 1 == hi - lo else local
            w = run_slots.shape[1]
            slots[lo:hi, :w] = run_slots[index]
            positions[lo:hi, :w] = run_positions[index]
        if self.hidden is not None:
            gone = (slots >= 0) & in_sorted(self.hidden, slots)
            slots[gone] = -1
            positions[gone] = -1
        return slots, positions


@dataclass(frozen=True, eq=False)
class MatchResult:
    """What the tree holds for a request: ``n_tokens`` tokens whose whole history matched, and for
    each of them the resident versions (``slots[t, j]`` holds K rotated at ``positions[t, j]``; -1
    pads). ``n_records`` counts matched records, events included. The versions are read from
    ``source`` as they were at the match: :meth:`versions` for some tokens, ``slots`` /
    ``positions`` for all of them."""

    n_tokens: int
    n_records: int
    source: VersionRuns

    @classmethod
    def of(cls, n_tokens: int, n_records: int, slots: np.ndarray, positions: np.ndarray) -> MatchResult:
        """A match holding the given tables (row ``t``: token ``t``'s versions)."""
        slots, positions = np.asarray(slots, dtype=np.int64), np.asarray(positions, dtype=np.int64)
        source = VersionRuns([(frozen(slots), frozen(positions), None)], np.zeros(1, np.int64),
                             frozen(np.arange(n_tokens, dtype=np.int64)))
        return cls(n_tokens, n_records, source)

    @property
    def width(self) -> int:
        return self.source.width

    def versions(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, positions)`` rows of matched ``tokens``."""
        return self.source.gather(np.asarray(tokens, dtype=np.int64))

    @cached_property
    def _table(self) -> tuple[np.ndarray, np.ndarray]:
        slots, positions = self.versions(np.arange(self.n_tokens, dtype=np.int64))
        return frozen(slots), frozen(positions)

    @property
    def slots(self) -> np.ndarray:
        return self._table[0]

    @property
    def positions(self) -> np.ndarray:
        return self._table[1]

    @cached_property
    def resident(self) -> np.ndarray:
        """Per matched token: at least one version is resident."""
        source = self.source
        if source.hidden is not None:
            held = self.slots >= 0
            return frozen(held.any(axis=1) if held.shape[1] else np.zeros(self.n_tokens, dtype=bool))
        parts = []
        for run_slots, _, held in source.runs:
            if held is None:
                held = run_slots[:, 0] >= 0
                for j in range(1, run_slots.shape[1]):  # by column: any(axis=1) over a few columns is ~10x slower
                    held |= run_slots[:, j] >= 0
            parts.append(held)
        held = np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
        return frozen(held[source.token_record[: self.n_tokens]] if self.n_tokens else np.zeros(0, dtype=bool))

    @classmethod
    def empty(cls) -> MatchResult:
        """Nothing resident: what an empty tree (or a cold plan) matches."""
        none = np.zeros((0, 1), dtype=np.int64)
        return cls.of(0, 0, none, none)


@dataclass(frozen=True)
class CopyJob:
    """Copy KV from ``src`` slots to ``dst`` slots, re-rotating K from ``old_positions`` to
    ``new_positions`` (``R(new) R(old)^-1``, FP32); V is copied unchanged. ``tokens`` says whose."""

    tokens: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    old_positions: np.ndarray
    new_positions: np.ndarray

    @property
    def size(self) -> int:
        return int(self.dst.shape[0])


@dataclass(frozen=True)
class Segment:
    """One forward of consecutive queries ``start .. end - 1``, all at stage ``stage``.

    Run ``copies`` first. Query ``i`` (token ``start + i``) is at ``positions[i]`` and writes its KV
    into ``slots[i]``; it attends to ``prefix_slots`` (the earlier tokens ``prefix_tokens`` it sees,
    K rotated at ``prefix_positions``) and to ``slots[: i + 1]`` (causal within the segment).
    """

    stage: int
    start: int
    end: int
    positions: np.ndarray
    slots: np.ndarray
    prefix_tokens: np.ndarray
    prefix_slots: np.ndarray
    prefix_positions: np.ndarray
    copies: CopyJob

    @property
    def n_queries(self) -> int:
        return self.end - self.start

    def chunks(self, max_queries: int) -> tuple[Segment, ...]:
        """The same work as forwards of at most ``max_queries`` queries (chunked prefill): each chunk
        reads the earlier chunks' slots as prefix; the copies run before the first."""
        if max_queries < 1:
            raise ValueError(f"max_queries: {max_queries} is not a positive int")
        out = []
        for lo in range(0, self.n_queries, max_queries):
            hi = min(lo + max_queries, self.n_queries)
            done = np.arange(self.start, self.start + lo, dtype=np.int64)
            out.append(Segment(
                stage=self.stage,
                start=self.start + lo,
                end=self.start + hi,
                positions=frozen(self.positions[lo:hi], np.int64),
                slots=frozen(self.slots[lo:hi], np.int64),
                prefix_tokens=frozen(np.concatenate([self.prefix_tokens, done]), np.int64),
                prefix_slots=frozen(np.concatenate([self.prefix_slots, self.slots[:lo]]), np.int64),
                prefix_positions=frozen(np.concatenate([self.prefix_positions, self.positions[:lo]]), np.int64),
                copies=self.copies if lo == 0 else _no_copies(),
            ))
        return tuple(out)

    def visible_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Per query, the exact slots it reads, as CSR ``(indptr, indices)``: row ``i`` is
        ``prefix_slots`` then ``slots[: i + 1]``. Quadratic in size; engines with a prefix + causal
        extend kernel pass ``prefix_slots`` and ``slots`` instead."""
        source = np.concatenate([self.prefix_slots, self.slots]).astype(np.int64)
        lengths = self.prefix_slots.shape[0] + np.arange(1, self.n_queries + 1, dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        offsets = np.arange(indptr[-1], dtype=np.int64) - np.repeat(indptr[:-1], lengths)
        return indptr, source[offsets]


@dataclass(frozen=True)
class TerminalView:
    """What generation reads: the kept tokens at their final positions, after running ``copies``.
    Generated tokens continue at ``next_position``."""

    tokens: np.ndarray
    slots: np.ndarray
    positions: np.ndarray
    copies: CopyJob
    next_position: int


@dataclass(frozen=True)
class Usage:
    """Per-request counters (DESIGN.md §2), each token counted at most once.

    ``cached_tokens``: tokens whose resident KV was read only at the position it was stored for;
    ``repos_tokens``: tokens whose resident KV was read through a re-rotated copy;
    ``drop_skipped_tokens``: prompt tokens a Drop hides from the queries after it (counted whether
    this request computed them before the Drop or reused them);
    ``computed_tokens``: prompt tokens whose KV this request computed (the prefill it actually ran).
    """

    cached_tokens: int
    repos_tokens: int
    drop_skipped_tokens: int
    computed_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {
            "cached_tokens": self.cached_tokens,
            "repos_tokens": self.repos_tokens,
            "drop_skipped_tokens": self.drop_skipped_tokens,
            "computed_tokens": self.computed_tokens,
        }


@dataclass(frozen=True)
class RequestPlan:
    """Everything an engine runs for one request: ``segments`` in order (the recovery plan, bound to
    slots), then ``terminal.copies``; ``borrowed`` are tree slots the request holds references to,
    ``fresh`` the slots allocated for it (births and copies); ``computed[t]`` marks queries that run."""

    match: MatchResult
    segments: tuple[Segment, ...]
    terminal: TerminalView
    borrowed: np.ndarray
    fresh: np.ndarray
    computed: np.ndarray
    usage: Usage

    @property
    def copies(self) -> tuple[CopyJob, ...]:
        return tuple(s.copies for s in self.segments) + (self.terminal.copies,)


def _no_copies() -> CopyJob:
    empty = frozen(np.zeros(0, dtype=np.int64), np.int64)
    return CopyJob(empty, empty, empty, empty, empty)
