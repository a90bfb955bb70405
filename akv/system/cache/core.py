"""The cache core an engine drives, in the engine's own order:

- :meth:`CacheCore.match` — pure and cheap to repeat: the tree's versions for a program and a
  :class:`Draft` plan with virtual slots (valid while the tree's path it matched is unchanged:
  :meth:`CacheCore.current`);
- :meth:`CacheCore.commit` — at the engine's lock time: take references on the borrowed versions
  and allocate the copy slots; returns the :class:`ActiveRequest` handle;
- :meth:`CacheCore.bind_births` — the engine allocates each chunk's birth slots and hands them over;
- :meth:`CacheCore.finish` publishes the request's KV to the tree, :meth:`CacheCore.abort` does not;
  both release every reference the request holds.

:meth:`CacheCore.admit` does match, commit and every birth at once (engines that allocate up front);
with ``compact`` it plans for an engine that runs the steps in order (births recycled, tree versions
no one else reads rotated in place: :mod:`akv.system.cache.occurrence`), so the request allocates
its largest live set, not its whole text plus copies; with ``in_place`` (an engine that runs a
request's segments in one forward) only the tree versions are rotated in place, births keep their own
slots. Slots are freed only when nothing references them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from akv.system.arrays import frozen, in_sorted
from akv.system.cache.keys import RecordKey, program_key
from akv.system.cache.occurrence import DraftPlan, bind_births, plan_occurrences
from akv.system.cache.plan import MatchResult, RequestPlan
from akv.system.cache.pool import PoolExhausted, SlotPool
from akv.system.cache.tree import PathMark, RadixTree
from akv.system.context.program import ContextProgram


class CacheFull(RuntimeError):
    """The pool cannot hold a request's new KV even after evicting everything evictable."""


class RequestStateError(ValueError):
    """A request handle is used after it was finished or aborted, or with mismatched arguments."""


@dataclass(frozen=True)
class Draft:
    """A matched, planned, uncommitted request (holds nothing). ``mark``: the tree path it was planned
    against; commit refuses a draft whose path the tree has changed since."""

    program: ContextProgram
    key: RecordKey
    match: MatchResult
    plan: DraftPlan
    mark: PathMark

    @property
    def n_births(self) -> int:
        return self.plan.n_births

    @property
    def n_copy_slots(self) -> int:
        return self.plan.n_copy_slots


@dataclass(frozen=True)
class ActiveRequest:
    """A committed request: program, key, plan (copy slots real; births ``-2 - t`` until bound) and
    ``births[t]``, the bound birth slot of token ``t`` (-1 while unbound); ``freed[t]``: that slot went
    back to the pool before the request ended (:meth:`CacheCore.free_births`)."""

    rid: int
    program: ContextProgram
    key: RecordKey
    plan: RequestPlan
    births: np.ndarray
    freed: np.ndarray

    def resolved_plan(self) -> RequestPlan:
        """The plan with every birth bound to its slot (raises if one is read but unbound)."""
        return bind_births(self.plan, self.births)


