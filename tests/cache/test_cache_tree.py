"""Radix tree: matching whole-token histories, version adoption, drop-aware then LRU eviction."""

from __future__ import annotations

import numpy as np

from akv.system.cache import plain
from akv.system.cache.core import CacheCore
from akv.system.cache.keys import DROP_CLOSE, DROP_OPEN, RecordKey, plain_key
from akv.system.cache.pool import SlotPool
from akv.system.cache.tree import RadixTree


def _publish(tree: RadixTree, key: RecordKey, positions: list[int], terminal: list[int] | None = None) -> np.ndarray:
    """Insert one version per token at ``positions``; the caller keeps (then drops) its own reference."""
    slots = tree.pool.alloc(key.n_tokens)
    pos = np.array(positions, dtype=np.int64)
    term = pos if terminal is None else np.array(terminal, dtype=np.int64)
    tree.insert(key, slots[:, None], pos[:, None], term)
    tree.pool.decref(slots)
    return slots


def _versions(tree: RadixTree, key: RecordKey) -> list[dict[int, int]]:
    m = tree.match(key)
    return [{int(p): int(s) for p, s in zip(m.positions[t], m.slots[t]) if s >= 0} for t in range(m.n_tokens)]


def test_match_returns_the_versions_of_the_common_prefix() -> None:
    tree = RadixTree(SlotPool(32))
    a = _publish(tree, plain_key(np.array([1, 2, 3, 4])), [0, 1, 2, 3])
    b = _publish(tree, plain_key(np.array([1, 2, 9])), [0, 1, 2])
    assert _versions(tree, plain_key(np.array([1, 2, 3, 7]))) == [{0: a[0]}, {1: a[1]}, {2: a[2]}]
    assert _versions(tree, plain_key(np.array([1, 2, 9, 9]))) == [{0: a[0]}, {1: a[1]}, {2: b[2]}]
    assert tree.match(plain_key(np.array([1, 2, 3]), namespace="lora-x")).n_tokens == 0
    assert tree.pool.refcount(b[:2]).tolist() == [0, 0], "duplicates of resident versions are not adopted"


def test_a_token_after_a_mismatching_event_never_counts() -> None:
    tree = RadixTree(SlotPool(32))
    stored = RecordKey(np.array([1, 2, DROP_OPEN, -8, -9, DROP_CLOSE, 5]), np.array([0, 1, 6]))
    _publish(tree, stored, [0, 1, 2])
    other = RecordKey(np.array([1, 2, DROP_OPEN, -8, -10, DROP_CLOSE, 5]), np.array([0, 1, 6]))
    m = tree.match(other)
    assert (m.n_records, m.n_tokens) == (4, 2)
    assert tree.match(plain_key(np.array([1, 2, 5]))).n_tokens == 2


def test_new_versions_join_existing_tokens() -> None:
    tree = RadixTree(SlotPool(32))
    key = plain_key(np.array([1, 2, 3]))
    births = _publish(tree, key, [0, 1, 2])
    moved = _publish(tree, key, [0, 0, 1])
    assert _versions(tree, key) == [{0: births[0]}, {1: births[1], 0: moved[1]}, {2: births[2], 1: moved[2]}]
    assert tree.pool.refcount(births).tolist() == [1, 1, 1]


def test_stale_versions_go_first_and_leave_a_matching_hole() -> None:
    pool = SlotPool(32)
    tree = RadixTree(pool)
    old = _publish(tree, plain_key(np.array([7, 7])), [0, 1])
    key = plain_key(np.array([1, 2, 3, 4]))
    # tokens 1 and 2 are dropped on this path (terminal -1): their KV is stale though most recent
    dropped = _publish(tree, key, [0, 1, 2, 3], terminal=[0, -1, -1, 3])
    assert tree.evict(2) == 2
    assert _versions(tree, key) == [{0: dropped[0]}, {}, {}, {3: dropped[3]}]
    assert _versions(tree, plain_key(np.array([7, 7]))) == [{0: old[0]}, {1: old[1]}]
    assert pool.n_free == 32 - 4


