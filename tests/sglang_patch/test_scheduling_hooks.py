"""The scheduler-side hooks (``akv.system.adapter.scheduling``) on stand-in requests: which context
requests are refused up front with a 400 message naming the field, and where rounds stop (before
reused columns, not at segment ends). (SGLang's real scheduler drives the same hooks in tests/sglang_cpu.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from akv.system.adapter.context_request import AkvRequest
from akv.system.adapter.scheduling import attach, cap_extend, extra_budget, hold_rounds, must_wait
from akv.system.cache.core import CacheCore, CacheFull
from akv.system.cache.keys import program_key
from akv.system.cache.pool import ArrayFreeList, SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules
from akv.system.context.wire import encode_program
from tests.cache.brute import brute_needed
from tests.sglang_patch.test_admission_slots import brute_held
from tests.sglang_cpu.scenarios import Conversation

SERVER = SimpleNamespace(radix_cache_backend="akv", chunked_prefill_size=64, disaggregation_mode="null")


def program(lengths: list[int], drop: dict | None = None, repos: list[int] | None = None):
    ids = np.arange(sum(lengths), dtype=np.int64) % 97
    owners = np.repeat(np.arange(len(lengths)), lengths)
    n = len(lengths) - 1
    return compile_program(ids, owners, parse_rules(drop, repos, n), n)


def request(prog, wanted: int | None = 4) -> tuple[SimpleNamespace, SimpleNamespace]:
    req = SimpleNamespace(origin_input_ids=prog.token_ids.tolist(), extra_key=None, akv=None,
                          sampling_params=SimpleNamespace(max_new_tokens=wanted))
    return req, SimpleNamespace(context_program=encode_program(prog))


def test_a_servable_program_is_attached() -> None:
    prog = program([5, 6, 7, 2], {"2": [1]}, [2])
    req, recv = request(prog)
    assert attach(req, recv, SERVER, pool_size=1000) is None
    assert isinstance(req.akv, AkvRequest) and req.akv.program.n_tokens == prog.n_tokens


def test_a_plain_request_is_left_alone() -> None:
    req = SimpleNamespace(akv=None)
    assert attach(req, SimpleNamespace(context_program=None), SERVER, pool_size=10) is None and req.akv is None


@pytest.mark.parametrize(
    ("server", "mangle", "message"),
    [
        (SimpleNamespace(radix_cache_backend=None, chunked_prefill_size=64, disaggregation_mode="null"), None,
         "server configuration: radix_cache_backend None cannot execute"),
        (SimpleNamespace(radix_cache_backend="akv", chunked_prefill_size=-1, disaggregation_mode="null"), None,
         "need chunked prefill"),
        (SERVER, lambda b: b[:-1] + bytes([b[-1] ^ 1]), "context_program: digest"),
        (SERVER, "tokens", "context_program: its tokens differ"),
    ],
)
def test_unservable_requests_are_refused(server, mangle, message) -> None:
    req, recv = request(program([5, 6, 2], {"1": [0]}))
    if mangle == "tokens":
        req.origin_input_ids = req.origin_input_ids[::-1]
    elif mangle is not None:
        recv.context_program = mangle(recv.context_program)
    error = attach(req, recv, server, pool_size=1000)
    assert error is not None and message in error and req.akv is None


def test_kv_that_can_never_fit_is_refused_with_the_exact_count_of_what_it_holds_at_once() -> None:
    """A reposition after a drop re-rotates what follows the gap: births plus copies exceed the pool
    although the prompt alone fits. Such a request is served with its births re-rotated in place and
    the dropped message's births given back once nothing reads them, so the limit is the count of
    slots it holds at once (brute force: fewer than the tokens an empty cache computes) and the 2
    slots SGLang's admission adds (one page, and a strict bound), not its copies (issues #28, #30)."""
    prog = program([30, 30, 30, 2], {"2": [0]}, [2])
    need = brute_held(prog)
    assert need < brute_needed(prog), "the case in point: the dropped message's births are given back"
    assert CacheCore(SlotPool(1000)).admit(prog).plan.fresh.size > need + 2, "the case in point: copies do not fit"
    req, recv = request(prog)
    error = attach(req, recv, SERVER, pool_size=need + 1)
    assert error == (f"messages: the prompt needs {need} KV slots at once (the tokens later ones read while a round "
                     f"is computed, re-rotated in place, and 2 for admission), more than the {need + 1} this server "
                     "holds")
    req, recv = request(prog)
    assert attach(req, recv, SERVER, pool_size=need + 2) is None