class CacheCore:
    """Radix tree + slot pool + planner, for one KV pool. ``evict(n)``: make room for ``n`` slots
    when the pool is short (an engine passes its own eviction path; default: this core's tree)."""

    def __init__(self, pool: SlotPool, evict: Callable[[int], object] | None = None) -> None:
        self.pool = pool
        self.tree = RadixTree(pool)
        self._evict = self._evict_tree if evict is None else evict
        self._rids = itertools.count()
        self._active: dict[int, ActiveRequest] = {}
        self._reserved = np.zeros(pool.size + 1, dtype=np.int64)  # by slot: slots are 1..size
        self._n_reserved = 0
        self._reserved_parts: list[np.ndarray] = []  # every slot reserved now is in one (and maybe more)
        self._reserved_sorted: np.ndarray | None = None  # those reserved now, ascending (None: not known)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def epoch(self) -> int:
        return self.tree.epoch

    def match(self, program: ContextProgram, namespace: str = "", *, cold: bool = False,
              compact: bool = False, in_place: bool = False, births_in_place: bool = False) -> Draft:
        """Match ``program`` against the tree and plan it; takes nothing. ``cold`` plans as if the
        tree were empty (everything recomputed); ``compact`` makes a compact plan (module docstring),
        ``in_place`` an in-place plan (:mod:`akv.system.cache.occurrence`), ``births_in_place`` one
        that rotates the request's own births in place too; their in-place tree versions hold only
        while nothing else takes a reference before commit (:meth:`contested`)."""
        key = program_key(program, namespace)
        match = MatchResult.empty() if cold else self.resident(key)
        takeable = partial(self.tree.exclusive, key, match) if (compact or in_place) and match.n_tokens else None
        plan = plan_occurrences(program, match, compact=compact, takeable=takeable, births_in_place=births_in_place)
        return Draft(program, key, match, plan, self.tree.mark(key))

    def current(self, draft: Draft) -> bool:
        """Whether ``draft`` is still what :meth:`match` would plan: nothing on its tree path changed
        in a way that could change its match or the versions it rotates in place
        (:meth:`akv.system.cache.tree.RadixTree.unchanged`)."""
        return self.tree.unchanged(draft.mark, draft.key.token_record[draft.plan.taken_tokens])

    def resident(self, key: RecordKey) -> MatchResult:
        """The tree's match of ``key`` less the versions :meth:`reserve` set aside (another request
        rotates them in place: they are resident for no one else)."""
        return self.tree.match(key, self._reserved_slots() if self._n_reserved else None)

    def _reserved_slots(self) -> np.ndarray:
        """The slots reserved now, ascending (sorted once per change of the reservations)."""
        if self._reserved_sorted is None:
            listed = np.unique(np.concatenate(self._reserved_parts or [np.zeros(0, np.int64)]))
            self._reserved_sorted = frozen(listed[self._reserved[listed] > 0], np.int64)
            self._reserved_parts = [self._reserved_sorted]
        return self._reserved_sorted

    def reserve(self, slots: np.ndarray) -> None:
        """Set aside tree versions a locked draft rotates in place, until :meth:`unreserve`: later
        matches do not see them, so no request planned meanwhile reads their old positions."""
        slots = np.asarray(slots, dtype=np.int64)
        np.add.at(self._reserved, slots, 1)
        self._n_reserved += slots.size
        if slots.size:
            self._reserved_parts.append(slots)
            self._reserved_sorted = None

    def unreserve(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        np.subtract.at(self._reserved, slots, 1)
        self._n_reserved -= slots.size
        if slots.size:
            self._reserved_sorted = None
        if not self._n_reserved:
            self._reserved_parts = []

    def reads_reserved(self, draft: Draft) -> bool:
        """Whether ``draft`` reads a version set aside since it was planned (it must be planned again)."""
        borrowed = draft.plan.plan.borrowed
        return bool(self._n_reserved) and bool(borrowed.size) and bool((self._reserved[borrowed] > 0).any())

    def contested(self, draft: Draft, *, held: bool = False) -> bool:
        """Whether a version ``draft`` rotates in place is referenced by something else now (another
        request locked it since the draft was planned; ``held``: the caller holds one reference on
        each of the draft's borrowed versions): committing it would raise."""
        taken = draft.plan.taken
        return bool(taken.size) and bool((self.pool.request_refs(taken) > (1 if held else 0)).any())

    def commit(self, draft: Draft, *, held: bool = False, hand_over: bool = False) -> ActiveRequest:
        """Reference the draft's borrowed versions and allocate its copy slots (evicting as needed).
        Atomic: on :class:`CacheFull` nothing is held. ``held``: the caller has held references on
        the borrowed versions since the draft was planned (an engine's lock), so the plan stands
        whatever else the tree did meanwhile; ``hand_over`` (with ``held``): those references become
        the request's instead of new ones (the caller drops none; on :class:`CacheFull` it keeps them)."""
        return self._commit(draft, held, with_births=False, hand_over=held and hand_over)

    def _commit(self, draft: Draft, held: bool, *, with_births: bool, hand_over: bool = False) -> ActiveRequest:
        """:meth:`commit`; ``with_births`` allocates and binds the births too (one allocation)."""
        if not held and not self.current(draft):
            raise RequestStateError("draft: the tree changed on its path since it was planned")
        taken = draft.plan.taken
        if self.contested(draft, held=held):
            raise RequestStateError("draft: a version it rotates in place was referenced since it was planned")
        borrowed = draft.plan.plan.borrowed
        n_births = draft.n_births if with_births else 0
        if not hand_over:
            self.pool.incref(borrowed)
        try:
            fresh = self.allocate(draft.n_copy_slots + n_births)
        except BaseException:
            if not hand_over:
                self.pool.decref(borrowed)
            raise
        if taken.size:
            self.tree.take(draft.key, draft.plan.taken_tokens, taken)
        copies = fresh[: draft.n_copy_slots]
        plan = draft.plan.bind_copies(copies, fresh[draft.n_copy_slots :] if with_births else None)
        births = np.full(draft.program.n_tokens, -1, dtype=np.int64)
        freed = np.zeros(draft.program.n_tokens, dtype=bool)
        request = ActiveRequest(next(self._rids), draft.program, draft.key, plan, births, freed)
        self._active[request.rid] = request
        return request

    def bind_births(self, request: ActiveRequest, tokens: np.ndarray, slots: np.ndarray) -> None:
        """Hand over the engine-allocated birth slots of ``tokens`` (the request now owns them)."""
        self._check_active(request)
        tokens = np.asarray(tokens, dtype=np.int64)
        slots = np.asarray(slots, dtype=np.int64)
        if tokens.shape != slots.shape or tokens.ndim != 1:
            raise RequestStateError(f"slots: shape {slots.shape} does not match tokens {tokens.shape}")
        if tokens.size and ((tokens < 0).any() or (tokens >= request.program.n_tokens).any()
                            or not request.plan.computed[tokens].all() or (request.births[tokens] >= 0).any()):
            raise RequestStateError(f"tokens: {tokens.tolist()[:8]} are not unbound births of this request")
        self.pool.adopt(slots)
        request.births[tokens] = slots

    def free_births(self, request: ActiveRequest, tokens: np.ndarray) -> None:
        """Give back the bound birth slots of ``tokens`` that no later step of the request reads (the
        engine's word: :mod:`akv.system.cache.lifetimes`); they are not published."""
        self._check_active(request)
        tokens = np.asarray(tokens, dtype=np.int64)
        tokens = tokens[(request.births[tokens] >= 0) & ~request.freed[tokens]]
        request.freed[tokens] = True
        self.pool.decref(request.births[tokens])

    def admit(self, program: ContextProgram, namespace: str = "", *, compact: bool = False,
              in_place: bool = False, births_in_place: bool = False) -> ActiveRequest:
        """Match, commit and allocate every birth (``compact`` / ``in_place`` / ``births_in_place``: as
        :meth:`match`). The returned plan has only real slots, and its ``fresh`` lists the copy slots
        and the births."""
        return self.admit_draft(self.match(program, namespace, compact=compact, in_place=in_place,
                                           births_in_place=births_in_place))

    def admit_draft(self, draft: Draft) -> ActiveRequest:
        """:meth:`admit` of a draft :meth:`match` planned against the tree as it still is."""
        return self._commit(draft, False, with_births=True)

    def allocate(self, n: int) -> np.ndarray:
        """``n`` fresh slots owned by the caller, evicting tree KV first if the pool is short (and
        evicting nothing when even that could not make room)."""
        if n > self.pool.n_free + self.pool.n_evictable:
            raise CacheFull(f"need {n} slots, {self.pool.n_free} free of {self.pool.size} and "
                            f"{self.pool.n_evictable} evictable")
        if n > self.pool.n_free:
            self._evict(n)
        try:
            return self.pool.alloc(n)
        except PoolExhausted as exc:
            raise CacheFull(f"{exc}; nothing more is evictable") from exc

    def _evict_tree(self, n: int) -> None:
        self.tree.evict(n - self.pool.n_free)

    def finish(self, request: ActiveRequest, generated_ids: np.ndarray | None = None,
               generated_slots: np.ndarray | None = None) -> None:
        """Publish the request's KV (prompt plus generated tokens that have KV, whose slots the caller
        owns and hands over) and release every reference it holds."""
        ids = np.zeros(0, np.int64) if generated_ids is None else np.asarray(generated_ids, dtype=np.int64)
        slots = np.zeros(0, np.int64) if generated_slots is None else np.asarray(generated_slots, dtype=np.int64)
        if ids.shape != slots.shape or ids.ndim != 1:
            raise RequestStateError(f"generated_slots: shape {slots.shape} does not match generated_ids {ids.shape}")
        self._check_active(request)
        plan = request.resolved_plan()
        self._take(request)
        tokens, positions, version_slots = _own_versions(request, plan, slots)
        given, table_slots, table_positions = _as_rows(tokens, positions, version_slots)
        terminal = np.concatenate([request.program.final_position, request.program.next_position + np.arange(ids.size)])
        self.tree.publish(request.key.with_tokens(ids), given, table_slots, table_positions, terminal.astype(np.int64),
                          generated=ids.size)
        self._release(request, slots)

    def abort(self, request: ActiveRequest) -> None:
        """Release everything the request holds without publishing anything."""
        self._take(request)
        self._release(request, np.zeros(0, np.int64))

    def flush(self) -> None:
        """Empty the tree (active requests keep their own references)."""
        self.tree.flush()

    def _check_active(self, request: ActiveRequest) -> None:
        if request.rid not in self._active:
            raise RequestStateError(f"request: rid {request.rid} is not active (finished or aborted already)")

    def _take(self, request: ActiveRequest) -> None:
        self._check_active(request)
        del self._active[request.rid]

    def _release(self, request: ActiveRequest, generated_slots: np.ndarray) -> None:
        births = request.births[(request.births >= 0) & ~request.freed]
        self.pool.decref(np.concatenate([request.plan.borrowed, request.plan.fresh, births, generated_slots]))


def _own_versions(request: ActiveRequest, plan: RequestPlan,
                  generated_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token, position, slot) of every version the request publishes: its births and the versions
    it made (copied, or rotated in place) that generation reads, and generated KV; each slot with
    what it holds at the end, its last write (copies only earlier steps read are historical, and a
    recycled slot holds only its last version); not a freed birth's slot while it holds that birth."""
    program = request.program
    n = program.n_tokens
    terminal = plan.terminal
    tokens, positions, slots, kept = [], [], [], []
    read_at_end = np.sort(terminal.slots)
    for job, births in [(s.copies, s) for s in plan.segments] + [(terminal.copies, None)]:
        tokens.append(job.tokens)
        positions.append(job.new_positions)
        slots.append(job.dst)
        kept.append(in_sorted(read_at_end, job.dst))
        if births is not None:
            tokens.append(np.arange(births.start, births.end))
            positions.append(births.positions)
            slots.append(births.slots)
            kept.append(np.ones(births.n_queries, dtype=bool))
    all_slots = np.concatenate(slots).astype(np.int64)
    last = all_slots.size - 1 - np.unique(all_slots[::-1], return_index=True)[1]
    last = last[np.concatenate(kept)[last]]
    written = np.concatenate(tokens).astype(np.int64)
    last = last[~(request.freed[written[last]] & (request.births[written[last]] == all_slots[last]))]
    out_tokens = written[last]
    out_positions = np.concatenate(positions).astype(np.int64)[last]
    return (np.concatenate([out_tokens, n + np.arange(generated_slots.size)]),
            np.concatenate([out_positions, program.next_position + np.arange(generated_slots.size)]),
            np.concatenate([all_slots[last], generated_slots]).astype(np.int64))


def _as_rows(tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct ``tokens`` (ascending) and, per one, a row of its versions' slots and positions, -1 padded."""
    order = np.argsort(tokens, kind="stable")
    tokens, positions, slots = tokens[order], positions[order], slots[order]
    index = np.arange(tokens.size)
    starts = np.ones(tokens.size, dtype=bool)  # the first version of each token (tokens sorted: one pass)
    starts[1:] = tokens[1:] != tokens[:-1]
    col = index - np.maximum.accumulate(np.where(starts, index, 0))
    row = np.cumsum(starts) - 1
    width = int(col.max()) + 1 if col.size else 1
    table_slots = np.full((int(np.count_nonzero(starts)), width), -1, dtype=np.int64)
    table_positions = np.full_like(table_slots, -1)
    table_slots[row, col] = slots
    table_positions[row, col] = positions
    return tokens[starts], table_slots, table_positions
