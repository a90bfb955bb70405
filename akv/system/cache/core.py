"""The cache core an engine drives: admit a request (match, plan, allocate), finish it (publish its
new KV to the tree, release its references). Slots are freed only when nothing references them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from akv.system.cache.keys import RecordKey, program_key
from akv.system.cache.occurrence import plan_occurrences
from akv.system.cache.plan import RequestPlan
from akv.system.cache.pool import PoolExhausted, SlotPool
from akv.system.cache.tree import RadixTree
from akv.system.context.program import ContextProgram


class CacheFull(RuntimeError):
    """The pool cannot hold a request's new KV even after evicting everything evictable."""


class RequestStateError(ValueError):
    """A request handle is used after it was finished or aborted, or with mismatched arguments."""


@dataclass(frozen=True)
class ActiveRequest:
    """An admitted request: its program, key and plan; the core holds its slot references."""

    rid: int
    program: ContextProgram
    key: RecordKey
    plan: RequestPlan


class CacheCore:
    """Radix tree + slot pool + planner, for one KV pool."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self.tree = RadixTree(pool)
        self._rids = itertools.count()
        self._active: dict[int, ActiveRequest] = {}

    @property
    def active(self) -> int:
        return len(self._active)

    def admit(self, program: ContextProgram, namespace: str = "") -> ActiveRequest:
        """Match ``program`` against the tree, plan it, and allocate its fresh slots (evicting as
        needed). Atomic: on :class:`CacheFull` nothing is held and the tree only lost evictable KV."""
        key = program_key(program, namespace)
        match = self.tree.match(key)
        locked = match.slots[match.slots >= 0]
        self.pool.incref(locked)
        try:
            draft = plan_occurrences(program, match)
            fresh = self.allocate(draft.n_fresh)
        except BaseException:
            self.pool.decref(locked)
            raise
        plan = draft.bind(fresh)
        self.pool.incref(plan.borrowed)
        self.pool.decref(locked)
        request = ActiveRequest(next(self._rids), program, key, plan)
        self._active[request.rid] = request
        return request

    def allocate(self, n: int) -> np.ndarray:
        """``n`` fresh slots owned by the caller, evicting tree KV first if the pool is short."""
        short = n - self.pool.n_free
        if short > 0:
            self.tree.evict(short)
        try:
            return self.pool.alloc(n)
        except PoolExhausted as exc:
            raise CacheFull(f"{exc}; nothing more is evictable") from exc

    def finish(self, request: ActiveRequest, generated_ids: np.ndarray | None = None,
               generated_slots: np.ndarray | None = None) -> None:
        """Publish the request's KV (prompt plus generated tokens that have KV, whose slots the caller
        got from :meth:`allocate` and hands over) and release every reference it holds."""
        ids = np.zeros(0, np.int64) if generated_ids is None else np.asarray(generated_ids, dtype=np.int64)
        slots = np.zeros(0, np.int64) if generated_slots is None else np.asarray(generated_slots, dtype=np.int64)
        if ids.shape != slots.shape or ids.ndim != 1:
            raise RequestStateError(f"generated_slots: shape {slots.shape} does not match generated_ids {ids.shape}")
        self._take(request)
        tokens, positions, version_slots = _own_versions(request, slots)
        n = request.program.n_tokens + ids.size
        table_slots, table_positions = _as_table(n, tokens, positions, version_slots)
        terminal = np.concatenate([request.program.final_position, request.program.next_position + np.arange(ids.size)])
        self.tree.insert(request.key.with_tokens(ids), table_slots, table_positions, terminal.astype(np.int64))
        self._release(request, slots)

    def abort(self, request: ActiveRequest) -> None:
        """Release everything the request holds without publishing anything."""
        self._take(request)
        self._release(request, np.zeros(0, np.int64))

    def flush(self) -> None:
        """Empty the tree (active requests keep their own references)."""
        self.tree.flush()

    def _take(self, request: ActiveRequest) -> None:
        if self._active.pop(request.rid, None) is None:
            raise RequestStateError(f"request: rid {request.rid} is not active (finished or aborted already)")

    def _release(self, request: ActiveRequest, generated_slots: np.ndarray) -> None:
        self.pool.decref(np.concatenate([request.plan.borrowed, request.plan.fresh, generated_slots]))


def _own_versions(request: ActiveRequest, generated_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token, position, slot) of every version the request publishes: its births, the versions it
    made that generation reads, and generated KV. Copies only earlier stages read are historical;
    their slots may have been recycled within the request."""
    plan = request.plan
    n = request.program.n_tokens
    terminal = plan.terminal
    made = np.isin(terminal.slots, plan.fresh)
    tokens = [np.arange(s.start, s.end) for s in plan.segments] + [terminal.tokens[made]]
    positions = [s.positions for s in plan.segments] + [terminal.positions[made]]
    slots = [s.slots for s in plan.segments] + [terminal.slots[made]]
    tokens.append(n + np.arange(generated_slots.size))
    positions.append(request.program.next_position + np.arange(generated_slots.size))
    slots.append(generated_slots)
    all_slots = np.concatenate(slots).astype(np.int64)
    _, first = np.unique(all_slots, return_index=True)
    return (np.concatenate(tokens).astype(np.int64)[first], np.concatenate(positions).astype(np.int64)[first],
            all_slots[first])


def _as_table(n: int, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token rows of versions, -1 padded."""
    order = np.argsort(tokens, kind="stable")
    tokens, positions, slots = tokens[order], positions[order], slots[order]
    first = np.searchsorted(tokens, tokens, side="left")
    col = np.arange(tokens.size) - first
    width = int(col.max()) + 1 if col.size else 1
    table_slots = np.full((n, width), -1, dtype=np.int64)
    table_positions = np.full((n, width), -1, dtype=np.int64)
    table_slots[tokens, col] = slots
    table_positions[tokens, col] = positions
    return table_slots, table_positions
