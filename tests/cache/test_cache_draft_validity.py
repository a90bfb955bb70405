"""A draft stays valid while the tree path it matched is unchanged (``CacheCore.current``) and no
other request references a version it rotates in place (``CacheCore.contested``): whenever the core
says so after any sequence of publications, evictions, commits and aborts of other
requests, a fresh match finds exactly the draft's versions, and every version the draft rotates in
place is still one only it could read (the tree's own rule, recomputed)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.core import CacheCore, CacheFull
from akv.system.cache.keys import program_key
from akv.system.cache.pool import SlotPool

from .conversations import Conversation, conversations

OPS = st.one_of(
    st.tuples(st.just("publish"), st.integers(0, 3), st.integers(0, 6)),
    st.tuples(st.just("hold"), st.integers(0, 3), st.integers(0, 6)),
    st.tuples(st.just("finish"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("evict"), st.integers(1, 40), st.booleans()),
)


def _turn(conv: Conversation, turn: int) -> int:
    return min(turn, conv.n_turns - 1)


def _same_match(draft, fresh) -> bool:
    return (draft.match.n_tokens == fresh.match.n_tokens and draft.match.n_records == fresh.match.n_records
            and np.array_equal(draft.match.slots, fresh.match.slots)
            and np.array_equal(draft.match.positions, fresh.match.positions))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_current_draft_is_what_a_fresh_match_would_allow(data: st.DataObject) -> None:
    base = data.draw(conversations(max_messages=6))
    convs = [base] + [data.draw(conversations(max_messages=6, prefix=base)) for _ in range(3)]
    core = CacheCore(SlotPool(300))
    for conv in convs[: data.draw(st.integers(0, 4))]:
        core.finish(core.admit(conv.program(_turn(conv, data.draw(st.integers(0, 6)))), in_place=True))
    target = data.draw(st.sampled_from(convs))
    program = target.program(_turn(target, data.draw(st.integers(0, 6))))
    births_in_place = data.draw(st.booleans())
    draft = core.match(program, in_place=True, births_in_place=births_in_place)
    held = []
    for op in data.draw(st.lists(OPS, max_size=8)):
        if op[0] == "publish":
            conv = convs[op[1]]
            core.finish(core.admit(conv.program(_turn(conv, op[2])), in_place=True), conv.reply(_turn(conv, op[2])),
                        core.allocate(conv.reply(_turn(conv, op[2])).size))
        elif op[0] == "hold":
            conv = convs[op[1]]
            other = core.match(conv.program(_turn(conv, op[2])), in_place=True)
            try:
                held.append(core.admit_draft(other))
            except CacheFull:
                pass
        elif op[0] == "finish" and held:
            request = held.pop(op[1] % len(held))
            core.finish(request) if op[2] else core.abort(request)
        elif op[0] == "evict":
            core.tree.evict(op[1])
        if not core.current(draft) or core.contested(draft):  # a contested draft is planned again too
            continue
        fresh = core.match(program, in_place=True, births_in_place=births_in_place)
        assert _same_match(draft, fresh), op
        key = program_key(program)
        takeable = core.tree.exclusive(key, fresh.match)
        taken = draft.plan.taken
        assert np.isin(taken, fresh.match.slots[takeable]).all(), op
        if np.array_equal(taken, fresh.plan.taken):
            assert fresh.plan.plan.usage == draft.plan.plan.usage
            assert np.array_equal(fresh.plan.plan.borrowed, draft.plan.plan.borrowed)
            assert fresh.n_copy_slots == draft.n_copy_slots
    if core.current(draft) and not core.contested(draft):
        core.abort(core.commit(draft))
    for request in held:
        core.abort(request)
    assert core.pool.n_protected == 0


def test_a_new_reader_of_the_path_end_invalidates_an_in_place_draft() -> None:
    """The draft rotates in place a version only its own earlier turn reads, in a node above the
    turn's end; then another turn extends that end (the old end's reads pass to the new one, the node
    holding the version is not touched). The version now has a reader besides the draft's own path,
    so the draft is stale."""
    s, m0, x, z, y, g = (1, 2), (3, 4, 5), (6, 7), (8, 9), (10, 11), (12,)
    core = CacheCore(SlotPool(200))
    core.finish(core.admit(Conversation((s, m0, x), {}, ()).program(2), in_place=True))
    # another conversation shares s and m0 (splitting the turn's node after them) and drops both
    core.finish(core.admit(Conversation((s, m0, z), {2: (0, 1)}, ()).program(2), in_place=True))
    program = Conversation((s, m0, x, g), {2: (0, 2)}, (2,)).program(3)
    draft = core.match(program, in_place=True)
    assert draft.plan.taken.size == len(m0), "the draft rotates m0's versions in place"
    core.finish(core.admit(Conversation((s, m0, x, y), {}, ()).program(3), in_place=True))
    fresh = core.match(program, in_place=True)
    assert fresh.plan.taken.size < draft.plan.taken.size  # the tree's own rule, recomputed
    assert not core.current(draft)
