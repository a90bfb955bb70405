"""KV slot pool with reference counts: a slot returns to the free list only at refcount zero.

Slot ids run from 1 to ``size``; slot 0 is the padding slot (as in SGLang's pools) and is never
handed out. Every holder (the radix tree, each request) takes its own reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class PoolError(ValueError):
    """A slot operation is invalid (unknown slot, freeing a free slot); the message names the slot."""


class PoolExhausted(RuntimeError):
    """Not enough free slots for an allocation."""


class SlotPool:
    """Free list plus per-slot reference counts; ``on_free`` sees every batch of slots freed."""

    def __init__(self, size: int, on_free: Callable[[np.ndarray], None] | None = None) -> None:
        if type(size) is not int or size < 1:
            raise PoolError(f"size: {size!r} is not a positive int")
        self.size = size
        self._refs = np.zeros(size + 1, dtype=np.int64)
        self._free = np.arange(size, 0, -1, dtype=np.int64)
        self._n_free = size
        self._on_free = on_free

    @property
    def n_free(self) -> int:
        return self._n_free

    def alloc(self, n: int) -> np.ndarray:
        """``n`` fresh slots, each with refcount 1 (owned by the caller)."""
        if n < 0:
            raise PoolError(f"n: cannot allocate {n} slots")
        if n > self._n_free:
            raise PoolExhausted(f"need {n} slots, {self._n_free} free of {self.size}")
        slots = self._free[self._n_free - n : self._n_free][::-1].copy()
        self._n_free -= n
        self._refs[slots] = 1
        return slots

    def incref(self, slots: np.ndarray) -> None:
        """Add one reference per listed slot (repeats add several); every slot must be allocated."""
        slots = self._check(slots, "incref")
        np.add.at(self._refs, slots, 1)

    def decref(self, slots: np.ndarray) -> None:
        """Drop one reference per listed slot; slots reaching zero go back to the free list."""
        slots = self._check(slots, "decref")
        np.subtract.at(self._refs, slots, 1)
        if (self._refs[slots] < 0).any():
            bad = int(slots[self._refs[slots] < 0][0])
            np.add.at(self._refs, slots, 1)
            raise PoolError(f"slots: slot {bad} released more often than referenced")
        freed = np.unique(slots[self._refs[slots] == 0])
        if freed.size:
            self._free[self._n_free : self._n_free + freed.size] = freed
            self._n_free += freed.size
            if self._on_free is not None:
                self._on_free(freed)

    def refcount(self, slots: np.ndarray) -> np.ndarray:
        return self._refs[np.asarray(slots, dtype=np.int64)]

    def _check(self, slots: np.ndarray, op: str) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size == 0:
            return slots
        out_of_range = (slots < 1) | (slots > self.size)
        if out_of_range.any():
            raise PoolError(f"slots: {op} of slot {int(slots[out_of_range][0])} outside 1..{self.size}")
        unallocated = self._refs[slots] == 0
        if unallocated.any():
            raise PoolError(f"slots: {op} of slot {int(slots[unallocated][0])}, which is free")
        return slots
