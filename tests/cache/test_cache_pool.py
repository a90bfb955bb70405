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


def test_random_reference_changes_match_per_slot_counters() -> None:
    """Request and tree references, listed with repeats, against brute-force per-slot counters: the
    counts, the free list, the slots each release frees, and every refusal (slot out of range, free,
    released too often, adopted twice or while held) naming the slot and changing nothing."""
    size = 12
    rng = np.random.default_rng(5)
    freed: list[list[int]] = []
    pool = SlotPool(size, on_free=lambda s: freed.append(s.tolist()))
    refs, tree = np.zeros(size + 2, dtype=np.int64), np.zeros(size + 2, dtype=np.int64)
    ops = {"incref": (pool.incref, refs, 1), "decref": (pool.decref, refs, -1),
           "tree_incref": (pool.tree_incref, tree, 1), "tree_decref": (pool.tree_decref, tree, -1)}
    for _ in range(4000):
        name = str(rng.choice(["alloc", "adopt", *ops]))
        held = np.flatnonzero(refs + tree > 0)
        if name == "alloc":
            n = int(rng.integers(0, 4))
            if n > size - held.size:
                with pytest.raises(PoolExhausted):
                    pool.alloc(n)
            else:
                slots = pool.alloc(n)
                assert not (refs[slots] + tree[slots]).any() and np.unique(slots).size == n
                refs[slots] = 1
        elif name == "adopt":
            taken = pool._free_list.take(min(int(rng.integers(1, 4)), size - held.size))
            slots = taken
            if held.size and rng.random() < 0.2:
                slots = np.append(taken, rng.choice(held))
            elif taken.size and rng.random() < 0.2:
                slots = np.append(taken, taken[0])
            if slots.size > np.unique(slots).size:
                with pytest.raises(PoolError, match="adopt lists a slot twice"):
                    pool.adopt(slots)
                pool._free_list.give(taken)
            elif slots.size > taken.size:
                with pytest.raises(PoolError, match=rf"adopt of slot {int(slots[-1])}, which is already held"):
                    pool.adopt(slots)
                pool._free_list.give(taken)
            else:
                pool.adopt(slots)
                refs[slots] = 1
        else:
            call, counter, delta = ops[name]
            pick = held if held.size and rng.random() < 0.9 else np.arange(size + 2)
            slots = rng.choice(pick, size=int(rng.integers(0, 5)))
            listed = np.bincount(slots, minlength=size + 2)
            outside = slots[(slots < 1) | (slots > size)]
            free = slots[(refs[slots] + tree[slots]) == 0]
            over = np.flatnonzero(counter + delta * listed < 0)
            n_freed = len(freed)
            if outside.size:
                with pytest.raises(PoolError, match=rf"{name} of slot {int(outside[0])} outside 1..{size}"):
                    call(slots)
            elif free.size:
                with pytest.raises(PoolError, match=rf"{name} of slot {int(free[0])}, which is free"):
                    call(slots)
            elif over.size:
                with pytest.raises(PoolError, match=rf"slot {int(over[0])} released more often than referenced"):
                    call(slots)
            else:
                counter += delta * listed
                gone = [int(s) for s in np.unique(slots) if refs[s] + tree[s] == 0]
                result = call(slots)
                assert (result == len(gone)) if delta < 0 else result is None
                assert freed[n_freed:] == ([gone] if gone else [])
            if outside.size or free.size or over.size:
                assert len(freed) == n_freed
        inner = slice(1, size + 1)
        assert np.array_equal(pool.refcount(np.arange(1, size + 1)), (refs + tree)[inner])
        assert np.array_equal(pool.request_refs(np.arange(1, size + 1)), refs[inner])
        assert pool.n_protected == int((refs[inner] > 0).sum())
        assert pool.n_evictable == int(((refs[inner] == 0) & (tree[inner] > 0)).sum())
        assert pool.n_free == size - pool.n_held


def test_n_distinct_counts_as_unique_does() -> None:
    rng = np.random.default_rng(7)
    pool = SlotPool(50)
    for size in (0, 1, 5, 40, 200):
        slots = rng.integers(1, 51, size=size)
        assert pool.n_distinct(slots) == np.unique(slots).size
