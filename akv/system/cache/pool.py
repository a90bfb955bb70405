"""KV slot pool with reference counts: a slot returns to the free list only when nothing holds it.

Slot ids run from 1 to ``size``; slot 0 is the padding slot (as in SGLang's pools) and is never
handed out. Two kinds of holder take references: requests (``incref``/``decref``) and the radix
tree (``tree_incref``/``tree_decref``). A held slot is *protected* while some request references it
and *evictable* while only the tree does; both counts are kept up to date in O(slots touched), so
an engine can read them on every scheduling step. The free list itself is pluggable: an engine
whose allocator must stay the only free list passes a :class:`FreeList` over it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np


class PoolError(ValueError):
    """A slot operation is invalid (unknown slot, freeing a free slot); the message names the slot."""


class PoolExhausted(RuntimeError):
    """Not enough free slots for an allocation."""


class FreeList(Protocol):
    """Where free slots live: ``take`` returns ``n`` of them (or None when short), ``give`` returns
    slots to it, ``n_free`` counts them."""

    @property
    def n_free(self) -> int: ...

    def take(self, n: int) -> np.ndarray | None: ...

    def give(self, slots: np.ndarray) -> None: ...


class ArrayFreeList:
    """A stack of free slot ids ``1 .. size`` (lowest ids handed out first)."""

    def __init__(self, size: int) -> None:
        self._free = np.arange(size, 0, -1, dtype=np.int64)
        self._n_free = size

    @property
    def n_free(self) -> int:
        return self._n_free

    def take(self, n: int) -> np.ndarray | None:
        if n > self._n_free:
            return None
        slots = self._free[self._n_free - n : self._n_free][::-1].copy()
        self._n_free -= n
        return slots

    def give(self, slots: np.ndarray) -> None:
        self._free[self._n_free : self._n_free + slots.size] = slots
        self._n_free += slots.size


class SlotPool:
    """Per-slot request and tree reference counts over a free list; ``on_free`` sees every batch
    of slots freed."""

    def __init__(self, size: int, on_free: Callable[[np.ndarray], None] | None = None,
                 free_list: FreeList | None = None) -> None:
        if type(size) is not int or size < 1:
            raise PoolError(f"size: {size!r} is not a positive int")
        self.size = size
        # written now (np.full, not the lazily mapped np.zeros): a slot's first use then takes no page fault
        self._refs = np.full(size + 1, 0, dtype=np.int64)
        self._tree = np.full(size + 1, 0, dtype=np.int64)
        self._mark = np.full(size + 1, 0, dtype=np.int64)  # scratch of _listed
        self._free_list: FreeList = ArrayFreeList(size) if free_list is None else free_list
        self._on_free = on_free
        self._n_evictable = 0
        self._n_protected = 0
        self.changes = 0  # reference changes so far: a count cached over the references holds while this does

    @property
    def n_free(self) -> int:
        return self._free_list.n_free

    @property
    def n_evictable(self) -> int:
        """Slots only the tree holds."""
        return self._n_evictable

    @property
    def n_protected(self) -> int:
        """Slots some request holds."""
        return self._n_protected

    @property
    def n_held(self) -> int:
        return self.n_evictable + self.n_protected

    def alloc(self, n: int) -> np.ndarray:
        """``n`` fresh slots, each with one request reference (owned by the caller)."""
        if type(n) is not int or n < 0:
            raise PoolError(f"n: cannot allocate {n!r} slots")
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        slots = self._free_list.take(n)
        if slots is None:
            raise PoolExhausted(f"need {n} slots, {self.n_free} free of {self.size}")
        slots = np.asarray(slots, dtype=np.int64)
        self._adopt(slots)
        return slots

    def adopt(self, slots: np.ndarray) -> None:
        """Take slots the engine allocated itself (off the free list, unheld) as request-owned."""
        slots = self._in_range(slots, "adopt")
        if slots.size == 0:
            return
        if _unique_counts(slots)[0].size != slots.size:
            raise PoolError("slots: adopt lists a slot twice")
        held = (self._refs[slots] + self._tree[slots]) > 0
        if held.any():
            raise PoolError(f"slots: adopt of slot {int(slots[held][0])}, which is already held")
        self._adopt(slots)

    def incref(self, slots: np.ndarray) -> None:
        """Add one request reference per listed slot (repeats add several); slots must be held."""
        self._change(slots, "incref", self._refs, 1)

    def decref(self, slots: np.ndarray) -> int:
        """Drop one request reference per listed slot; returns how many slots were freed."""
        return self._change(slots, "decref", self._refs, -1)

    def tree_incref(self, slots: np.ndarray) -> None:
        """The tree takes one reference per listed slot (each must be held already)."""
        self._change(slots, "tree_incref", self._tree, 1)

    def tree_decref(self, slots: np.ndarray) -> int:
        """The tree drops one reference per listed slot; returns how many slots were freed."""
        return self._change(slots, "tree_decref", self._tree, -1)

    def refcount(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        return self._refs[slots] + self._tree[slots]

    def request_refs(self, slots: np.ndarray) -> np.ndarray:
        return self._refs[np.asarray(slots, dtype=np.int64)]

    def tree_refs(self, slots: np.ndarray) -> np.ndarray:
        return self._tree[np.asarray(slots, dtype=np.int64)]

    def _adopt(self, slots: np.ndarray) -> None:
        self._refs[slots] = 1
        self._n_protected += int(slots.size)
        self.changes += 1

    def _change(self, slots: np.ndarray, op: str, holder: np.ndarray, delta: int) -> int:
        """Add ``delta`` references of one holder (``holder``: the request or the tree counts) per
        listing of each slot, every slot held; all or nothing. Returns how many slots were freed."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size == 0:
            return 0
        if slots.min() < 1 or slots.max() > self.size:
            self._in_range(slots, op)
        touched, counts = self._listed(slots)
        requests, tree = self._refs[touched], self._tree[touched]
        if not (requests + tree).all():
            self._refuse_free(slots, op)
        changed = (requests if holder is self._refs else tree) + delta * counts
        if delta < 0 and (changed < 0).any():
            raise PoolError(f"slots: slot {int(touched[changed < 0].min())} released more often than referenced")
        holder[touched] = changed
        self.changes += 1
        protected = 0
        if holder is self._refs:
            protected = int(np.count_nonzero(changed)) - int(np.count_nonzero(requests))
            requests = changed
        else:
            tree = changed
        freed = np.sort(touched[(requests + tree) == 0]) if delta < 0 else touched[:0]
        # every touched slot was held: those that did not become or stay protected, nor were freed, are evictable
        self._n_protected += protected
        self._n_evictable -= protected + int(freed.size)
        if freed.size:
            self._free_list.give(freed)
            if self._on_free is not None:
                self._on_free(freed)
        return int(freed.size)

    def n_distinct(self, slots: np.ndarray) -> int:
        """How many distinct slots ``slots`` (in range) lists, without sorting."""
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        order = np.arange(slots.size, dtype=np.int64)
        self._mark[slots] = order  # with repeats, one listing of each slot is left marked
        return int(np.count_nonzero(self._mark[slots] == order))

    def _listed(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
        """The distinct slots and how often each is listed, as :func:`_unique_counts` (but in the
        given order when none repeats, the usual case of a request's borrowed versions, found
        without sorting). ``slots`` must be in range."""
        if self.n_distinct(slots) == slots.size:
            return slots, 1
        return _unique_counts(slots)

    def _in_range(self, slots: np.ndarray, op: str) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        out_of_range = (slots < 1) | (slots > self.size)
        if out_of_range.any():
            raise PoolError(f"slots: {op} of slot {int(slots[out_of_range][0])} outside 1..{self.size}")
        return slots

    def _refuse_free(self, slots: np.ndarray, op: str) -> None:
        """Raise naming the first listed slot that is free (the caller found one)."""
        free = (self._refs[slots] + self._tree[slots]) == 0
        raise PoolError(f"slots: {op} of slot {int(slots[free][0])}, which is free")


def _unique_counts(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
    """The distinct slots, sorted, and how often each is listed (1 when none repeats). By sorting:
    numpy 2's hashing ``unique`` takes ~14x longer on the few-thousand-slot arrays a request
    publishes."""
    if slots.size < 2 or (slots[1:] > slots[:-1]).all():  # already sorted and distinct (a typical allocation)
        return slots, 1
    ordered = np.sort(slots)
    first = np.ones(ordered.size, dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    if first.all():
        return ordered, 1
    starts = np.flatnonzero(first)
    return ordered[starts], np.diff(np.append(starts, ordered.size))

