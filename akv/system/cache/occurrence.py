"""Occurrence planning: bind every KV read of a request to a slot holding the right version.

For each read of token ``s`` at position ``p`` the plan reuses a version (``s``, ``p``) the request
already made, else borrows one resident in the tree, else copies another version of ``s`` into a
fresh slot re-rotated to ``p`` (preferring the version stored at ``s``'s birth position, so keys are
rotated once from where they were computed). Tokens with no version at all are recomputed; the
recovery module decides which. Fresh slots are numbered virtually while planning and bound to real
slots at the end, so an engine can size one allocation (and evict for it) before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from akv.system.cache.plan import CopyJob, MatchResult, RequestPlan, Segment, TerminalView
from akv.system.cache.recovery import needed_queries, segment_spans
from akv.system.cache.stages import StagePositions
from akv.system.cache.usage import count_usage
from akv.system.context.program import ContextProgram

_EMPTY = -1


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

        def real(a: np.ndarray) -> np.ndarray:
            return _frozen(np.where(a <= -2, fresh[np.maximum(-a - 2, 0)] if fresh.size else a, a))

        def job(c: CopyJob) -> CopyJob:
            return CopyJob(c.tokens, real(c.src), real(c.dst), c.old_positions, c.new_positions)

        p = self.plan
        segments = tuple(
            Segment(s.stage, s.start, s.end, s.positions, real(s.slots), s.prefix_tokens, real(s.prefix_slots),
                    s.prefix_positions, job(s.copies))
            for s in p.segments
        )
        t = p.terminal
        terminal = TerminalView(t.tokens, real(t.slots), t.positions, job(t.copies), t.next_position)
        return RequestPlan(p.match, segments, terminal, p.borrowed, _frozen(fresh.copy()), p.computed, p.usage)


def plan_occurrences(program: ContextProgram, match: MatchResult) -> DraftPlan:
    """Plan ``program`` against the versions ``match`` found resident."""
    if match.n_tokens > program.n_tokens:
        raise ValueError(f"match: {match.n_tokens} matched tokens exceed the program's {program.n_tokens}")
    resident = match.resident
    computed = needed_queries(program, resident)
    table = _VersionTable(program, match)
    stages = StagePositions(program)
    segments = []
    for span in segment_spans(program, computed):
        visible = np.flatnonzero(program.visible_until[: span.start] > span.start)
        at_stage = stages.at(span.stage)[visible]
        prefix_slots, copies = table.resolve(visible, at_stage)
        births = table.fresh(span.end - span.start)
        tokens = np.arange(span.start, span.end, dtype=np.int64)
        positions = program.birth_position[span.start : span.end]
        table.add(tokens, positions, births, copied=False)
        segments.append(
            Segment(span.stage, span.start, span.end, _frozen(positions), births, _frozen(visible), prefix_slots,
                    _frozen(at_stage), copies)
        )
    kept = np.flatnonzero(program.keep)
    final = program.final_position[kept]
    terminal_slots, terminal_copies = table.resolve(kept, final)
    terminal = TerminalView(_frozen(kept), terminal_slots, _frozen(final), terminal_copies, program.next_position)
    from_tree = np.zeros(program.n_tokens, dtype=bool)
    from_tree[: resident.shape[0]] = resident
    usage = count_usage(program.n_prompt, from_tree, computed, table.read, table.rerotated)
    plan = RequestPlan(match, tuple(segments), terminal, table.borrowed(), _frozen(np.zeros(0, np.int64)),
                       _frozen_mask(computed), usage)
    return DraftPlan(table.n_fresh, plan)


class _VersionTable:
    """The request's view of every token's versions: tree ones from the match, then its own."""

    def __init__(self, program: ContextProgram, match: MatchResult) -> None:
        n, m = program.n_tokens, match.n_tokens
        width = match.slots.shape[1] + 1
        self.slots = np.full((n, width), _EMPTY, dtype=np.int64)
        self.positions = np.full((n, width), _EMPTY, dtype=np.int64)
        self.slots[:m, : width - 1] = match.slots
        self.positions[:m, : width - 1] = np.where(match.slots >= 0, match.positions, _EMPTY)
        self.from_tree = self.slots >= 0
        self.copied = np.zeros((n, width), dtype=bool)
        self.used = np.zeros((n, width), dtype=bool)
        self.read = np.zeros(n, dtype=bool)
        self.rerotated = np.zeros(n, dtype=bool)
        self.birth = program.birth_position
        self.n_fresh = 0

    def fresh(self, k: int) -> np.ndarray:
        ids = -2 - np.arange(self.n_fresh, self.n_fresh + k, dtype=np.int64)
        self.n_fresh += k
        return ids

    def resolve(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, CopyJob]:
        """Slots holding ``tokens`` at ``positions``, making copies where no such version exists."""
        valid = self.slots[tokens] != _EMPTY
        exact = valid & (self.positions[tokens] == positions[:, None])
        found = exact.any(axis=1)
        col = exact.argmax(axis=1)
        out = np.where(found, self.slots[tokens, col], _EMPTY)
        rows = np.flatnonzero(found)
        self.used[tokens[rows], col[rows]] = True
        self.rerotated[tokens[rows]] |= self.copied[tokens[rows], col[rows]]
        self.read[tokens] = True
        need = tokens[~found]
        if need.size and not valid[~found].any(axis=1).all():
            bad = int(need[~valid[~found].any(axis=1)][0])
            raise PlanningError(f"token {bad} is read but has no version to copy from")
        at_birth = valid[~found] & (self.positions[need] == self.birth[need][:, None])
        src_col = np.where(at_birth.any(axis=1), at_birth.argmax(axis=1), valid[~found].argmax(axis=1))
        src = self.slots[need, src_col]
        old = self.positions[need, src_col]
        self.used[need, src_col] = True
        dst = self.fresh(need.size)
        new = positions[~found]
        self.add(need, new, dst, copied=True)
        self.rerotated[need] = True
        out[~found] = dst
        return _frozen(out), CopyJob(_frozen(need), _frozen(src), _frozen(dst), _frozen(old), _frozen(new))

    def add(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, *, copied: bool) -> None:
        free = self.slots[tokens] == _EMPTY
        if not free.any(axis=1).all():
            self._widen()
            free = self.slots[tokens] == _EMPTY
        col = free.argmax(axis=1)
        self.slots[tokens, col] = slots
        self.positions[tokens, col] = positions
        self.copied[tokens, col] = copied

    def borrowed(self) -> np.ndarray:
        return _frozen(self.slots[self.used & self.from_tree])

    def _widen(self) -> None:
        n = self.slots.shape[0]
        pad = np.full((n, 1), _EMPTY, dtype=np.int64)
        self.slots = np.concatenate([self.slots, pad], axis=1)
        self.positions = np.concatenate([self.positions, pad], axis=1)
        self.from_tree = np.concatenate([self.from_tree, np.zeros((n, 1), bool)], axis=1)
        self.copied = np.concatenate([self.copied, np.zeros((n, 1), bool)], axis=1)
        self.used = np.concatenate([self.used, np.zeros((n, 1), bool)], axis=1)


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    arr.flags.writeable = False
    return arr


def _frozen_mask(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr, dtype=bool)
    arr.flags.writeable = False
    return arr
