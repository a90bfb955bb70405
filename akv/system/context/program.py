"""The compiled context program: what one request's tokens and cache events mean, token by token.

Vocabulary (DESIGN.md §1):

- Token ``t`` (0-based index into the prompt, then generated tokens) is *appended* at stage
  ``birth_stage[t]``; its query uses position ``birth_position[t]``.
- Events are applied between tokens. ``Event.at`` is the number of tokens already appended when
  the event applies (it acts after token ``at - 1`` and before token ``at``). Events are ordered by
  anchor message (so by ``at``), and at one anchor the Drop comes before the Repos.
- The *stage* of a point in the stream is the number of events applied so far; event ``i`` moves the
  stream from stage ``i`` to stage ``i + 1``.
- A Drop hides its tokens from every query appended after it; ``visible_until[t]`` is the first
  query index that no longer sees token ``t`` (``n_tokens`` for tokens no Drop hides, which is also
  the value a Drop anchored at the end of a prompt without reply tokens gives; use ``keep[t]`` for
  what generated tokens see).
- A Repos gives the visible keys positions ``0 .. r-1`` in order; the next append continues at
  ``r``. ``transitions`` holds one entry per Repos (in event order) with the old and new positions
  of the visible tokens whose position changes; tokens already at their compact position are
  omitted, so an already-compact Repos has an empty transition.
- Build programs with :func:`akv.system.context.compiler.compile_program`; extend them with
  generated tokens with :func:`akv.system.context.compiler.append_generated`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

import numpy as np

from akv.system.arrays import frozen


class EventKind(IntEnum):
    DROP = 1
    REPOS = 2


@dataclass(frozen=True)
class Event:
    """One cache operation applied at a message boundary.

    ``anchor`` is the message after which it applies; a Drop lists its ``messages`` in request order
    and the token ``ranges`` they own (half-open, sorted, merged where adjacent, empty ones left out).
    """

    kind: EventKind
    at: int
    anchor: int
    messages: tuple[int, ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()

    @property
    def hidden_count(self) -> int:
        return sum(end - start for start, end in self.ranges)


@dataclass(frozen=True)
class DropRanges:
    """Every Drop's token ranges (half-open, disjoint), sorted by start, with the index of their Drop
    event (``stages``); int64 read-only arrays."""

    starts: np.ndarray
    ends: np.ndarray
    stages: np.ndarray

    @classmethod
    def of(cls, events: tuple[Event, ...]) -> DropRanges:
        rows = np.array([(s, e, i) for i, event in enumerate(events) for s, e in event.ranges], dtype=np.int64)
        rows = rows.reshape(-1, 3)
        rows = rows[np.argsort(rows[:, 0])]  # disjoint: the starts differ
        return cls(frozen(rows[:, 0]), frozen(rows[:, 1]), frozen(rows[:, 2]))

    def moves(self, stage: int, previous: int, born: int) -> Moves:
        """What the Repos ``events[stage]`` moves; ``previous`` is the index of the Repos before it (-1
        if none), ``born`` the tokens appended before it. Tokens before the first range hidden since
        ``previous`` keep their positions; each visible token after it moves to the number of visible
        tokens before it, from the number of tokens before it visible at ``previous``."""
        rows = self.stages < stage
        starts, ends, stages = self.starts[rows], self.ends[rows], self.stages[rows]
        lengths = ends - starts
        new = stages > previous
        if not new.any():
            empty = frozen(np.zeros(0, dtype=np.int64))
            return Moves(empty, empty, empty, born - int(lengths.sum()))
        first = int(np.argmax(new))
        hidden_now = np.cumsum(lengths)[first:]
        hidden_then = np.cumsum(np.where(stages < previous, lengths, 0))[first:]
        run_starts = ends[first:]
        run_lengths = np.append(starts[first + 1 :], born) - run_starts
        moved = run_lengths > 0
        return Moves(frozen(run_starts[moved]), frozen(run_lengths[moved]), frozen((run_starts - hidden_then)[moved]),
                     int(run_starts[0] - hidden_now[0]))


@dataclass(frozen=True)
class Moves:
    """A Repos's moved tokens as runs of consecutive tokens: run ``i`` is the tokens ``starts[i] ..
    starts[i] + lengths[i] - 1``, their old positions count up from ``old_starts[i]``; the new
    positions of all runs count up from ``new_start``."""

    starts: np.ndarray
    lengths: np.ndarray
    old_starts: np.ndarray
    new_start: int


@dataclass(frozen=True)
class Transition:
    """Tokens moved by the Repos ``events[event]``, in stream order, with their positions before
    and after it (``tokens``, ``old_positions``, ``new_positions``: int64 read-only arrays of equal
    length). They are worked out from the program's drop ranges on first use (``moves``);
    ``previous`` is the index of the Repos before it (-1 if none), ``born`` its ``Event.at``."""

    event: int
    previous: int
    born: int
    ranges: DropRanges = field(repr=False, compare=False)

    @cached_property
    def moves(self) -> Moves:
        return self.ranges.moves(self.event, self.previous, self.born)

    @property
    def size(self) -> int:
        """Number of moved tokens."""
        return int(self.moves.lengths.sum())

    @cached_property
    def tokens(self) -> np.ndarray:
        return _runs(self.moves.starts, self.moves.lengths)

    @cached_property
    def old_positions(self) -> np.ndarray:
        return _runs(self.moves.old_starts, self.moves.lengths)

    @cached_property
    def new_positions(self) -> np.ndarray:
        start = self.moves.new_start
        return frozen(np.arange(start, start + self.size, dtype=np.int64))


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``starts[i] + 0 .. lengths[i] - 1`` for every run, concatenated."""
    if starts.size == 1:  # the usual Repos: everything after one gap
        return frozen(np.arange(starts[0], starts[0] + lengths[0], dtype=np.int64))
    out = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    out += np.arange(out.size, dtype=np.int64)
    return frozen(out)


@dataclass(frozen=True)
class ContextProgram:
    """Immutable per-request layout. Arrays are read-only numpy arrays of length ``n_tokens`` (int64,
    ``keep`` bool); ``n_prompt`` tokens come from the template, the rest were generated.
    ``final_position`` is the position at the last stage, -1 for tokens hidden by a drop."""

    token_ids: np.ndarray
    owners: np.ndarray
    n_prompt: int
    n_messages: int
    events: tuple[Event, ...]
    birth_position: np.ndarray
    birth_stage: np.ndarray
    final_position: np.ndarray
    keep: np.ndarray
    visible_until: np.ndarray
    transitions: tuple[Transition, ...]
    next_position: int

    @property
    def n_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def n_stages(self) -> int:
        return len(self.events) + 1

    @property
    def has_events(self) -> bool:
        return bool(self.events)
