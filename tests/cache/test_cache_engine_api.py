"""The engine-facing split of admission: pure ``match``, ``commit`` at lock time, births bound per
chunk by the engine's own allocator, O(1) evictable/protected counters, eviction that can always
free what it counts as evictable."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.core import CacheCore, RequestStateError
from akv.system.cache.pool import ArrayFreeList, PoolError, SlotPool

from .conversations import Conversation, conversations

MESSAGES = ((1, 2), (3, 4), (5, 6), (7, 8), (9,))


def _engine_core(size: int) -> tuple[CacheCore, ArrayFreeList]:
    """A core whose free list the test also draws from directly, as an engine allocator would."""
    free = ArrayFreeList(size)
    return CacheCore(SlotPool(size, free_list=free)), free


def _serve_in_chunks(core: CacheCore, free: ArrayFreeList, program, chunk: int) -> dict[str, int]:
    """match -> commit -> births bound chunk by chunk -> finish; returns the usage."""
    draft = core.match(program)
    request = core.commit(draft)
    tokens = np.flatnonzero(request.plan.computed)
    for lo in range(0, tokens.size, chunk):
        part = tokens[lo : lo + chunk]
        slots = free.take(part.size)
        core.bind_births(request, part, slots)
    core.finish(request)
    return request.plan.usage.as_dict()


def _recount(pool: SlotPool) -> tuple[int, int]:
    req, tree = pool._refs[1:], pool._tree[1:]
    return int(((tree > 0) & (req == 0)).sum()), int((req > 0).sum())


def test_match_holds_nothing_and_repeats() -> None:
    core, _ = _engine_core(64)
    conv = Conversation(MESSAGES, {2: (0,)}, (2,))
    core.finish(core.admit(conv.program(2)))
    before = (core.pool.n_free, core.pool.n_evictable, core.pool.n_protected, core.epoch)
    first = core.match(conv.program(4))
    second = core.match(conv.program(4))
    assert (core.pool.n_free, core.pool.n_evictable, core.pool.n_protected, core.epoch) == before
    assert first.plan.plan.usage == second.plan.plan.usage
    assert first.n_births == second.n_births and first.n_copy_slots == second.n_copy_slots
    assert first.n_births == int(first.plan.plan.computed.sum()) > 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_chunked_births_give_what_admit_gives(data: st.DataObject) -> None:
    """Serving a conversation turn by turn through match/commit/bind_births (any chunk size) leaves
    the same usage, tree and pool counts as the all-at-once ``admit``."""
    conv = data.draw(conversations())
    chunk = data.draw(st.integers(1, 4))
    engine, free = _engine_core(400)
    reference = CacheCore(SlotPool(400))
    for turn in range(conv.n_turns):
        program = conv.program(turn)
        expected = reference.admit(program)
        reference.finish(expected)
        assert _serve_in_chunks(engine, free, program, chunk) == expected.plan.usage.as_dict()
        assert engine.tree.stats() == reference.tree.stats()
        assert (engine.pool.n_free, engine.pool.n_evictable) == (reference.pool.n_free, reference.pool.n_evictable)
    assert engine.pool.n_protected == 0 and _recount(engine.pool) == (engine.pool.n_evictable, 0)


def test_commit_refuses_a_draft_the_tree_changed_under() -> None:
    core, _ = _engine_core(64)
    conv = Conversation(MESSAGES, {}, ())
    draft = core.match(conv.program(3))
    core.finish(core.admit(conv.program(1)))
    with pytest.raises(RequestStateError, match="draft: the tree changed on its path"):
        core.commit(draft)
    assert core.pool.n_protected == 0


def test_an_unbound_birth_cannot_be_published() -> None:
    core, free = _engine_core(64)
    request = core.commit(core.match(Conversation(MESSAGES, {}, ()).program(2)))
    tokens = np.flatnonzero(request.plan.computed)
    core.bind_births(request, tokens[:2], free.take(2))
    with pytest.raises(Exception, match="before its birth slot is bound"):
        core.finish(request)
    core.abort(request)
    assert core.pool.n_free == 64 and core.pool.n_held == 0


def test_births_must_be_unheld_engine_slots() -> None:
    core, free = _engine_core(16)
    request = core.commit(core.match(Conversation(MESSAGES, {}, ()).program(1)))
    taken = core.pool.alloc(1)
    with pytest.raises(PoolError, match="already held"):
        core.bind_births(request, np.array([0]), taken)
    with pytest.raises(RequestStateError, match="not unbound births"):
        core.bind_births(request, np.array([99]), free.take(1))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "inc", "dec", "tinc", "tdec"]), st.integers(0, 10 ** 6)),
                max_size=60))
def test_counters_equal_a_recount(ops: list[tuple[str, int]]) -> None:
    pool = SlotPool(12)
    held: list[int] = []
    for op, r in ops:
        if op == "alloc":
            if pool.n_free:
                held.extend(pool.alloc(1 + r % pool.n_free).tolist())
            continue
        live = [s for s in held if pool.refcount([s])[0] > 0]
        if not live:
            continue
        slot = np.array([live[r % len(live)]])
        if op == "inc":
            pool.incref(slot)
        elif op == "tinc":
            pool.tree_incref(slot)
        elif op == "dec" and pool.request_refs(slot)[0] > 0:
            pool.decref(slot)
        elif op == "tdec" and pool._tree[slot[0]] > 0:
            pool.tree_decref(slot)
        assert (pool.n_evictable, pool.n_protected) == _recount(pool)
        assert pool.n_free + pool.n_held == pool.size


def test_eviction_frees_inner_versions_no_request_holds() -> None:
    """A request holding only a leaf's versions must not make its ancestors' versions unfreeable:
    what the pool counts as evictable, eviction frees."""
    core = CacheCore(SlotPool(40))
    conv = Conversation(MESSAGES, {}, ())
    core.finish(core.admit(conv.program(2)))
    longer = core.admit(conv.program(4))
    leaf_only = longer.plan.fresh
    core.finish(longer)
    core.pool.incref(leaf_only)
    evictable = core.pool.n_evictable
    assert evictable > 0
    assert core.tree.evict(10 ** 6) == evictable
    assert core.pool.n_evictable == 0 and core.pool.n_protected == leaf_only.size
    core.pool.decref(leaf_only)
    core.flush()
    assert core.pool.n_free == 40


def test_drop_skipped_counts_dropped_tokens_computed_in_the_same_request() -> None:
    """A cold request that computes message 1 and then drops it: every query after the drop skips
    message 1's two tokens, so they count (DESIGN.md §2), as they do when they were reused."""
    conv = Conversation(MESSAGES, {2: (1,)}, ())
    cold = CacheCore(SlotPool(64)).admit(conv.program(3))
    assert cold.plan.computed[2:4].all()
    assert cold.plan.usage.drop_skipped_tokens == 2
    warm_core = CacheCore(SlotPool(64))
    warm_core.finish(warm_core.admit(conv.program(2)))
    assert warm_core.admit(conv.program(3)).plan.usage.drop_skipped_tokens == 2