def test_lru_leaves_after_stale_and_never_what_others_hold() -> None:
    pool = SlotPool(32)
    tree = RadixTree(pool)
    older = _publish(tree, plain_key(np.array([1, 1])), [0, 1])
    newer = _publish(tree, plain_key(np.array([2, 2])), [0, 1])
    held = _publish(tree, plain_key(np.array([3, 3])), [0, 1])
    tree.match(plain_key(np.array([2, 2])))  # touching makes [2, 2] the most recent
    pool.incref(held)
    assert tree.evict(1) == 2
    assert tree.match(plain_key(np.array([1, 1]))).n_tokens == 0
    assert tree.match(plain_key(np.array([2, 2]))).n_tokens == 2
    assert tree.evict(100) == 2
    assert tree.match(plain_key(np.array([3, 3]))).n_tokens == 2, "a referenced leaf stays"
    assert pool.refcount(held).tolist() == [2, 2]
    assert pool.n_free == 30 and (pool.refcount(np.concatenate([older, newer])) == 0).all()


def test_flush_returns_every_reference() -> None:
    pool = SlotPool(16)
    tree = RadixTree(pool)
    _publish(tree, plain_key(np.array([1, 2, 3])), [0, 1, 2])
    _publish(tree, plain_key(np.array([1, 2, 3])), [0, 0, 0])
    _publish(tree, plain_key(np.array([1, 5])), [0, 1])
    assert tree.resident_slots().size == 6
    tree.flush()
    assert pool.n_free == 16 and tree.n_nodes == 0


def test_stats_count_tokens_not_events() -> None:
    tree = RadixTree(SlotPool(16))
    _publish(tree, RecordKey(np.array([1, 2, DROP_OPEN, -8, -9, DROP_CLOSE, 5]), np.array([0, 1, 6])), [0, 1, 2])
    _publish(tree, plain_key(np.array([1, 2, 3])), [0, 0, 2])
    assert tree.stats() == {"nodes": 3, "token_records": 4, "versions": 5}


def test_insert_returns_the_slot_resident_for_each_given_version() -> None:
    """Publications over shared prefixes, with events, duplicates and two versions per token: each
    given (token, position) maps to the slot a match then finds there; a plain publication's
    resident slots are what ``resident_prefix`` re-matches."""
    core = CacheCore(SlotPool(400))
    tree = core.tree
    rng = np.random.default_rng(3)
    drop = [DROP_OPEN, -9, -10, DROP_CLOSE]
    duplicates = 0
    keys = [plain_key(np.array([1, 2, 3, 4, 5])), plain_key(np.array([1, 2, 3, 8])),
            RecordKey(np.array([1, 2, *drop, 3, 4]), np.array([0, 1, 6, 7])), plain_key(np.array([1, 2, 3, 4, 5, 6]))]
    for step in range(12):
        key = keys[step % len(keys)]
        width = 1 + step % 2
        allocated = tree.pool.alloc(key.n_tokens * width)
        slots = allocated.reshape(key.n_tokens, width).copy()
        positions = rng.integers(0, 3, size=slots.shape) + np.arange(key.n_tokens)[:, None]
        positions[:, 1:] = np.where(positions[:, 1:] == positions[:, :1], positions[:, 1:] + 5, positions[:, 1:])
        slots[rng.random(slots.shape) < 0.2] = -1
        resident = tree.insert(key, slots, np.where(slots >= 0, positions, -1), positions[:, 0])
        versions = _versions(tree, key)
        want = [[versions[t][int(p)] if s >= 0 else -1 for s, p in zip(slots[t], positions[t])]
                for t in range(key.n_tokens)]
        assert resident.tolist() == want, f"step {step}"
        duplicates += int(((resident != slots) & (slots >= 0)).sum())
        tree.pool.decref(allocated)
    assert duplicates > 0
    for ids in ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]):
        ids = np.array(ids)
        row = core.pool._free_list.take(ids.size)  # allocated by the engine, as the radix backend's rows
        assert np.array_equal(plain.publish(core, row, 0, ids, ""), plain.resident_prefix(core, ids, ""))