def test_contiguous_segments_run_in_one_round() -> None:
    """A cold turn whose drop and reposition cut it into two segments: one round (one forward) covers
    both, and it joins a batch only where the chunk budget left holds all of its columns."""
    prog = program([4, 4, 4, 2], {"2": [0]}, [2])
    req, recv = request(prog)
    attach(req, recv, SERVER, pool_size=1000)
    state = req.akv
    state.plan_draft(CacheCore(SlotPool(1000)))
    assert len(state.plan_draft_segments()) == 2
    _fill(req, prog, 0)
    assert not cap_extend(req) and req.extend_range.end == prog.n_tokens
    assert not must_wait(SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=prog.n_tokens), req,
                         has_chunked_req=True)
    assert must_wait(SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=prog.n_tokens - 1), req,
                     has_chunked_req=True)


def _fill(req: SimpleNamespace, prog, start: int) -> None:
    req.full_untruncated_fill_ids = list(prog.token_ids)
    req.prefix_indices = np.zeros(start, dtype=np.int64)
    req.set_extend_range = lambda lo, hi: setattr(req, "extend_range", SimpleNamespace(start=lo, end=hi))
    req.set_extend_range(start, prog.n_tokens)


def _evicted_turn() -> tuple[CacheCore, object]:
    """A conversation's fourth turn after the tree evicted part of its history: its plan recomputes the
    evicted columns, reuses resident ones after them, then computes its new messages (three segments)."""
    conv = Conversation(108).add(8, 8, 8, 5).reposition()
    turns = [conv.request("t0").program]
    conv.add(7, 8).reposition()
    turns.append(conv.request("t1").program)
    conv.add(7, 6).drop(0)
    turns.append(conv.request("t2").program)
    conv.add(4, 9).drop(2).reposition()
    last = conv.request("t3").program
    core = CacheCore(SlotPool(1000))
    for prog in turns:
        core.finish(core.admit(prog))
    for _ in range(2):  # the turn waits while the tree evicts: each draft refreshes the KV it borrows
        core.match(last)
        core.tree.evict(7)
    return core, last


def test_rounds_stop_before_reused_columns_and_continue_beside_the_chunked_slot() -> None:
    core, prog = _evicted_turn()
    req, recv = request(prog)
    attach(req, recv, SERVER, pool_size=1000)
    state = req.akv
    state.plan_draft(core)
    segments = state.plan_draft_segments()
    gap = next(i for i in range(len(segments) - 1) if segments[i].end < segments[i + 1].start)
    assert gap + 2 < len(segments), "the case in point: reused columns, then more than one segment"
    _fill(req, prog, segments[0].start)
    assert cap_extend(req) and req.extend_range.end == segments[gap].end
    first = segments[gap].end - segments[0].start
    idle = SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=64, akv_new_rounds=[])
    assert not must_wait(idle, req, has_chunked_req=False)
    hold_rounds(idle, req, has_chunked_req=False)
    assert idle.new_chunked_req is req and idle.akv_new_rounds == []  # the free slot takes it
    taken = SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=first, akv_new_rounds=[])
    assert not must_wait(taken, req, has_chunked_req=True)  # its first round fits: it joins
    hold_rounds(taken, req, has_chunked_req=True)
    assert taken.new_chunked_req is None and taken.akv_new_rounds == [req]  # and continues beside the slot
    assert must_wait(SimpleNamespace(new_chunked_req=None, can_run_list=[], rem_chunk_tokens=first - 1), req,
                     has_chunked_req=True)  # its first round does not fit what is left
    short = SimpleNamespace(akv=None, full_untruncated_fill_ids=[1] * 8, prefix_indices=[])
    with_context = SimpleNamespace(new_chunked_req=req, can_run_list=[req], rem_chunk_tokens=64)
    assert not must_wait(with_context, short, has_chunked_req=False)  # its whole prefill fits: it joins
    assert must_wait(SimpleNamespace(new_chunked_req=req, can_run_list=[req], rem_chunk_tokens=4), short,
                     has_chunked_req=False)  # SGLang would have to chunk it: it waits
    plain_chunked = SimpleNamespace(akv=None)
    assert not must_wait(SimpleNamespace(new_chunked_req=None, can_run_list=[plain_chunked], rem_chunk_tokens=4),
                         short, has_chunked_req=True)  # plain traffic keeps SGLang's own path


