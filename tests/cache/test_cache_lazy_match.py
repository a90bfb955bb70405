"""A match reads the tree's versions lazily (only the rows a plan asks for, issues #28 / #29 / #30); it
must still be what the tree held at the match, and plan exactly as a match copied out whole would.
Checked against a table built here by walking the tree's nodes record by record."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.core import CacheCore, CacheFull
from akv.system.cache.keys import RecordKey, program_key
from akv.system.cache.occurrence import DraftPlan, plan_occurrences
from akv.system.cache.plan import MatchResult
from akv.system.cache.pool import SlotPool

from .conversations import Conversation, conversations


def _walked(core: CacheCore, key: RecordKey) -> tuple[int, np.ndarray, np.ndarray]:
    """Matched records and the per-token version table, by a plain walk over the nodes' records."""
    node = core.tree._roots.get(key.namespace)
    records = key.records.tolist()
    rows: list[tuple[list[int], list[int]]] = []
    i = 0
    while node is not None and i < len(records) and records[i] in node.children:
        child = node.children[records[i]]
        edge = child.key.tolist()
        k = 0
        while k < len(edge) and i + k < len(records) and edge[k] == records[i + k]:
            rows.append((child.slots[k].tolist(), child.positions[k].tolist()))
            k += 1
        i += k
        node = child if k == len(edge) else None
    n_tokens = int(np.searchsorted(key.token_record, i))
    width = max([len(r[0]) for r in rows] or [1])
    slots = np.full((n_tokens, width), -1, dtype=np.int64)
    positions = np.full((n_tokens, width), -1, dtype=np.int64)
    for t in range(n_tokens):
        s, p = rows[int(key.token_record[t])]
        slots[t, : len(s)], positions[t, : len(p)] = s, p
    return i, slots, positions


def _same_plan(a: DraftPlan, b: DraftPlan) -> None:
    assert a.n_copy_slots == b.n_copy_slots
    for name in ("colors", "taken", "taken_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    pa, pb = a.plan, b.plan
    assert pa.usage == pb.usage
    for name in ("borrowed", "fresh", "computed"):
        assert np.array_equal(getattr(pa, name), getattr(pb, name)), name
    assert len(pa.segments) == len(pb.segments)
    for sa, sb in list(zip(pa.segments, pb.segments)) + [(pa.terminal, pb.terminal)]:
        for f in dataclasses.fields(sa):
            va, vb = getattr(sa, f.name), getattr(sb, f.name)
            if f.name == "copies":
                for g in dataclasses.fields(va):
                    assert np.array_equal(getattr(va, g.name), getattr(vb, g.name)), (f.name, g.name)
            else:
                assert np.array_equal(va, vb), f.name


def _serve(core: CacheCore, conv: Conversation, turn: int) -> None:
    try:
        request = core.admit(conv.program(turn), in_place=True)
    except CacheFull:
        return
    reply = conv.reply(turn)
    try:
        slots = core.allocate(reply.size)
    except CacheFull:
        core.finish(request)
        return
    core.finish(request, reply, slots)


@settings(max_examples=150, deadline=None)
@given(conversations(max_messages=9), st.data())
def test_lazy_match_plans_as_the_whole_table_and_keeps_what_it_saw(conv: Conversation, data: st.DataObject) -> None:
    core = CacheCore(SlotPool(data.draw(st.sampled_from([40, 400]))))
    branch = conv.without_ops_from(data.draw(st.integers(0, conv.n_turns - 1)))
    upto = data.draw(st.integers(0, conv.n_turns - 1))
    for turn in range(upto):
        _serve(core, conv, turn)
        if data.draw(st.booleans()):
            core.tree.evict(data.draw(st.integers(1, 20)))
    hidden = np.zeros(0, np.int64)
    if data.draw(st.booleans()):  # a locked request's in-place versions, hidden from the match
        hidden = core.match(branch.program(upto), in_place=True).plan.taken
        core.reserve(hidden)
    program = conv.program(upto)
    key = program_key(program)
    n_records, slots, positions = _walked(core, key)
    gone = (slots >= 0) & np.isin(slots, hidden)
    slots, positions = np.where(gone, -1, slots), np.where(gone, -1, positions)

    lazy = core.resident(key)
    whole = MatchResult.of(slots.shape[0], n_records, slots, positions)
    assert (lazy.n_tokens, lazy.n_records) == (whole.n_tokens, whole.n_records)
    for compact, in_place in ((False, False), (True, False), (False, True)):
        plans = [plan_occurrences(program, m, compact=compact,
                                  takeable=partial(core.tree.exclusive, key, m) if compact or in_place else None)
                 for m in (lazy, whole)]
        _same_plan(*plans)

    # the tree moves on (more turns, a branch, evictions): the match still shows what it saw
    for turn in range(upto, conv.n_turns):
        _serve(core, conv, turn)
    _serve(core, branch, conv.n_turns - 1)
    core.tree.evict(data.draw(st.integers(0, 30)))
    asked = np.flatnonzero(np.asarray(data.draw(st.lists(st.booleans(), min_size=slots.shape[0],
                                                         max_size=slots.shape[0])), dtype=bool))
    got_slots, got_positions = lazy.versions(asked)
    width = slots.shape[1]
    assert np.array_equal(got_slots[:, :width], slots[asked]) and (got_slots[:, width:] == -1).all()
    assert np.array_equal(got_positions[:, :width], positions[asked])
    assert np.array_equal(lazy.slots[:, :width], slots) and np.array_equal(lazy.positions[:, :width], positions)
    assert np.array_equal(lazy.resident, (slots >= 0).any(axis=1))
