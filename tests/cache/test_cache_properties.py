"""Random request sequences through the cache core, checked against a brute force that recomputes
everything: every slot a plan reads holds exactly the KV (history and rotation) the query needs,
nothing is freed while referenced, usage counters equal their definitions, no slot leaks."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.core import ActiveRequest, CacheCore, CacheFull
from akv.system.cache.plan import RequestPlan
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import append_generated

from .brute import BruteLayout, Interner, SimulatedKV, Trace, brute_layout
from .conversations import Conversation, conversations
from .kernel_contract import assert_kernel_accepts


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Conversation], list[tuple[str, int, int]], int]:
    """Conversations (a base and its branches) walked turn by turn in an interleaved order, with
    retries, jumps to a conversation's last turn (long cold or partly cached requests), requests held
    open across others, and evictions at random points."""
    base = draw(conversations())
    convs = [base] + [draw(conversations(prefix=base)) for _ in range(draw(st.integers(1, 2)))]
    turns = draw(st.permutations([i for i, c in enumerate(convs) for _ in range(c.n_turns)]))
    ops: list[tuple[str, int, int]] = []
    for i in turns:
        ops.append(("next", i, draw(st.sampled_from([1, 1, 1, 0]))))
        extra = draw(st.sampled_from(["none", "none", "retry", "jump", "finish", "evict"]))
        if extra in ("retry", "jump"):
            ops.append((extra, i, draw(st.integers(0, 1))))
        elif extra == "finish":
            ops.append(("finish", draw(st.integers(0, 3)), draw(st.integers(0, 1))))
        elif extra == "evict":
            ops.append(("evict", draw(st.integers(1, 40)), 0))
    pool_size = draw(st.sampled_from([30, 60, 400]))
    return convs, ops, pool_size


def _check_usage(plan: RequestPlan, trace: Trace, brute: BruteLayout, n_prompt: int) -> None:
    prompt = range(n_prompt)
    reused = [s for s in prompt if s not in trace.computed and s in trace.read_from]
    rerotated = [s for s in reused if trace.read_from[s] & trace.written]
    skipped = [s for s in prompt if s not in trace.computed and s not in trace.read_from]
    assert all(s not in brute.terminal for s in skipped), "an unread token is still visible"
    dropped = [s for s in prompt if s not in brute.terminal]
    assert plan.usage.cached_tokens == len(reused) - len(rerotated)
    assert plan.usage.repos_tokens == len(rerotated)
    assert plan.usage.drop_skipped_tokens == len(dropped), "every dropped prompt token counts, computed or not"
    assert plan.usage.computed_tokens == sum(1 for s in prompt if s in trace.computed)


def _check_held(active: list[tuple[ActiveRequest, Conversation, int, BruteLayout]], pool: SlotPool, kv: SimulatedKV) -> None:
    for request, *_ in active:
        held = np.concatenate([request.plan.borrowed, request.plan.fresh])
        assert (pool.refcount(held) > 0).all()
        assert all(s in kv.content for s in held.tolist())


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_random_request_sequences_match_brute_force(scenario: tuple[list[Conversation], list[tuple[str, int, int]], int]) -> None:
    convs, ops, pool_size = scenario
    kv = SimulatedKV()
    pool = SlotPool(pool_size, on_free=kv.forget)
    core = CacheCore(pool)
    intern = Interner()
    active: list[tuple[ActiveRequest, Conversation, int, BruteLayout]] = []

    def finish(index: int, with_reply: bool) -> None:
        request, conv, turn, brute = active.pop(index)
        if not with_reply:
            core.finish(request)
            return
        reply = conv.reply(turn)
        try:
            slots = core.allocate(reply.size)
        except CacheFull:
            core.finish(request)
            return
        extended = brute_layout(append_generated(request.program, reply), intern)
        kv.write_generated(slots, extended, request.program.n_tokens, pool)
        core.finish(request, reply, slots)

    cursor = [-1] * len(convs)
    for kind, a, b in ops:
        if kind in ("next", "retry", "jump"):
            conv = convs[a]
            cursor[a] = min(cursor[a] + (kind == "next"), conv.n_turns - 1)
            turn = conv.n_turns - 1 if kind == "jump" else max(cursor[a], 0)
            program = conv.program(turn)
            try:
                request = core.admit(program)
            except CacheFull:
                continue
            brute = brute_layout(program, intern)
            plan = request.plan
            match = plan.match
            cut = min(match.n_tokens, program.n_tokens - 1)
            assert not (plan.computed[:cut] & match.resident[:cut]).any(), "recomputed resident KV"
            trace = kv.execute(plan, brute, pool)
            for job in plan.copies:
                assert_kernel_accepts(job, pool.size)
            assert trace.written == set(plan.fresh.tolist())
            assert trace.computed == set(np.flatnonzero(plan.computed).tolist())
            _check_usage(plan, trace, brute, program.n_prompt)
            active.append((request, conv, turn, brute))
            if b:
                finish(len(active) - 1, True)
        elif kind == "finish" and active:
            finish(a % len(active), bool(b))
        elif kind == "evict":
            core.tree.evict(a)
        _check_held(active, pool, kv)
    while active:
        finish(0, True)
    core.flush()
    assert pool.n_free == pool.size
    assert not kv.content


@settings(max_examples=150, deadline=None)
@given(conversations(max_messages=10), st.integers(0, 30), st.data())
def test_cold_requests_then_branches_through_holes(conv: Conversation, evict: int, data: st.DataObject) -> None:
    """A long history computed in one request (many stages, copies recycled within it), the same
    request again after evicting part of what it published, then a branch that diverges before
    some of its drops and must recover the dropped KV around resident gaps."""
    kv = SimulatedKV()
    pool = SlotPool(400, on_free=kv.forget)
    core = CacheCore(pool)
    intern = Interner()
    anchor = data.draw(st.integers(0, conv.n_turns - 1))
    turn = data.draw(st.integers(anchor, conv.n_turns - 1))
    last = conv.n_turns - 1
    for program in (conv.program(last), conv.program(last), conv.without_ops_from(anchor).program(turn)):
        request = core.admit(program)
        plan = request.plan
        assert plan.fresh.size <= sum(s.n_queries for s in plan.segments) + sum(c.size for c in plan.copies)
        brute = brute_layout(program, intern)
        trace = kv.execute(plan, brute, pool)
        for job in plan.copies:
            assert_kernel_accepts(job, pool.size)
        _check_usage(plan, trace, brute, program.n_prompt)
        core.finish(request)
        core.tree.evict(evict)
    core.flush()
    assert pool.n_free == pool.size and not kv.content
