"""Slot pool: slots are freed only when the last reference goes; misuse names the slot."""

from __future__ import annotations

import numpy as np
import pytest

from akv.system.cache.pool import PoolError, PoolExhausted, SlotPool


def test_slots_return_to_the_free_list_at_refcount_zero() -> None:
    freed: list[list[int]] = []
    pool = SlotPool(4, on_free=lambda s: freed.append(sorted(s.tolist())))
    slots = pool.alloc(3)
    assert sorted(slots.tolist()) == [1, 2, 3] and pool.n_free == 1
    pool.incref(slots[:1])
    pool.decref(slots)
    assert pool.n_free == 3 and freed == [sorted(slots[1:].tolist())]
    pool.decref(slots[:1])
    assert pool.n_free == 4 and freed[-1] == [int(slots[0])]
    assert sorted(pool.alloc(4).tolist()) == [1, 2, 3, 4]


def test_repeated_slots_count_once_per_listing() -> None:
    pool = SlotPool(2)
    slot = pool.alloc(1)
    pool.incref(np.array([slot[0], slot[0]]))
    assert pool.refcount(slot)[0] == 3
    pool.decref(np.array([slot[0], slot[0], slot[0]]))
    assert pool.n_free == 2


def test_misuse_names_the_slot() -> None:
    pool = SlotPool(3)
    slots = pool.alloc(1)
    with pytest.raises(PoolError, match=r"decref of slot 2, which is free"):
        pool.decref(np.array([2]))
    with pytest.raises(PoolError, match=r"slot 0 outside 1..3"):
        pool.incref(np.array([0]))
    with pytest.raises(PoolError, match=rf"slot {int(slots[0])} released more often"):
        pool.decref(np.array([slots[0], slots[0]]))
    assert pool.refcount(slots)[0] == 1
    with pytest.raises(PoolExhausted, match="need 5 slots, 2 free of 3"):
        pool.alloc(5)
    with pytest.raises(PoolError, match="size"):
        SlotPool(0)