def test_max_new_tokens_is_clipped_so_an_idle_server_admits_the_request() -> None:
    """SGLang's admission needs the slots a request takes + new tokens + one page strictly below the
    pool; on an idle server that is what it holds at once (its births re-rotated in place, and given
    back once nothing reads them) where all its births and copies would not fit: a request asking for
    more new tokens than that leaves gets fewer (as SGLang clips a plain prompt's); otherwise it would
    wait forever, and every request queued behind it."""
    prog = program([30, 30, 30, 2], {"2": [0]}, [2])
    need = brute_held(prog)  # what a cold admission with births re-rotated in place and recycled holds
    for wanted, pool, granted in [(10, need + 2 + 3, 3), (3, need + 2 + 3, 3), (2, need + 2 + 3, 2),
                                  (None, need + 2 + 3, 3), (10, need + 2, 0), (10, 1000, 10)]:
        req, recv = request(prog, wanted)
        assert attach(req, recv, SERVER, pool_size=pool) is None
        assert req.sampling_params.max_new_tokens == granted, (wanted, pool)


def test_admission_counts_the_slots_a_request_takes_not_the_columns_it_borrows() -> None:
    """A turn whose first segment recomputes evicted KV while later columns borrow resident versions:
    SGLang counts every column after the matched prefix, and the lock holds the borrowed slots too, so
    without the correction a request that fits would be counted twice over what it borrows (and on an
    idle server could wait forever). Admission's count equals the fresh slots the cache core takes."""
    core, last = _evicted_turn()
    req, recv = request(last)
    attach(req, recv, SERVER, pool_size=1000)
    draft = req.akv.plan_draft(core)
    req.full_untruncated_fill_ids = list(last.token_ids)
    req.prefix_indices = np.zeros(req.akv.first_start, dtype=np.int64)
    columns = last.n_tokens - req.akv.first_start
    assert draft.plan.n_births < columns and draft.plan.plan.borrowed.size > 0  # it borrows after its first segment
    taken = core.admit(last).plan.fresh.size
    assert columns + extra_budget(req) == taken


def test_a_draft_that_would_hold_more_than_the_room_left_rotates_its_births_in_place() -> None:
    """A warm draft can hold more slots than the cold plan (a borrowed version held to the end where
    the cold plan's copy slot is recycled). With less room than it holds, the draft is planned again
    with its own births re-rotated in place (it keeps what it reuses); with less room than that, cold
    with births in place: the tokens an empty cache computes (brute force), the room that the clipped
    new tokens always leave (:func:`attach`). With room for it, the draft stays the one-forward plan."""
    conv = Conversation(140).add(8, 8)
    turns = []
    for lengths, drop, repos in [((7, 8), 0, True), ((9, 6), None, False), ((8, 4), 2, False), ((8, 4), 4, True),
                                 ((7, 7), 1, True)]:
        conv.add(*lengths)
        if drop is not None:
            conv.drop(drop)
        if repos:
            conv.reposition()
        turns.append(conv.request(f"t{len(turns)}").program)
    last = turns.pop()
    core = CacheCore(SlotPool(1000))
    for prog in turns:
        core.finish(core.admit(prog))
    for n in (3, 5, 7, 10, 15):  # the turn waits while the tree evicts
        core.match(last)
        core.tree.evict(n)
    cold = CacheCore(SlotPool(1000)).admit(last).plan.fresh.size
    least = brute_needed(last)

    def holds(draft) -> int:
        return draft.plan.n_births + draft.n_copy_slots + np.unique(draft.plan.plan.borrowed).size

    warm = core.match(last, in_place=True)
    assert holds(warm) > cold > least  # the case in point
    roomy = AkvRequest(last).plan_draft(core, room=holds(warm))
    assert holds(roomy) == holds(warm) and roomy.n_copy_slots == warm.n_copy_slots
    for room in (cold, least):
        draft = AkvRequest(last).plan_draft(core, room=room)
        assert holds(draft) <= room and draft.n_copy_slots < warm.n_copy_slots
    kept = AkvRequest(last).plan_draft(core, room=cold)
    assert kept.plan.plan.usage.cached_tokens == warm.plan.plan.usage.cached_tokens > 0  # reuse kept
    tight = AkvRequest(last).plan_draft(core, room=least)
    assert holds(tight) == least and tight.n_copy_slots == 0


