"""Occurrence planning: bind every KV read of a request to a slot holding the right version.

For each read of token ``s`` at position ``p`` the plan reuses a version (``s``, ``p``) the request
already made, else borrows one resident in the tree, else copies another version of ``s`` into a
fresh slot re-rotated to ``p`` (preferring the version stored at ``s``'s birth position, so keys are
rotated once from where they were computed). Tokens with no version at all are recomputed; the
recovery module decides which.

Fresh slots are numbered virtually while planning: ``-2 - t`` is the birth slot of token ``t``
(an engine allocates births itself, chunk by chunk, and binds them as they are written) and
``-2 - n_tokens - k`` is the ``k``-th copy. A copy that only earlier segments read is dead
afterwards (positions only decrease), so its slot is recycled for a later segment's copies
(``DraftPlan.colors`` says which copies share a slot): a request needs the peak, not the sum, of
its live copies. Births and what generation reads live to
the end and are published. Copy slots are bound when the request is committed, so an engine
budgets (and evicts for) one allocation before anything changes.

A *compact* plan (for engines that run the steps one after another: each segment's copies and
forward, in order, before the next segment's, then the terminal copies) also needs no more than
the request's largest live set at once:

- births are numbered like copies (``-2 - n_tokens - k``), so a birth no later step reads (a dropped
  token after its last reader) gives its slot to a later birth or copy;
- a copy whose source is a tree version that ``takeable`` marks (no other request or tree path
  reads it) and that no earlier step of this request read goes *in place*: ``dst == src``, the
  slot is rotated where it is and listed in ``taken`` (the core takes it from the tree at commit).
  The rule that makes this safe in any engine: the old version is read by nothing but the copy,
  neither by another reader nor by any segment of this request (the copies of a step may run
  before the attention of earlier segments when an engine batches several segments into one
  forward). Recycled births are not safe there: an engine that writes several segments' births in
  one forward must not use a compact plan.

An *in-place* plan (``takeable`` given, ``compact`` off) rotates takeable versions in place by the
same rule but keeps every birth in its own slot: safe for an engine that runs several segments of a
request in one forward (all their births written, then all their copies, then each segment's
attention), as the patched SGLang server does.

With ``births_in_place`` (not compact) a copy whose source is one of the request's own births (or
its own earlier in-place rotation of one) rotates that slot where it is as well: no later step reads
the older position (positions only decrease), so only the segments before the copy's step read it,
and an engine must finish their forward before it runs the copy (the patched server ends a round
there: :func:`akv.system.adapter.scheduling.cap_extend`). Such a plan allocates its births and the
copies of tree versions that must stay readable, nothing more: on an empty tree, its births alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from akv.system.arrays import first_true, frozen
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
    """A plan with virtual slots (module docstring): births ``-2 - t``, versions ``-2 - n_tokens - k``
    sharing copy slot ``colors[k] < n_copy_slots``."""

    n_tokens: int
    n_copy_slots: int
    plan: RequestPlan
    colors: np.ndarray
    taken: np.ndarray = field(default_factory=lambda: frozen(np.zeros(0, np.int64), np.int64))
    compact: bool = False
    taken_tokens: np.ndarray = field(default_factory=lambda: frozen(np.zeros(0, np.int64), np.int64))
    """The token whose version each of ``taken`` holds."""

    @property
    def n_births(self) -> int:
        """Birth slots the engine allocates (none in a compact plan: its births are copy slots)."""
        return 0 if self.compact else int(np.count_nonzero(self.plan.computed))

    @property
    def n_slots(self) -> int:
        """Fresh slots the request needs: its births and its copy slots."""
        return self.n_births + self.n_copy_slots

    def shared_segments(self) -> tuple[Segment, ...]:
        """The segments with each copy named by the slot it will share (``-2 - n_tokens - colors[k]``
        for version ``k``), so two entries name the same id exactly when they will name the same slot
        once bound; births and tree slots as they are."""
        if self.n_copy_slots == self.colors.size:  # no slot shared (recycle_slots numbers them in order)
            return self.plan.segments
        offset = 2 + self.n_tokens
        recolor = np.append(-offset - self.colors, _EMPTY)

        def colored(a: np.ndarray) -> np.ndarray:
            copies = a <= -offset
            return np.where(copies, recolor[np.where(copies, -a - offset, self.colors.size)], a)

        return map_slots(self.plan, colored).segments

    def bind_copies(self, copy_slots: np.ndarray, births: np.ndarray | None = None) -> RequestPlan:
        """The plan with copy ids replaced by ``copy_slots`` (real, in order) and, when ``births``
        (one entry per computed token, in order) is given, birth ids by those; otherwise births stay
        virtual. ``fresh`` lists the slots given."""
        copy_slots = np.asarray(copy_slots, dtype=np.int64)
        if copy_slots.shape != (self.n_copy_slots,):
            raise ValueError(f"copy_slots: expected {self.n_copy_slots} slots, got shape {copy_slots.shape}")
        lookup = np.empty(self.n_tokens + self.colors.size, dtype=np.int64)
        lookup[: self.n_tokens] = -2 - np.arange(self.n_tokens, dtype=np.int64)
        fresh = copy_slots
        if births is not None and not self.compact:  # a compact plan's births are copy slots
            births = np.asarray(births, dtype=np.int64)
            lookup[: self.n_tokens][self.plan.computed] = births
            fresh = np.concatenate([copy_slots, births])
        lookup[self.n_tokens :] = copy_slots[self.colors]

        def real(a: np.ndarray) -> np.ndarray:
            virtual = a <= -2
            if not virtual.any():
                return a
            return np.where(virtual, lookup[np.where(virtual, -2 - a, 0)], a)

        return replace(map_slots(self.plan, real), fresh=frozen(fresh, np.int64))


def bind_births(plan: RequestPlan, births: np.ndarray) -> RequestPlan:
    """``plan`` with every virtual birth id ``-2 - t`` replaced by ``births[t]`` (all must be bound)."""
    births = np.asarray(births, dtype=np.int64)
    return map_slots(plan, lambda a: resolve_births(a, births))


def resolve_births(slots: np.ndarray, births: np.ndarray) -> np.ndarray:
    """Real slots for ``slots``: virtual birth ids ``-2 - t`` become ``births[t]``."""
    virtual = (slots <= -2) & (slots > -2 - births.shape[0])
    if not virtual.any():
        return slots
    out = np.where(virtual, births[np.where(virtual, -2 - slots, 0)], slots)
    unbound = virtual & (out < 0)
    if unbound.any():
        raise PlanningError(f"token {int(-2 - slots[unbound][0])} is read before its birth slot is bound")
    return out


def plan_occurrences(program: ContextProgram, match: MatchResult, *, compact: bool = False,
                     takeable: Callable[[np.ndarray], np.ndarray] | None = None,
                     births_in_place: bool = False) -> DraftPlan:
    """Plan ``program`` against the versions ``match`` found resident; ``compact`` (module docstring)
    recycles births; the versions ``takeable`` marks are rotated in place (``takeable(tokens)``: rows
    of ``match.slots`` for those matched tokens, asked only for the copy sources no earlier step read)
    (compact or not: an in-place plan, module docstring); ``births_in_place`` rotates the request's
    own births in place too (module docstring; ignored by a compact plan)."""
    if match.n_tokens > program.n_tokens:
        raise ValueError(f"match: {match.n_tokens} matched tokens exceed the program's {program.n_tokens}")
    resident = match.resident
    computed = needed_queries(program, resident)
    table = _VersionTable(program, match, _read_tokens(program, computed), takeable, births_in_place and not compact)
    stages = StagePositions(program)
    segments = []
    for step, span in enumerate(segment_spans(program, computed)):
        visible = np.flatnonzero(program.visible_until[: span.start] > span.start)
        at_stage = _last_stage_positions(program, span.stage, visible)
        if at_stage is None:
            at_stage = stages.at(span.stage, visible)
        prefix_slots, copies = table.resolve(visible, at_stage, step)
        tokens = np.arange(span.start, span.end, dtype=np.int64)
        births = frozen(table.fresh(tokens.size, step, pinned=False) if compact else -2 - tokens, np.int64)
        positions = program.birth_position[span.start : span.end]
        table.add_births(tokens, positions, births)
        segments.append(
            Segment(span.stage, span.start, span.end, frozen(positions, np.int64), births,
                    frozen(visible, np.int64), prefix_slots, frozen(at_stage, np.int64), copies)
        )
    kept = np.flatnonzero(program.keep)
    final = program.final_position[kept]
    reused = _terminal_as_last_segment(program, segments, kept, final)
    if reused is None:
        terminal_slots, terminal_copies = table.resolve(kept, final, len(segments), pinned=True)
    else:
        terminal_slots, terminal_copies = reused, CopyJob(*(frozen(np.zeros(0, np.int64), np.int64),) * 5)
        table.pin(reused)
    terminal = TerminalView(frozen(kept, np.int64), terminal_slots, frozen(final, np.int64), terminal_copies,
                            program.next_position)
    from_tree = np.zeros(program.n_tokens, dtype=bool)
    from_tree[: resident.shape[0]] = resident
    usage = count_usage(program.n_prompt, from_tree, computed, table.read, table.rerotated,
                        ~program.keep)
    plan = RequestPlan(match, tuple(segments), terminal, table.borrowed(), frozen(np.zeros(0, np.int64), np.int64),
                       frozen(computed, bool), usage)
    colors, n_colors = recycle_slots(table.created(), table.last_use())
    return DraftPlan(program.n_tokens, n_colors, plan, frozen(colors, np.int64), table.taken(), compact,
                     table.taken_tokens())


def _read_tokens(program: ContextProgram, computed: np.ndarray) -> np.ndarray:
    """Every token the plan can read or write (ascending): those from the first computed one on,
    those visible there (a later segment sees a subset) and the kept ones (generation reads them).
    A token dropped before the first computed one is read by nothing."""
    n = program.n_tokens
    first = int(np.argmax(computed)) if computed.any() else n
    return np.flatnonzero(program.keep | (program.visible_until > first) | (np.arange(n) >= first))


def _terminal_as_last_segment(program: ContextProgram, segments: list[Segment], kept: np.ndarray,
                              final: np.ndarray) -> np.ndarray | None:
    """The terminal view's slots when generation reads exactly what the last segment's last query
    reads (the usual next turn: one segment at the last stage, ending the program, after the last
    Drop), so the terminal needs no resolving of its own; None otherwise."""
    if not segments:
        return None
    last = segments[-1]
    n_prefix = last.prefix_tokens.size
    if last.end != program.n_tokens or last.stage != program.n_stages - 1 or kept.size != n_prefix + last.n_queries:
        return None
    if not (np.array_equal(kept[:n_prefix], last.prefix_tokens) and kept[n_prefix] == last.start
            and np.array_equal(final[:n_prefix], last.prefix_positions)
            and np.array_equal(final[n_prefix:], last.positions)):
        return None
    return frozen(np.concatenate([last.prefix_slots, last.slots]), np.int64)


def _last_stage_positions(program: ContextProgram, stage: int, tokens: np.ndarray) -> np.ndarray | None:
    """Positions of ``tokens`` at ``stage`` without replaying the stages: their final positions when
    ``stage`` is the last one and no Drop hides any of them (None otherwise)."""
    if stage != program.n_stages - 1:
        return None
    final = program.final_position[tokens]
    return final if final.min(initial=0) >= 0 else None


def cold_plan(program: ContextProgram, *, compact: bool = False, births_in_place: bool = False) -> DraftPlan:
    """The plan on an empty cache: everything read is computed here (``births_in_place``: module
    docstring)."""
    return plan_occurrences(program, MatchResult.empty(), compact=compact, births_in_place=births_in_place)


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


def map_slots(plan: RequestPlan, fn: Callable[[np.ndarray], np.ndarray]) -> RequestPlan:
    """``plan`` with ``fn`` applied to every slot array (segments, prefixes, copies, terminal)."""

    def real(a: np.ndarray) -> np.ndarray:
        return frozen(fn(a) if a.size else a, np.int64)

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
    """The request's view of the versions of every token it reads (``tokens``, ascending; row ``i``
    is ``tokens[i]``): the tree's (from the match), then two of its own per token: the birth version
    it computed and the latest copy it made. Positions only ever decrease from stage to stage, so an
    older copy is never read again by a later step."""

    def __init__(self, program: ContextProgram, match: MatchResult, tokens: np.ndarray,
                 takeable: Callable[[np.ndarray], np.ndarray] | None = None,
                 births_in_place: bool = False) -> None:
        n, m = program.n_tokens, match.n_tokens
        tree_width = match.width
        self.birth_col, self.copy_col = tree_width, tree_width + 1
        self._row = np.full(n, _EMPTY, dtype=np.int64)
        self._row[tokens] = np.arange(tokens.size)
        matched = tokens[: int(np.searchsorted(tokens, m))]
        self.slots = np.full((tokens.size, tree_width + 2), _EMPTY, dtype=np.int64)
        self.positions = np.full_like(self.slots, _EMPTY)
        slots, positions = match.versions(matched)  # only the rows read: not the dropped text
        self.slots[: matched.size, :tree_width] = slots
        self.positions[: matched.size, :tree_width] = np.where(slots >= 0, positions, _EMPTY)
        self.used = np.zeros(self.slots.shape, dtype=bool)
        self.takeable = takeable if m else None
        self._taken: list[np.ndarray] = []
        self._taken_tokens: list[np.ndarray] = []
        self.births_in_place = births_in_place
        self.read = np.zeros(n, dtype=bool)
        self.rerotated = np.zeros(n, dtype=bool)
        self.birth = program.birth_position
        self._offset = 2 + n
        self._n_fresh = 0
        self._created = np.zeros(max(n, 16), dtype=np.int64)
        self._last_use = np.zeros(max(n, 16), dtype=np.int64)

    def fresh(self, k: int, step: int, *, pinned: bool) -> np.ndarray:
        """``k`` new virtual copy ids written at ``step``; pinned ones live to the end of the request."""
        start, end = self._n_fresh, self._n_fresh + k
        if end > self._created.shape[0]:
            grow = max(end, 2 * self._created.shape[0]) - self._created.shape[0]
            self._created = np.concatenate([self._created, np.zeros(grow, dtype=np.int64)])
            self._last_use = np.concatenate([self._last_use, np.zeros(grow, dtype=np.int64)])
        self._created[start:end] = step
        self._last_use[start:end] = _FOREVER if pinned else step
        self._n_fresh = end
        return -self._offset - np.arange(start, end, dtype=np.int64)

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        """Table rows of ``tokens``."""
        rows = self._row[tokens]
        if rows.size and rows.min() < 0:
            raise PlanningError(f"token {int(tokens[rows < 0][0])} is read but was not listed as read")
        return rows

    def created(self) -> np.ndarray:
        return self._created[: self._n_fresh]

    def last_use(self) -> np.ndarray:
        return self._last_use[: self._n_fresh]

    def resolve(
        self, tokens: np.ndarray, positions: np.ndarray, step: int, *, pinned: bool = False
    ) -> tuple[np.ndarray, CopyJob]:
        """Slots holding ``tokens`` at ``positions`` for reads at ``step``, making copies where no such
        version exists (``pinned`` copies live to the end). Reads that find the tree's first version
        (most of a next turn's: the KV as stored) are taken without gathering the other versions."""
        if not self.birth_col or not tokens.size:
            return self._resolve(tokens, positions, step, pinned)
        # tokens are ascending and distinct: a run of consecutive tokens is read through views
        lo, hi = int(self._row[tokens[0]]), int(self._row[tokens[-1]])
        if tokens[-1] - tokens[0] + 1 == tokens.size and lo >= 0 and hi - lo + 1 == tokens.size:
            rows: slice | np.ndarray = slice(lo, hi + 1)
        else:
            rows = self.rows(tokens)
        first = self.positions[rows, 0] == positions
        if not first.any():
            return self._resolve(tokens, positions, step, pinned)
        out = self.slots[rows, 0].copy() if isinstance(rows, slice) else self.slots[rows, 0]
        if isinstance(rows, slice):
            self.used[rows, 0] |= first
            self.read[int(tokens[0]) : int(tokens[-1]) + 1] |= first
        else:
            self.used[rows[first], 0] = True
            self.read[tokens[first]] = True
        rest = np.flatnonzero(~first)
        job = CopyJob(*(frozen(np.zeros(0, np.int64), np.int64),) * 5)
        if rest.size:
            out[rest], job = self._resolve(tokens[rest], positions[rest], step, pinned)
        return frozen(out, np.int64), job

    def _resolve(self, tokens: np.ndarray, positions: np.ndarray, step: int,
                 pinned: bool) -> tuple[np.ndarray, CopyJob]:
        """:meth:`resolve` over every version of each token."""
        rows = self.rows(tokens)
        slots, held = np.take(self.slots, rows, axis=0), np.take(self.positions, rows, axis=0)
        exact = held == positions[:, None]  # an empty cell holds position -1, never read
        found, col = first_true(exact)
        width = slots.shape[1]
        self.read[tokens] = True
        if found.any():
            cell = np.arange(tokens.size) * width + col
            out = np.where(found, np.take(slots.reshape(-1), cell), _EMPTY)
            hit = np.flatnonzero(found)
            self.used.reshape(-1)[rows[hit] * width + col[hit]] = True
            self.rerotated[tokens[hit]] |= col[hit] == self.copy_col
            self._touch(out[hit], _FOREVER if pinned else step)
            miss = np.flatnonzero(~found)
            need, need_rows, slots, held, new = tokens[miss], rows[miss], slots[miss], held[miss], positions[miss]
        else:  # every read needs a copy (a repositioned span): no row to pick out
            out, miss = np.empty(tokens.size, dtype=np.int64), slice(None)
            need, need_rows, new = tokens, rows, positions
        sources = slots != _EMPTY
        has_source, any_col = first_true(sources)
        if not has_source.all():
            raise PlanningError(f"token {int(need[~has_source][0])} is read but has no version to copy from")
        at_birth, birth_col = first_true(sources & (held == self.birth[need][:, None]))
        src_col = np.where(at_birth, birth_col, any_col)
        index = np.arange(need.size)
        src = slots[index, src_col]
        old = held[index, src_col]
        taken = np.zeros(need.size, dtype=bool)
        if self.takeable is not None:  # tree versions no earlier step read
            ask = np.flatnonzero((src_col < self.birth_col) & ~self.used[need_rows, src_col])
            if ask.size:
                taken[ask] = self.takeable(need[ask])[np.arange(ask.size), src_col[ask]]
        in_place = taken | ((src <= -2) & (src > -self._offset)) if self.births_in_place else taken  # own births
        self.used[need_rows, src_col] = True
        self._touch(src, step)
        if not in_place.any():
            dst = self.fresh(need.size, step, pinned=pinned)
        else:
            dst = np.empty(need.size, dtype=np.int64)
            dst[~in_place] = self.fresh(int(np.count_nonzero(~in_place)), step, pinned=pinned)
            # the old version is gone once rotated: no later step may pick it as a source
            dst[in_place] = src[in_place]
            if taken.any():
                self._taken.append(src[taken])
                self._taken_tokens.append(need[taken])
            self.slots[need_rows[in_place], src_col[in_place]] = _EMPTY
            self.positions[need_rows[in_place], src_col[in_place]] = _EMPTY
        self.slots[need_rows, self.copy_col] = dst
        self.positions[need_rows, self.copy_col] = new
        self.rerotated[need] = True
        out[miss] = dst
        job = CopyJob(*(frozen(a, np.int64) for a in (need, src, dst, old, new)))
        return frozen(out, np.int64), job

    def add_births(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        rows = self.rows(tokens)
        self.slots[rows, self.birth_col] = slots
        self.positions[rows, self.birth_col] = positions

    def borrowed(self) -> np.ndarray:
        """Tree slots the plan reads or rotates in place."""
        if self.birth_col == 1:  # one tree column, the usual case
            read = self.slots[np.flatnonzero(self.used[:, 0]), 0]
        else:
            cells = np.flatnonzero(self.used.reshape(-1))
            read = self.slots.reshape(-1)[cells[cells % self.slots.shape[1] < self.birth_col]]
        if not self._taken:
            return frozen(read, np.int64)
        return frozen(np.concatenate([read[read >= 0], self.taken()]), np.int64)

    def taken(self) -> np.ndarray:
        """Tree slots the plan rotates in place."""
        return frozen(np.concatenate(self._taken) if self._taken else np.zeros(0, np.int64), np.int64)

    def taken_tokens(self) -> np.ndarray:
        """The token of each of :meth:`taken`."""
        return frozen(np.concatenate(self._taken_tokens) if self._taken_tokens else np.zeros(0, np.int64), np.int64)

    def pin(self, slots: np.ndarray) -> None:
        """Generation reads ``slots``: the versions in them live to the end."""
        self._touch(slots, _FOREVER)

    def _touch(self, slots: np.ndarray, step: int) -> None:
        virtual = -self._offset - slots[slots <= -self._offset]
        self._last_use[virtual] = np.maximum(self._last_use[virtual], step)


