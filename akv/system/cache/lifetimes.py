"""Birth lifetimes of an in-place plan, for an engine that writes a request's births round by round
into slots it allocates itself (the patched SGLang server).

A birth (token ``t``'s KV, virtual slot ``-2 - t``) is read by its own segment, by later segments'
prefixes and copies (a birth re-rotated in place keeps its id), and by generation when the terminal
view reads it. Once the last segment that reads it has run, and generation does not, its slot can go
back to the pool: no later step reads it. With that, what a request holds at once is not its text
but, per round, the births still read from earlier rounds plus the round's own births; rounds cut
at segment ends keep that under a limit (:meth:`BirthLifetimes.round_end`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from akv.system.arrays import frozen
from akv.system.cache.plan import RequestPlan
from akv.system.context.program import ContextProgram

FOREVER = np.iinfo(np.int64).max
"""``last_step`` of a birth generation reads (held to the end of the request)."""


@dataclass(frozen=True)
class BirthLifetimes:
    """Per segment ``starts`` / ``ends`` (columns) and ``alive[k]``: births of earlier segments held
    while segment ``k`` runs (their last reader is ``k`` or later); ``by_death``: the births (tokens)
    in the order no step reads them any more, ``deaths`` the last segment that reads each (its own
    at least; :data:`FOREVER` where generation reads it)."""

    starts: np.ndarray
    ends: np.ndarray
    alive: np.ndarray
    by_death: np.ndarray
    deaths: np.ndarray

    @classmethod
    def of(cls, plan: RequestPlan, n_tokens: int) -> BirthLifetimes:
        """The lifetimes of ``plan``'s births (births still virtual: ``-2 - t``)."""
        born = np.full(n_tokens, -1, dtype=np.int64)
        last = np.full(n_tokens, -1, dtype=np.int64)

        def touch(slots: np.ndarray, step: int) -> None:
            ids = -2 - slots[(slots <= -2) & (slots > -2 - n_tokens)]
            np.maximum.at(last, ids, step)

        for k, s in enumerate(plan.segments):
            born[s.start : s.end] = k
            last[s.start : s.end] = np.maximum(last[s.start : s.end], k)
            for slots in (s.prefix_slots, s.copies.src, s.copies.dst):
                touch(slots, k)
        terminal = plan.terminal
        for slots in (terminal.slots, terminal.copies.src, terminal.copies.dst):
            ids = -2 - slots[(slots <= -2) & (slots > -2 - n_tokens)]
            last[ids] = FOREVER
        n_segments = len(plan.segments)
        starts = np.fromiter((s.start for s in plan.segments), np.int64, n_segments)
        ends = np.fromiter((s.end for s in plan.segments), np.int64, n_segments)
        births = np.flatnonzero(born >= 0)
        by_death = births[np.argsort(last[births], kind="stable")]
        deaths = last[by_death]
        born_before = np.concatenate([[0], np.cumsum(ends - starts)])[:n_segments]
        alive = born_before - np.searchsorted(deaths, np.arange(n_segments), side="left")
        return cls(*(frozen(a, np.int64) for a in (starts, ends, alive, by_death, deaths)))

    def segment_of(self, column: int) -> int:
        """The first segment ending after ``column`` (``len(segments)`` past the last)."""
        return int(np.searchsorted(self.ends, column, side="right"))

    def held_at(self, column: int) -> int:
        """Births held when a round starts at ``column`` (those of earlier rounds still read there)."""
        k = self.segment_of(column)
        if k == self.ends.size:
            return int(self.deaths.size - np.searchsorted(self.deaths, FOREVER))
        return int(self.alive[k]) + max(column - int(self.starts[k]), 0)

    def n_dead_before(self, column: int) -> int:
        """How many births (the first of ``by_death``) no round from ``column`` on reads, nor generation."""
        return int(np.searchsorted(self.deaths, self.segment_of(column), side="left"))

    def single_peak(self) -> int:
        """The fewest births a request holds at once: each segment its own round (0 for no births)."""
        if not self.ends.size:
            return 0
        return int((self.alive + self.ends - self.starts).max())

    def round_end(self, lo: int, end: int, limit: int) -> int:
        """Extend a round from column ``lo`` that reaches ``end`` (a segment's end) over the next
        contiguous segments while the births it holds stay within ``limit``; the last end reached."""
        k = self.segment_of(end - 1)
        held = self.held_at(lo) + end - lo
        while k + 1 < self.ends.size and self.starts[k + 1] == end:
            grown = held + int(self.ends[k + 1] - self.starts[k + 1])
            if grown > limit:
                break
            k, held, end = k + 1, grown, int(self.ends[k + 1])
        return end


def cold_single_peak(program: ContextProgram) -> int:
    """:meth:`BirthLifetimes.single_peak` of ``program``'s plan on an empty cache with births rotated
    in place (a plan that allocates no copy slots), from the program's drop ranges alone.

    On an empty cache every token read is a birth. A token no Drop hides is computed (the last token
    always is, and reads it). The tokens of a drop range, hidden from query ``at`` on, are computed
    together exactly when a computed token lies from the range's end to before ``at``, or when the
    range ends the text.
    Segments are the computed runs, cut where an event applies. A computed hidden token is last read
    by the last segment starting before its range's ``at``; one no Drop hides, by generation."""
    n = program.n_tokens
    ranges = sorted(((s, e, event.at) for event in program.events for s, e in event.ranges), reverse=True)
    unread: list[tuple[int, int]] = []
    read: list[tuple[int, int]] = []  # (births, at) of the computed ranges
    later_start, later_first = n, n  # the next range's start, the first computed token from there on
    for s, e, at in ranges:
        first = later_first if e == later_start else e  # the first computed token from e on
        if e == n or first < at:
            read.append((e - s, at))
            later_first = s
        else:
            unread.append((s, e))
            later_first = first
        later_start = s
    unread_starts, unread_ends = np.array(unread[::-1], dtype=np.int64).reshape(-1, 2).T
    ats = np.fromiter((event.at for event in program.events), np.int64)
    points = np.unique(np.concatenate([[0, n], unread_starts, unread_ends, ats]))
    after = np.searchsorted(unread_starts, points[:-1], side="right")  # unread ranges starting at or before
    computed = points[:-1] >= np.concatenate([[0], unread_ends])[after]
    starts, sizes = points[:-1][computed], np.diff(points)[computed]
    births, hidden_at = np.array(read, dtype=np.int64).reshape(-1, 2).T
    last = np.searchsorted(starts, hidden_at, side="left") - 1
    dead_by = np.cumsum(np.bincount(last, weights=births, minlength=starts.size)).astype(np.int64)
    alive = np.cumsum(sizes) - sizes - np.concatenate([[0], dead_by[:-1]])
    return int((alive + sizes).max(initial=0))