def test_a_round_stops_before_a_segment_whose_copies_reuse_a_slot_the_round_reads() -> None:
    """The plan recycles a copy slot once its last reader ran; in one forward every copy runs before
    attention, so the segment that writes such a slot again starts the next round."""
    conv = Conversation(70).add(12, 12)
    for t in range(4):
        conv.add(12, 12).drop(2 * t)
        if t % 2 == 1:
            conv.reposition()
    prog = conv.request("recycling").program
    req, recv = request(prog)
    attach(req, recv, SERVER, pool_size=1000)
    req.akv.plan_draft(CacheCore(SlotPool(1000)))
    segments = req.akv.plan_draft_segments()
    assert all(a.end == b.start for a, b in zip(segments, segments[1:])), "contiguous (cold)"
    last = segments[-1]
    read_before = np.concatenate([s.prefix_slots for s in segments[:-1]])
    assert np.isin(last.copies.dst, read_before).any(), "the case in point: the last segment recycles a copy slot"
    _fill(req, prog, 0)
    assert cap_extend(req) and req.extend_range.end == last.start


def _in_place_turn(pool_size: int = 1000, free_list: ArrayFreeList | None = None) -> tuple[CacheCore, object, object]:
    """A first turn in the tree and the next turn over exactly its text that drops message 1 and
    repositions what follows (resident KV nothing else reads), and a sibling that reads it unmoved."""
    conv = Conversation(150).add(6, 9, 7, 8)
    first = conv.request("first", max_new=1)
    turn, sibling = conv.copy(), conv.copy()
    for c in (turn, sibling):
        c.messages.append(list(first.ids[-3:]))
    core = CacheCore(SlotPool(pool_size, free_list=free_list))
    core.finish(core.admit(first.program))
    return core, turn.drop(1).reposition().add(5).request("turn").program, sibling.add(4).request("sibling").program


@pytest.mark.parametrize("order", ["sibling locks first", "sibling planned after the lock",
                                   "sibling planned before the lock, locked after", "plain pin before the commit"])
def test_versions_a_request_rotates_in_place_are_read_by_no_one_else(order: str) -> None:
    """The turn's draft rotates 18 resident tokens in place and takes no copy slot; a sibling reads
    them at their old positions. A sibling locked first makes the turn copy them (planned again at its
    lock). Once the turn is locked they are set aside: a sibling planned then, or planned before and
    locked after, recomputes them instead, and the turn rotates them in place. A reference taken
    between lock and commit outside the drafts (a plain request's lock) makes the commit plan again
    and copy. Nothing raises, and releasing everything frees every slot."""
    core, turn_program, sibling_program = _in_place_turn()
    turn, sibling = AkvRequest(turn_program), AkvRequest(sibling_program)
    draft = turn.plan_draft(core)
    taken = draft.plan.taken
    assert draft.n_copy_slots == 0 and taken.size == 18
    pins = []
    if order == "sibling locks first":
        sibling.lock(core)
        turn.lock(core)
    elif order == "sibling planned after the lock":
        turn.lock(core)
        sibling.lock(core)
    elif order == "sibling planned before the lock, locked after":
        sibling.plan_draft(core)
        turn.lock(core)
        sibling.lock(core)
    else:
        turn.lock(core)
        pins = taken
        core.pool.incref(pins)
    turn.commit(core)
    if order != "plain pin before the commit":
        sibling.commit(core)
    copies = [job for job in turn.active.plan.copies if job.size]
    in_place = sum(int((job.src == job.dst).sum()) for job in copies)
    moved = sum(job.size for job in copies)
    if order in ("sibling locks first", "plain pin before the commit"):
        assert moved == 18 and in_place == 0
    else:
        assert moved == in_place == 18
        assert not np.isin(sibling.active.plan.borrowed, taken).any()
        assert sibling.active.plan.computed.sum() == 18 + 4 + 3  # the moved tokens, its message, gen prompt
    core.pool.decref(pins)
    for state in (turn, sibling):
        state.release(core, publish=False)
    _slots_accounted(core, [turn_program, sibling_program])
    core.flush()
    assert core.pool.n_free == core.pool.size


def _slots_accounted(core: CacheCore, programs: list) -> None:
    """Brute-force count: no request reference, every slot free or held once per tree version, the
    pool's counters agree, and nothing is set aside (``programs`` match every version they did)."""
    pool, every = core.pool, np.arange(1, core.pool.size + 1)
    versions = np.bincount(core.tree.resident_slots(), minlength=pool.size + 1)[1:]
    assert (pool.request_refs(every) == 0).all() and (pool.refcount(every) == versions).all()
    assert pool.n_free == int((versions == 0).sum()) and pool.n_protected == 0
    for prog in programs:
        key = program_key(prog, "")
        assert np.array_equal(core.resident(key).slots, core.tree.match(key).slots), "a reservation was left"


