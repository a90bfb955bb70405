"""What :func:`akv.system.adapter.scheduling.attach` promises a context request (issues #28, #30): it
is refused only when the slots it holds at once (a brute force over its events: each round's births
and the earlier births a later round still reads, the rest given back) and SGLang's 2 admission slots
exceed the pool, never for its text or its re-rotation copies; its new tokens are clipped to what
that count leaves. The plan the server then executes
(:meth:`akv.system.adapter.context_request.AkvRequest.plan_draft` with that room), its births
allocated round by round and given back once no later round reads them, holds no more than the room
on any tree state, so a request alone on the server is always admitted, and it reads exactly the KV
the brute force names (never a slot given back)."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.scheduling import attach, cap_extend
from akv.system.cache.core import CacheCore
from akv.system.cache.occurrence import cold_plan
from akv.system.cache.pool import SlotPool
from akv.system.context.wire import encode_program
from akv.system.context.program import ContextProgram
from tests.cache.brute import Interner, SimulatedKV, Trace, brute_layout, brute_needed, brute_reads
from tests.cache.conversations import conversations

SERVER = SimpleNamespace(radix_cache_backend="akv", chunked_prefill_size=64, disaggregation_mode="null")
SLACK = 2  # SGLang's admission: one page, and a strict bound


def _attach(program, wanted: int | None, pool: int) -> tuple[str | None, SimpleNamespace]:
    req = SimpleNamespace(origin_input_ids=program.token_ids.tolist(), extra_key=None, akv=None,
                          sampling_params=SimpleNamespace(max_new_tokens=wanted))
    return attach(req, SimpleNamespace(context_program=encode_program(program)), SERVER, pool_size=pool), req


def brute_held(program: ContextProgram) -> int:
    """The most slots an empty cache holds at once for ``program`` when every segment of the cold
    plan is its own round: per round, the tokens it computes and those computed earlier that a
    query of this or a later round, or generation, reads; from the events alone (the rounds' bounds
    are the plan's segments)."""
    n = program.n_tokens
    reads, hidden = brute_reads(program)
    last = {s: n for s in range(n) if s not in hidden}  # generation reads it
    last[n - 1] = n
    for t in range(n - 1, -1, -1):
        if t in last:
            for s in reads[t]:
                last[s] = max(last.get(s, t), t)
    spans = [(s.start, s.end) for s in cold_plan(program, births_in_place=True).plan.segments]
    return max((sum(1 for t, end in last.items() if t < b and (t >= a or end >= a)) for a, b in spans), default=0)


@settings(max_examples=150, deadline=None)
@given(conversations(max_messages=8), st.integers(0, 12), st.one_of(st.none(), st.integers(0, 12)))
def test_attach_refuses_and_clips_by_the_slots_held_at_once(conv, spare: int, wanted: int | None) -> None:
    """Every turn: refused exactly when its brute-force count and the slack exceed the pool; else
    granted ``min(wanted, pool - count - slack)`` new tokens. That count is never more than the tokens
    an empty cache computes (the cold plan with its births rotated in place takes no copy slot)."""
    for turn in range(conv.n_turns):
        program = conv.program(turn)
        need = brute_held(program)
        assert need <= brute_needed(program) == cold_plan(program, births_in_place=True).n_slots
        error, _ = _attach(program, wanted, need + SLACK - 1)
        assert error is not None and error.startswith(f"messages: the prompt needs {need} KV slots at once")
        assert error.endswith(f"more than the {need + SLACK - 1} this server holds")
        error, req = _attach(program, wanted, need + SLACK + spare)
        assert error is None, error
        assert req.sampling_params.max_new_tokens == (spare if wanted is None else min(wanted, spare))


def _rounds(state: AkvRequest, n_tokens: int) -> list[list[int]]:
    """The segments (indices) of each prefill round the scheduler's hook cuts, chunk budget unlimited."""
    segments = state.plan_draft_segments()
    req = SimpleNamespace(akv=state, full_untruncated_fill_ids=[0] * n_tokens)
    req.set_extend_range = lambda lo, hi: setattr(req, "extend_range", SimpleNamespace(start=lo, end=hi))
    rounds, i = [], 0
    while i < len(segments):
        req.set_extend_range(segments[i].start, n_tokens)
        cap_extend(req)
        j = i
        while j < len(segments) and segments[j].start < req.extend_range.end:
            j += 1
        assert segments[j - 1].end == req.extend_range.end, "a round ends at a segment's end"
        rounds.append(list(range(i, j)))
        i = j
    return rounds


def _serve_in_rounds(kv: SimulatedKV, state: AkvRequest, core: CacheCore, rounds: list[list[int]], brute,
                     pool: SlotPool, abort_at: int | None = None) -> int | None:
    """Commit ``state`` and run its plan on the brute-force KV as the patched server does: before each
    round, the births no later round reads go back to the pool (the scheduler's stash hook); the
    round's births are allocated and bound, then (per layer, one forward) every segment's new KV
    written, then every copy, then each segment's attention, asserting every read. Returns the most
    slots requests held at once (the pool's own count, read after each round's allocation); None when
    it stopped before round ``abort_at`` (the caller aborts it)."""
    state.commit(core)
    plan = state.active.plan
    private = set(plan.fresh.tolist()) | {int(d) for j in plan.copies for s, d in zip(j.src, j.dst) if s == d}
    trace, held = Trace(), pool.n_protected
    for k, indices in enumerate(rounds):
        if k == abort_at:
            return None
        segments = [plan.segments[i] for i in indices]
        lo, hi = segments[0].start, segments[-1].end
        state.free_dead(core, lo)
        if hi - lo > pool.n_free:  # SGLang's allocator: evict the tree, then take unheld slots
            core.tree.evict(hi - lo - pool.n_free)
        births = pool._free_list.take(hi - lo)
        assert births is not None, f"round [{lo}, {hi}) finds {pool.n_free} free slots"
        state.bind(core, lo, births)
        held = max(held, pool.n_protected)
        private |= set(births.tolist())
        for segment in segments:
            for i, q in enumerate(range(segment.start, segment.end)):
                kv._write(int(state.resolve(segment.slots)[i]), (brute.names[q], brute.birth[q]), pool, trace, private)
        for segment in segments:
            kv._copy(state._real(segment.copies), brute, pool, trace, private)
        for segment in segments:
            prefix, own = state.resolve(segment.prefix_slots).tolist(), state.resolve(segment.slots).tolist()
            for i, q in enumerate(range(segment.start, segment.end)):
                row = prefix + own[: i + 1]
                labels = {kv._read(slot, pool) for slot in row}
                assert len(labels) == len(row) and labels == brute.reads[q], f"query {q} of a round reads {labels}"
    tokens, slots, copies = state.terminal()
    if copies is not None:
        kv._copy(copies, brute, pool, trace, private)
    labels = [kv._read(slot, pool) for slot in slots.tolist()]
    assert dict(zip(tokens.tolist(), labels)) == brute.terminal
    return held


@st.composite
def served_turns(draw: st.DrawFn) -> tuple[list, list[tuple[int, int]], int]:
    """Two conversations (the second a branch of the first) turn by turn in a random order, each turn
    asking for a few new tokens, some aborted after a few rounds, and followed by a random eviction,
    and a pool from the smallest turn's count held at once to a little above the most tokens a turn
    computes (so some turns are refused, some recycle their births)."""
    convs = [draw(conversations(max_messages=8))]
    convs.append(draw(conversations(max_messages=8, prefix=convs[0])))
    order = draw(st.permutations([(i, t) for i, c in enumerate(convs) for t in range(c.n_turns)]))
    programs = [convs[i].program(t) for i, t in order]
    pool = draw(st.integers(min(brute_held(p) for p in programs), max(brute_needed(p) for p in programs) + 8))
    aborts = st.one_of(st.none(), st.integers(0, 3))
    return [(convs[i], t, draw(st.integers(0, 6)), draw(st.integers(0, 5)), draw(aborts)) for i, t in order], pool


@settings(max_examples=200, deadline=None)
@given(served_turns())
def test_a_request_alone_on_the_server_always_fits_what_attach_promised(case) -> None:
    """Turns served one at a time on a pool shared with the tree (finished turns published, random
    evictions): each turn attach accepts is planned with the room its clipped new tokens leave; its
    commit and births never run out of slots (the tree is evicted for them), its new tokens fit after,
    the slots it holds at once (the pool's count of slots requests reference) stay within the room,
    and it copies or recycles births only where the one-forward plan would not fit. Run round by round as
    the scheduler's hook cuts them, each round one forward (its births, then its copies, then its
    attention), every read holds the KV the brute force names: a birth is re-rotated in place only in
    a later forward than every segment that reads it at its old position."""
    turns, size = case
    kv = SimulatedKV()
    pool = SlotPool(size, on_free=kv.forget)
    core = CacheCore(pool)
    intern = Interner()
    for conv, turn, wanted, evict, abort_at in turns:
        program = conv.program(turn)
        error, req = _attach(program, wanted, size)
        if error is not None:
            assert brute_needed(program) + SLACK > size
            continue
        granted = req.sampling_params.max_new_tokens
        room = size - granted - SLACK
        state = req.akv
        draft = state.plan_draft(core, room=room)
        one_forward = core.match(program, in_place=True)
        rounds = _rounds(state, program.n_tokens)
        held = _serve_in_rounds(kv, state, core, rounds, brute_layout(program, intern), pool, abort_at)
        if held is None:  # aborted mid-prefill: nothing stays held but the tree's (later turns read it)
            state.release(core, publish=False)
            assert pool.n_protected == 0 and pool.n_free + pool.n_evictable == pool.size
            continue
        assert held <= room, (held, room)
        new_slots = core.allocate(granted)  # decode's slots: the pool leaves them
        pool.decref(new_slots)
        one = one_forward.plan.n_births + one_forward.n_copy_slots + pool.n_distinct(one_forward.plan.plan.borrowed)
        if one <= room:
            assert draft.n_copy_slots == one_forward.n_copy_slots, "births rotated in place although copies fit"
            assert state.lifetimes is None, "births recycled although they fit"
        state.release(core, publish=True)
        assert pool.n_protected == 0
        core.tree.evict(evict)
    core.flush()
    assert pool.n_free == pool.size and not kv.content
