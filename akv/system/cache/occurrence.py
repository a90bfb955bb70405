"""Occurrence planning: bind every KV read of a request to a slot holding the right version.

For each read of token ``s`` at position ``p`` the plan reuses a version (``s``, ``p``) the request
already made, else borrows one resident in the tree, else copies another version of ``s`` into a
fresh slot re-rotated to ``p`` (preferring the version stored at ``s``'s birth position, so keys are
rotated once from where they were computed). Tokens with no version at all are recomputed; the
recovery module decides which.

Fresh slots are numbered virtually while planning. A copy that only earlier segments read is dead
afterwards (positions only decrease), so its slot is recycled for a later segment's copies or
births: a request needs the peak, not the sum, of its live private versions. Births and what
generation reads live to the end and are published. The numbers are bound to real slots at the
end, so an engine sizes one allocation (and evicts for it) before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from akv.system.arrays import frozen
from akv.system.cache.plan import CopyJob, MatchResult, RequestPlan, Segment, TerminalView
from akv.system.cache.recovery import needed_queries, segment_spans
from akv.system.cache.stages import StagePositions
from akv.system.cache.usage import count_usage
from akv.system.context.program import ContextProgram

_EMPTY = -1
_FOREVER = np.iinfo(np.int64).max


class PlanningError(RuntimeError):
    """The match and the program disagree (a read has no source version); a bug, never user input."""


@dataclass(frozen=True)
class DraftPlan:
    """A plan whose fresh slots are virtual ids ``-2, -3, ...``; :meth:`bind` makes it real."""

    n_fresh: int
    plan: RequestPlan

    def bind(self, fresh: np.ndarray) -> RequestPlan:
        """Replace virtual ids by ``fresh`` (``n_fresh`` real slots, in order)."""
        fresh = np.asarray(fresh, dtype=np.int64)
        if fresh.shape != (self.n_fresh,):
            raise ValueError(f"fresh: expected {self.n_fresh} slots, got shape {fresh.shape}")
        return replace(_map_slots(self.plan, fresh), fresh=frozen(fresh.copy(), np.int64))


def plan_occurrences(program: ContextProgram, match: MatchResult) -> DraftPlan:
    """Plan ``program`` against the versions ``match`` found resident."""
    if match.n_tokens > program.n_tokens:
        raise ValueError(f"match: {match.n_tokens} matched tokens exceed the program's {program.n_tokens}")
    resident = match.resident
    computed = needed_queries(program, resident)
    table = _VersionTable(program, match)
    stages = StagePositions(program)
    segments = []
    for step, span in enumerate(segment_spans(program, computed)):
        visible = np.flatnonzero(program.visible_until[: span.start] > span.start)
        at_stage = stages.at(span.stage)[visible]
        prefix_slots, copies = table.resolve(visible, at_stage, step)
        births = table.fresh(span.end - span.start, step, pinned=True)
        tokens = np.arange(span.start, span.end, dtype=np.int64)
        positions = program.birth_position[span.start : span.end]
        table.add_births(tokens, positions, births)
        segments.append(
            Segment(span.stage, span.start, span.end, frozen(positions, np.int64), births,
                    frozen(visible, np.int64), prefix_slots, frozen(at_stage, np.int64), copies)
        )
    kept = np.flatnonzero(program.keep)
    final = program.final_position[kept]
    terminal_slots, terminal_copies = table.resolve(kept, final, len(segments), pinned=True)
    terminal = TerminalView(frozen(kept, np.int64), terminal_slots, frozen(final, np.int64), terminal_copies,
                            program.next_position)
    from_tree = np.zeros(program.n_tokens, dtype=bool)
    from_tree[: resident.shape[0]] = resident
    usage = count_usage(program.n_prompt, from_tree, computed, table.read, table.rerotated)
    plan = RequestPlan(match, tuple(segments), terminal, table.borrowed(), frozen(np.zeros(0, np.int64), np.int64),
                       frozen(computed, bool), usage)
    colors, n_colors = recycle_slots(table.created(), table.last_use())
    return DraftPlan(n_colors, _map_slots(plan, -2 - colors))


def recycle_slots(created: np.ndarray, last_use: np.ndarray) -> tuple[np.ndarray, int]:
    """Give version ``k`` (written at step ``created[k]``, nondecreasing, last read at step
    ``last_use[k]``) a slot number, reusing the number of a version last read at an earlier step.
    Returns the numbers and how many are needed (the peak of live versions)."""
    n = created.shape[0]
    colors = np.full(n, _EMPTY, dtype=np.int64)
    mortal = np.flatnonzero(last_use < _FOREVER)
    mortal = mortal[np.argsort(last_use[mortal], kind="stable")]
    deaths = last_use[mortal]
    free = np.zeros(0, dtype=np.int64)
    released = 0
    n_colors = 0
    bounds = np.flatnonzero(np.diff(created)) + 1
    for lo, hi in zip(np.concatenate([[0], bounds]).tolist(), np.concatenate([bounds, [n]]).tolist()):
        if lo == hi:
            continue
        dead = int(np.searchsorted(deaths, created[lo], side="left"))
        if dead > released:
            free = np.concatenate([free, colors[mortal[released:dead]]])
            released = dead
        take = min(hi - lo, free.size)
        colors[lo : lo + take] = free[free.size - take :]
        free = free[: free.size - take]
        colors[lo + take : hi] = np.arange(n_colors, n_colors + hi - lo - take)
        n_colors += hi - lo - take
    return colors, n_colors


def _map_slots(plan: RequestPlan, table: np.ndarray) -> RequestPlan:
    """Rewrite virtual ids ``-2 - k`` to ``table[k]`` everywhere in ``plan``; real slots stay."""
    padded = np.append(table, _EMPTY)  # a valid gather target for the non-virtual entries

    def real(a: np.ndarray) -> np.ndarray:
        return frozen(np.where(a <= -2, padded[np.maximum(-a - 2, 0)], a), np.int64)

    def job(c: CopyJob) -> CopyJob:
        return CopyJob(c.tokens, real(c.src), real(c.dst), c.old_positions, c.new_positions)

    segments = tuple(
        Segment(s.stage, s.start, s.end, s.positions, real(s.slots), s.prefix_tokens, real(s.prefix_slots),
                s.prefix_positions, job(s.copies))
        for s in plan.segments
    )
    t = plan.terminal
    terminal = TerminalView(t.tokens, real(t.slots), t.positions, job(t.copies), t.next_position)
    return replace(plan, segments=segments, terminal=terminal)


class _VersionTable:
    """The request's view of every token's versions: the tree's (from the match), then two of its
    own per token: the birth version it computed and the latest copy it made. Positions only ever
    decrease from stage to stage, so an older copy is never read again by a later step."""

    def __init__(self, program: ContextProgram, match: MatchResult) -> None:
        n, m = program.n_tokens, match.n_tokens
        tree_width = match.slots.shape[1]
        self.birth_col, self.copy_col = tree_width, tree_width + 1
        self.slots = np.full((n, tree_width + 2), _EMPTY, dtype=np.int64)
        self.positions = np.full_like(self.slots, _EMPTY)
        self.slots[:m, :tree_width] = match.slots
        self.positions[:m, :tree_width] = np.where(match.slots >= 0, match.positions, _EMPTY)
        self.used = np.zeros(self.slots.shape, dtype=bool)
        self.read = np.zeros(n, dtype=bool)
        self.rerotated = np.zeros(n, dtype=bool)
        self.birth = program.birth_position
        self._n_fresh = 0
        self._created = np.zeros(max(n, 16), dtype=np.int64)
        self._last_use = np.zeros(max(n, 16), dtype=np.int64)

    def fresh(self, k: int, step: int, *, pinned: bool) -> np.ndarray:
        """``k`` new virtual ids written at ``step``; pinned ones live to the end of the request."""
        start, end = self._n_fresh, self._n_fresh + k
        if end > self._created.shape[0]:
            grow = max(end, 2 * self._created.shape[0]) - self._created.shape[0]
            self._created = np.concatenate([self._created, np.zeros(grow, dtype=np.int64)])
            self._last_use = np.concatenate([self._last_use, np.zeros(grow, dtype=np.int64)])
        self._created[start:end] = step
        self._last_use[start:end] = _FOREVER if pinned else step
        self._n_fresh = end
        return -2 - np.arange(start, end, dtype=np.int64)

    def created(self) -> np.ndarray:
        return self._created[: self._n_fresh]

    def last_use(self) -> np.ndarray:
        return self._last_use[: self._n_fresh]

    def resolve(
        self, tokens: np.ndarray, positions: np.ndarray, step: int, *, pinned: bool = False
    ) -> tuple[np.ndarray, CopyJob]:
        """Slots holding ``tokens`` at ``positions`` for reads at ``step``, making copies where no such
        version exists (``pinned`` copies live to the end)."""
        valid = self.slots[tokens] != _EMPTY
        exact = valid & (self.positions[tokens] == positions[:, None])
        found = exact.any(axis=1)
        col = exact.argmax(axis=1)
        out = np.where(found, self.slots[tokens, col], _EMPTY)
        rows = np.flatnonzero(found)
        self.used[tokens[rows], col[rows]] = True
        self.rerotated[tokens[rows]] |= col[rows] == self.copy_col
        self.read[tokens] = True
        self._touch(out[found], _FOREVER if pinned else step)
        need = tokens[~found]
        has_source = valid[~found].any(axis=1)
        if not has_source.all():
            raise PlanningError(f"token {int(need[~has_source][0])} is read but has no version to copy from")
        at_birth = valid[~found] & (self.positions[need] == self.birth[need][:, None])
        src_col = np.where(at_birth.any(axis=1), at_birth.argmax(axis=1), valid[~found].argmax(axis=1))
        src = self.slots[need, src_col]
        old = self.positions[need, src_col]
        self.used[need, src_col] = True
        self._touch(src, step)
        dst = self.fresh(need.size, step, pinned=pinned)
        new = positions[~found]
        self.slots[need, self.copy_col] = dst
        self.positions[need, self.copy_col] = new
        self.rerotated[need] = True
        out[~found] = dst
        job = CopyJob(*(frozen(a, np.int64) for a in (need, src, dst, old, new)))
        return frozen(out, np.int64), job

    def add_births(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        self.slots[tokens, self.birth_col] = slots
        self.positions[tokens, self.birth_col] = positions

    def borrowed(self) -> np.ndarray:
        return frozen(self.slots[:, : self.birth_col][self.used[:, : self.birth_col]], np.int64)

    def _touch(self, slots: np.ndarray, step: int) -> None:
        virtual = -2 - slots[slots <= -2]
        self._last_use[virtual] = np.maximum(self._last_use[virtual], step)