def test_a_contested_commit_on_a_full_pool_holds_nothing_and_commits_once_there_is_room() -> None:
    """A reference taken on a version the locked turn rotates in place (a reader matched before the
    lock) sends its commit to copies that admission never charged; on a pool that cannot hold them
    the commit raises CacheFull holding nothing (its lock's references and reservation are
    released, no copy slot kept); once there is room the same request commits (copying), and after
    everything is released the pool is whole."""
    core, turn_program, _ = _in_place_turn(pool_size=64)
    turn = AkvRequest(turn_program)
    taken = turn.plan_draft(core).plan.taken
    assert taken.size == 18
    turn.locks = 1
    turn.lock(core)
    core.pool.incref(taken)  # the reader's lock
    filler = core.allocate(core.pool.n_free)
    assert core.pool.n_evictable < 18
    with pytest.raises(CacheFull):
        turn.commit(core)
    assert turn.active is None and turn.pinned is None
    core.pool.decref(filler)
    turn.commit(core)
    copies = [job for job in turn.active.plan.copies if job.size]
    assert sum(job.size for job in copies) == 18 and not any((job.src == job.dst).any() for job in copies)
    core.pool.decref(taken)
    turn.release(core, publish=False)
    _slots_accounted(core, [turn_program])
    core.flush()
    assert core.pool.n_free == core.pool.size


@pytest.mark.parametrize("path", ["lock released uncommitted", "committed then aborted", "committed then finished"])
def test_every_path_of_an_in_place_turn_gives_back_what_it_took(path: str) -> None:
    """SGLang's admission locks a request and may drop the lock without committing (its budget check
    after the lock failed); a committed request is aborted (client gone, retraction) or finished.
    After each, no request reference or reservation is left and every slot is free or the tree's: an
    uncommitted lock leaves the tree as it was, an abort loses exactly the 18 versions the turn took to
    rotate in place (their KV is at the new positions now), a finish publishes them there."""
    free = ArrayFreeList(128)  # the engine's allocator, which births come from
    core, turn_program, sibling_program = _in_place_turn(128, free)
    before = core.tree.resident_slots()
    turn = AkvRequest(turn_program)
    turn.locks = 1
    turn.lock(core)
    taken = turn.draft.plan.taken
    if path == "lock released uncommitted":
        turn.release(core, publish=False)
        assert np.array_equal(core.tree.resident_slots(), before)
    else:
        turn.commit(core)
        births = np.flatnonzero(turn.active.plan.computed)
        turn.bind(core, int(births[0]), free.take(births.size))
        turn.release(core, publish=path == "committed then finished")
        kept = np.setdiff1d(before, taken)
        resident = core.tree.resident_slots()
        if path == "committed then aborted":
            assert sorted(resident.tolist()) == sorted(kept.tolist())
        else:
            assert np.isin(taken, resident).all() and np.isin(kept, resident).all()
    _slots_accounted(core, [turn_program, sibling_program])
    core.flush()
    assert core.pool.n_free == core.pool.size


def test_a_round_stops_before_a_segment_that_rotates_a_birth_of_the_round_in_place() -> None:
    """A cold turn (drop, reposition, new message) on a pool that holds its births but not their
    copies: its plan re-rotates the repositioned births in place, which the first segment's attention
    reads at their old positions, so the segment that rotates them starts the next round (two
    forwards instead of one, and no copy slot)."""
    prog = program([30, 30, 30, 2], {"2": [0]}, [2])
    pool = brute_needed(prog) + 2 + 4
    req, recv = request(prog, wanted=4)
    assert attach(req, recv, SERVER, pool_size=pool) is None and req.sampling_params.max_new_tokens == 4
    draft = req.akv.plan_draft(CacheCore(SlotPool(pool)), room=pool - 4 - 2)
    segments = req.akv.plan_draft_segments()
    assert draft.n_copy_slots == 0 and len(segments) == 2 and segments[0].end == segments[1].start
    rotated = segments[1].copies
    assert rotated.size > 0 and np.array_equal(rotated.src, rotated.dst)
    assert np.isin(rotated.dst, segments[0].slots).all()
    _fill(req, prog, 0)
    assert cap_extend(req) and req.extend_range.end == segments[0].end
    req.set_extend_range(segments[1].start, prog.n_tokens)
    assert not cap_extend(req) and req.extend_range.end == prog.n_tokens
