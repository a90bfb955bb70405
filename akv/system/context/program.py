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

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


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
class Transition:
    """Tokens moved by the Repos ``events[event]``, in stream order, with their positions before
    and after it (int64 read-only arrays of equal length)."""

    event: int
    tokens: np.ndarray
    old_positions: np.ndarray
    new_positions: np.ndarray


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
