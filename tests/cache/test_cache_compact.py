"""Compact plans (``CacheCore.admit(..., compact=True)``): a request allocates its largest live set,
not its whole text plus copies. Dropped KV no later step reads gives its slot to later KV, and a
tree version only this request could read is re-rotated where it is (no copy slot) and published at
its new position, so the next turn reads it cached. Checked by hand-counted slots, against the
brute-force KV simulator and against the oracle on the tiny model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.core import CacheCore, CacheFull
from akv.system.cache.occurrence import cold_plan
from akv.system.cache.plan import RequestPlan
from akv.system.cache.pool import ArrayFreeList, SlotPool
from akv.system.context.program import ContextProgram
from akv.system.context.compiler import append_generated
from akv.system.reference.executor import PagedKV, run_decode, run_prefill
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_program

from .brute import Interner, SimulatedKV, brute_layout
from .conversations import Conversation, conversations
from .kernel_contract import assert_kernel_accepts

MESSAGES = ((1, 2), (3, 4), (5, 6), (7, 8), (9,))
TOL = 2e-5


def _in_place(plan) -> set[int]:
    """Slots a plan rotates where they are: copy jobs whose source is their destination."""
    return {int(d) for job in plan.copies for s, d in zip(job.src, job.dst) if s == d}


def test_a_repositioned_turn_rotates_in_place_and_the_next_turn_reads_it_cached() -> None:
    """Turn 2 (messages 0..2) is served plainly; turn 3 drops message 1 and repositions, moving
    tokens 4, 5 from positions 4, 5 to 2, 3. Nothing else reads them at 4, 5, so they are rotated in
    place: turn 3 takes two slots (message 3's tokens 6, 7), not four. Turn 4 reads them cached."""
    pool = SlotPool(64)
    core = CacheCore(pool)
    core.finish(core.admit(Conversation(MESSAGES, {}, ()).program(2), compact=True))
    held = pool.n_held
    agent = Conversation(MESSAGES, {2: (1,)}, (2,))
    free = pool.n_free
    request = core.admit(agent.program(3), compact=True)
    assert free - pool.n_free == 2, "message 3's two births and nothing else"
    (segment,) = request.plan.segments
    copies = segment.copies
    assert copies.tokens.tolist() == [4, 5] and copies.src.tolist() == copies.dst.tolist()
    assert copies.old_positions.tolist() == [4, 5] and copies.new_positions.tolist() == [2, 3]
    assert request.plan.usage.as_dict() == {"cached_tokens": 2, "repos_tokens": 2, "drop_skipped_tokens": 2,
                                            "computed_tokens": 2}  # message 3
    core.finish(request)
    assert pool.n_held == held + 2, "the rotated slots are published again, not duplicated"
    nxt = core.admit(agent.program(4), compact=True)
    assert not any(job.size for job in nxt.plan.copies), "repositioned again"
    assert nxt.plan.usage.as_dict() == {"cached_tokens": 6, "repos_tokens": 0, "drop_skipped_tokens": 2,
                                        "computed_tokens": 1}  # message 4, one token
    core.finish(nxt)
    core.flush()
    assert pool.n_free == pool.size


def test_a_sibling_that_reads_the_old_positions_keeps_them_and_the_request_copies() -> None:
    """A branch that continues turn 2 without the drop was published: it reads tokens 4, 5 at 4, 5,
    so turn 3 copies them into two new slots (four slots in all) and the branch's next turn still
    reads its own versions cached."""
    pool = SlotPool(64)
    core = CacheCore(pool)
    plain = Conversation(MESSAGES, {}, ())
    sibling = Conversation(MESSAGES[:3] + ((11, 12), (13,)), {}, ())
    core.finish(core.admit(plain.program(2), compact=True))
    core.finish(core.admit(sibling.program(3), compact=True))
    free = pool.n_free
    request = core.admit(Conversation(MESSAGES, {2: (1,)}, (2,)).program(3), compact=True)
    assert free - pool.n_free == 4 and not _in_place(request.plan)
    core.finish(request)
    branch = core.admit(sibling.program(4), compact=True)
    assert np.flatnonzero(branch.plan.computed).tolist() == [sibling.program(4).n_tokens - 1]
    assert branch.plan.usage.cached_tokens == sibling.program(3).n_tokens
    core.finish(branch)


@pytest.mark.parametrize("left", [False, True], ids=["continued", "left"])
def test_a_reply_the_next_turn_leaves_holds_no_version_for_later_turns(left: bool) -> None:
    """Each turn generates the next message as its reply, or a reply the next turn's text does not
    repeat (a re-rendered or replayed assistant message: ``left``). Turn 3 moves message 2 (tokens
    4, 5) from its birth positions 4, 5 and copies it, since its own message 3 reads it there first;
    turn 4 moves it again. Only the left turn-2 end still read the versions at 4, 5, and nothing can
    continue it, so turn 4 rotates them where they are in both cases (no copy slot for them)."""
    messages = MESSAGES[:4] + ((10, 11),)
    agent = Conversation(messages, {3: (0,), 4: (1,)}, (3, 4))
    core = CacheCore(SlotPool(64))
    for turn in (2, 3, 4):
        request = core.admit(agent.program(turn), in_place=True)
        if turn == 4:
            rotated = {int(t) for job in request.plan.copies for t, s, d in zip(job.tokens, job.src, job.dst)
                       if s == d}
            assert {4, 5} <= rotated
        reply = agent.reply(turn) + (20 if left else 0)
        core.finish(request, reply, core.allocate(reply.size))
    core.flush()
    assert core.pool.n_free == core.pool.size


def test_a_request_holding_the_old_version_keeps_it() -> None:
    """While another request reads tokens 4, 5 at 4, 5, turn 3 copies them instead."""
    core = CacheCore(SlotPool(64))
    core.finish(core.admit(Conversation(MESSAGES, {}, ()).program(2), compact=True))
    reader = core.admit(Conversation(MESSAGES, {}, ()).program(3), compact=True)
    request = core.admit(Conversation(MESSAGES, {2: (1,)}, (2,)).program(3), compact=True)
    assert not _in_place(request.plan) and request.plan.fresh.size == 4
    core.finish(request)
    core.finish(reader)


def test_dropped_kv_gives_its_slots_to_later_turns() -> None:
    """Each turn of a cold request drops the turn before it: the request needs its live part at
    once, fewer slots than tokens; the same text without drops needs one slot per token."""
    turns = tuple((10 + i, 20 + i, 30 + i) for i in range(8))
    rolling = Conversation(turns, {a: (a - 1,) for a in range(2, 8)}, ())
    program = rolling.program(7)
    # step k reads messages k-1 and k (three tokens each) and message 0; dropped messages are dead
    assert cold_plan(program, compact=True).n_slots == 9 < program.n_tokens == 24
    assert cold_plan(program).n_slots == 24
    pool = SlotPool(10)
    core = CacheCore(pool)
    request = core.admit(program, compact=True)
    assert pool.n_free == 1
    core.finish(request)
    with pytest.raises(CacheFull):
        core.admit(Conversation(turns, {}, ()).program(7), compact=True)
    assert core.active == 0 and pool.n_protected == 0
    core.flush()
    assert pool.n_free == pool.size


BRUTE_POOL = 400
"""Slots of the pool the brute-force runs plan against."""


def _serve_alternately(first: Conversation, second: Conversation, check: Callable[[ContextProgram, RequestPlan], None],
                       left: bool = False, **kind: bool) -> None:
    """Every turn of two conversations, alternately and each turn twice (a retry), planned with
    ``kind`` and run on the brute-force KV: every read holds exactly the KV the query needs, writes go
    only to the request's own or taken slots, ``check`` sees each plan, and nothing leaks. With
    ``left`` each turn generates a reply that the next turn's text does not repeat."""
    kv = SimulatedKV()
    pool = SlotPool(BRUTE_POOL, on_free=kv.forget)
    core = CacheCore(pool)
    intern = Interner()
    order = [(c, t) for t in range(8) for c in (first, second) if t < c.n_turns for _ in range(2)]
    for conv, turn in order:
        program = conv.program(turn)
        request = core.admit(program, **kind)
        plan = request.plan
        taken = _in_place(plan)
        trace = kv.execute(plan, brute_layout(program, intern), pool, rewritable=taken)
        assert trace.written == set(plan.fresh.tolist()) | taken
        check(program, plan)
        reply = conv.reply(turn) + (10 if left else 0)
        slots = core.allocate(reply.size)
        kv.write_generated(slots, brute_layout(append_generated(program, reply), intern), program.n_tokens, pool)
        core.finish(request, reply, slots)
    core.flush()
    assert pool.n_free == pool.size and not kv.content


@settings(max_examples=100, deadline=None)
@given(conversations(max_messages=8), conversations(max_messages=8))
def test_compact_plans_read_what_the_brute_force_reads(first: Conversation, second: Conversation) -> None:
    """Every turn of two conversations (:func:`_serve_alternately`) through compact plans: their
    copies suit the kernel and they never hold more slots than the cold plan."""
    def check(program: ContextProgram, plan: RequestPlan) -> None:
        for job in plan.copies:
            assert_kernel_accepts(job, BRUTE_POOL)
        assert plan.fresh.size <= cold_plan(program).n_slots

    _serve_alternately(first, second, check, compact=True)


def _run_turn(model: ReferenceModel, core: CacheCore, kv: PagedKV, conv: Conversation, turn: int) -> set[int]:
    """Serve one turn through a compact plan, every computed query and decode step against the
    oracle; returns the slots it rotated in place."""
    program = conv.program(turn)
    request = core.admit(program, compact=True)
    logits = run_prefill(model, program, request.plan, kv)
    expected = run_program(model, program).log_probs()
    for t in np.flatnonzero(request.plan.computed).tolist():
        torch.testing.assert_close(torch.log_softmax(logits[t], -1), expected[t], atol=TOL, rtol=0)
    reply = conv.reply(turn)
    slots = core.allocate(reply.size)
    decoded = torch.log_softmax(run_decode(model, request.plan, kv, reply, slots), -1)
    extended = run_program(model, append_generated(program, reply)).log_probs()
    torch.testing.assert_close(decoded, extended[program.n_tokens :], atol=TOL, rtol=0)
    core.finish(request, reply, slots)
    return _in_place(request.plan)


def test_compact_turns_and_a_sibling_match_the_oracle(tiny_qwen3: ReferenceModel) -> None:
    """A rolling conversation longer than the pool (each turn drops the one before and repositions)
    served cold and turn by turn, then a sibling branch that reads the old positions, each query
    against the oracle; in-place rotation happened, and the pool is whole afterwards."""
    rng = np.random.default_rng(4)
    turns = tuple(tuple(rng.integers(0, 512, size=5).tolist()) for _ in range(9))
    rolling = Conversation(turns, {a: (a - 1,) for a in range(2, 9)}, tuple(range(2, 9)))
    pool_size = 32
    assert rolling.program(8).n_tokens > pool_size
    core = CacheCore(SlotPool(pool_size))
    kv = PagedKV.empty(tiny_qwen3, pool_size + 1)
    _run_turn(tiny_qwen3, core, kv, rolling, 8)  # cold: the whole text through a pool smaller than it
    core.flush()
    rotated = [_run_turn(tiny_qwen3, core, kv, rolling, turn) for turn in range(9)]
    assert all(rotated[2:]), "a turn copied what only it reads"
    sibling = Conversation(turns[:5] + tuple(tuple(rng.integers(0, 512, size=3).tolist()) for _ in range(2)),
                           {a: (a - 1,) for a in range(2, 5)}, tuple(range(2, 5)))
    for turn in (5, 6):
        _run_turn(tiny_qwen3, core, kv, sibling, turn)
    _run_turn(tiny_qwen3, core, kv, rolling, 8)
    assert core.active == 0 and core.pool.n_protected == 0
    core.flush()
    assert core.pool.n_free == pool_size


@settings(max_examples=100, deadline=None)
@given(conversations(max_messages=8), conversations(max_messages=8), st.booleans())
def test_in_place_plans_are_safe_in_one_forward(first: Conversation, second: Conversation, left: bool) -> None:
    """In-place plans (``in_place=True``, what the patched SGLang server runs: a request's segments
    in one forward, all their copies before any segment's attention), turn by turn
    (:func:`_serve_alternately`, replies continued or ``left``): each computed token keeps its own
    birth slot, and no segment reads a slot that a later segment rotates in place (in one forward it
    would read the rotated key)."""
    def check(program: ContextProgram, plan: RequestPlan) -> None:
        births = np.concatenate([s.slots for s in plan.segments]) if plan.segments else np.zeros(0, np.int64)
        assert births.size == np.unique(births).size == int(plan.computed.sum())
        read_before: set[int] = set()
        for segment in plan.segments:
            rotated = {int(d) for s, d in zip(segment.copies.src, segment.copies.dst) if s == d}
            assert not rotated & read_before, "an earlier segment of the forward reads a slot rotated in place"
            read_before |= set(segment.prefix_slots.tolist()) | set(segment.copies.src.tolist())

    _serve_alternately(first, second, check, left, in_place=True)


def test_an_in_place_plan_takes_no_copy_slot_and_keeps_its_births() -> None:
    """The hand-counted turn 3 of the first test, planned in place: the same two slots (message 3's
    births), tokens 4, 5 rotated where they are; a request that locked them first makes the draft
    contested (a later commit would raise), a draft planned after that copies them, and so does one
    planned once that reader has published its path."""
    pool = SlotPool(64)
    core = CacheCore(pool)
    core.finish(core.admit(Conversation(MESSAGES, {}, ()).program(2)))
    program = Conversation(MESSAGES, {2: (1,)}, (2,)).program(3)
    draft = core.match(program, in_place=True)
    assert draft.n_births == 2 and draft.n_copy_slots == 0
    assert sorted(draft.plan.taken.tolist()) == sorted(draft.match.slots[[4, 5], 0].tolist())
    assert core.match(program).n_copy_slots == 2, "without in_place: two copy slots"
    reader = core.admit(Conversation(MESSAGES, {}, ()).program(3))
    assert core.contested(draft)
    again = core.match(program, in_place=True)
    assert not core.contested(again) and again.plan.taken.size == 0 and again.n_copy_slots == 2
    core.finish(reader)
    free = pool.n_free
    request = core.admit(program, in_place=True)
    assert free - pool.n_free == 4 and not _in_place(request.plan), "the reader's published path reads 4, 5 at 4, 5"
    core.finish(request)


@pytest.mark.parametrize("pool_size", [64, 6])
def test_reserved_versions_are_resident_for_no_other_match(pool_size: int) -> None:
    """While a locked draft holds versions it will rotate in place (``reserve``), a plain match stops
    before them and a context match plans their tokens as recomputed; ``unreserve`` gives them back.
    With 6 slots the first turn fills the pool, so a reserved version sits in its highest slot."""
    from akv.system.cache import plain

    core = CacheCore(SlotPool(pool_size))
    first = Conversation(MESSAGES, {}, ()).program(2)
    core.finish(core.admit(first))
    assert pool_size > first.n_tokens or core.pool.n_free == 0
    draft = core.match(Conversation(MESSAGES, {2: (1,)}, (2,)).program(3), in_place=True)
    reader = Conversation(MESSAGES, {}, ()).program(3)
    assert plain.resident_prefix(core, first.token_ids, "").size == first.n_tokens
    assert not core.match(reader).plan.plan.computed[:first.n_tokens].any()
    assert pool_size > first.n_tokens or pool_size in draft.plan.taken
    core.reserve(draft.plan.taken)
    assert plain.resident_prefix(core, first.token_ids, "").size == 4  # tokens 4, 5 set aside
    assert core.match(reader).plan.plan.computed[[4, 5]].all()
    assert not np.isin(core.match(reader).plan.plan.borrowed, draft.plan.taken).any()
    core.unreserve(draft.plan.taken)
    assert plain.resident_prefix(core, first.token_ids, "").size == first.n_tokens


def _resident_labels(core: CacheCore, kv: SimulatedKV) -> dict[int, object]:
    return {int(s): kv.content.get(int(s)) for s in core.tree.resident_slots()}


def _assert_slots_accounted(core: CacheCore, kv: SimulatedKV) -> None:
    """Brute-force count: every slot is free, or held by the tree once per version it keeps, and none
    by a request; the pool's counters agree."""
    pool = core.pool
    versions = np.bincount(core.tree.resident_slots(), minlength=pool.size + 1)[1:]
    held = pool.refcount(np.arange(1, pool.size + 1))
    assert (held == versions).all() and (pool.request_refs(np.arange(1, pool.size + 1)) == 0).all()
    assert pool.n_free == int((versions == 0).sum()) and pool.n_protected == 0
    assert pool.n_evictable == int((versions > 0).sum())
    assert set(kv.content) == set(np.flatnonzero(versions) + 1), "a freed slot kept its KV or a held one lost it"


@settings(max_examples=100, deadline=None)
@given(conversations(max_messages=8), conversations(max_messages=8), st.data())
def test_an_aborted_in_place_request_loses_only_what_it_rotated(first: Conversation, second: Conversation,
                                                                data: st.DataObject) -> None:
    """In-place plans, turn by turn over two conversations, some turns aborted after their plan ran
    (a client that disconnects mid-prefill or mid-decode; or before it ran): the abort frees every
    slot the request allocated and the versions it took from the tree to rotate in place (their KV
    was overwritten at the new positions, so the tree cannot keep them); every other version the
    tree held stays, with its KV, and no request reference or reservation is left. Later turns read,
    on the brute-force KV, exactly what their queries need (nothing reads a taken version at its old
    position), and the pool is whole at the end."""
    kv = SimulatedKV()
    free = ArrayFreeList(BRUTE_POOL)
    pool = SlotPool(BRUTE_POOL, on_free=kv.forget, free_list=free)
    core = CacheCore(pool)
    intern = Interner()
    order = [(c, t) for t in range(8) for c in (first, second) if t < c.n_turns for _ in range(2)]
    for conv, turn in order:
        program = conv.program(turn)
        draft = core.match(program, in_place=True)
        before = _resident_labels(core, kv)
        request = core.commit(draft)
        taken = set(draft.plan.taken.tolist())
        ran = data.draw(st.booleans())
        computed = np.flatnonzero(request.plan.computed)
        core.bind_births(request, computed, free.take(computed.size))  # the engine's allocator
        plan = request.resolved_plan()
        if ran:
            kv.execute(plan, brute_layout(program, intern), pool, rewritable=_in_place(plan))
        if data.draw(st.booleans()):
            core.abort(request)
            assert _resident_labels(core, kv) == {s: v for s, v in before.items() if s not in taken}
            _assert_slots_accounted(core, kv)
            continue
        if not ran:
            kv.execute(plan, brute_layout(program, intern), pool, rewritable=_in_place(plan))
        reply = conv.reply(turn)
        slots = core.allocate(reply.size)
        kv.write_generated(slots, brute_layout(append_generated(program, reply), intern), program.n_tokens, pool)
        core.finish(request, reply, slots)
        _assert_slots_accounted(core, kv)
    core.flush()
    assert pool.n_free == pool.size and not kv.content
