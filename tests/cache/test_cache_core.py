"""Cache core lifecycle: reuse across turns, hand-worked usage, atomic admission, handle misuse."""

from __future__ import annotations

import numpy as np
import pytest

from akv.system.cache.core import CacheCore, CacheFull, RequestStateError
from akv.system.cache.keys import program_key
from akv.system.cache.pool import SlotPool

from .conversations import Conversation

MESSAGES = ((1, 2), (3, 4), (5, 6), (7, 8), (9,))


def test_a_retry_computes_only_the_last_token() -> None:
    core = CacheCore(SlotPool(64))
    program = Conversation(MESSAGES, {2: (0,)}, (2,)).program(3)
    core.finish(core.admit(program))
    again = core.admit(program)
    assert np.flatnonzero(again.plan.computed).tolist() == [program.n_tokens - 1]
    assert again.plan.fresh.size == 1, "the re-rotated versions were published, nothing is copied"
    core.finish(again)


def test_plain_requests_share_prefixes() -> None:
    core = CacheCore(SlotPool(64))
    plain = Conversation(MESSAGES, {}, ())
    core.finish(core.admit(plain.program(1)))
    request = core.admit(plain.program(3))
    assert request.plan.match.n_tokens == 4
    n_prompt = plain.program(3).n_prompt
    assert request.plan.usage.as_dict() == {"cached_tokens": 4, "repos_tokens": 0, "drop_skipped_tokens": 0,
                                            "computed_tokens": n_prompt - 4}
    core.finish(request)


def test_usage_of_an_agent_turn_worked_by_hand() -> None:
    """Turn 2 (messages 0..2) was served plainly; turn 3 drops message 1 after message 2 and repositions.

    Turn 3 computes message 3 (tokens 6, 7). Resident tokens 0, 1 stay at positions 0, 1 (cached);
    tokens 4, 5 move from 4, 5 to 2, 3 (repos); tokens 2, 3 are hidden and unread (skipped)."""
    core = CacheCore(SlotPool(64))
    core.finish(core.admit(Conversation(MESSAGES, {}, ()).program(2)))
    request = core.admit(Conversation(MESSAGES, {2: (1,)}, (2,)).program(3))
    plan = request.plan
    assert np.flatnonzero(plan.computed).tolist() == [6, 7]
    assert plan.usage.as_dict() == {"cached_tokens": 2, "repos_tokens": 2, "drop_skipped_tokens": 2,
                                    "computed_tokens": 2}
    (segment,) = plan.segments
    assert segment.prefix_tokens.tolist() == [0, 1, 4, 5] and segment.prefix_positions.tolist() == [0, 1, 2, 3]
    copies = segment.copies
    assert copies.tokens.tolist() == [4, 5]
    assert copies.old_positions.tolist() == [4, 5] and copies.new_positions.tolist() == [2, 3]
    assert segment.prefix_slots.tolist()[2:] == copies.dst.tolist()
    assert segment.positions.tolist() == [4, 5]
    core.finish(request)


def test_copies_start_from_the_birth_version() -> None:
    """Token 4 is resident at its birth position 4 and at 2 (after one Repos); a second Repos that
    moves it to 0 copies from position 4, so the key is rotated once from where it was computed."""
    core = CacheCore(SlotPool(64))
    first = Conversation(MESSAGES, {2: (1,)}, (2,))
    core.finish(core.admit(first.program(2)))
    request = core.admit(Conversation(MESSAGES, {2: (1,), 3: (0,)}, (2, 3)).program(4))
    moved = request.plan.segments[-1].copies
    assert moved.tokens.tolist() == [4, 5, 6, 7]
    assert moved.old_positions.tolist()[:2] == [4, 5] and moved.new_positions.tolist()[:2] == [0, 1]
    core.finish(request)


def test_admission_is_all_or_nothing() -> None:
    pool = SlotPool(6)
    core = CacheCore(pool)
    core.finish(core.admit(Conversation(MESSAGES, {}, ()).program(1)))
    held = core.admit(Conversation(MESSAGES, {}, ()).program(1))
    before = pool.n_free
    with pytest.raises(CacheFull, match="need 9 slots"):
        core.admit(Conversation(((11, 12, 13, 14, 15, 16, 17, 18, 19),), {}, ()).program(0))
    assert pool.n_free == before and core.active == 1
    core.finish(held)
    core.flush()
    assert pool.n_free == 6


def test_handles_cannot_be_reused_and_shapes_are_checked() -> None:
    core = CacheCore(SlotPool(16))
    request = core.admit(Conversation(MESSAGES, {}, ()).program(0))
    with pytest.raises(RequestStateError, match="generated_slots: shape"):
        core.finish(request, np.array([1, 2]), core.allocate(1))
    core.abort(request)
    with pytest.raises(RequestStateError, match=f"rid {request.rid} is not active"):
        core.finish(request)


def test_chunked_segments_read_exactly_what_the_whole_segment_reads() -> None:
    core = CacheCore(SlotPool(64))
    program = Conversation(MESSAGES, {2: (1,)}, (2,)).program(4)
    core.finish(core.admit(Conversation(MESSAGES, {}, ()).program(2)))
    (segment,) = core.admit(program).plan.segments
    indptr, indices = segment.visible_slots()
    whole = [indices[indptr[i] : indptr[i + 1]].tolist() for i in range(segment.n_queries)]
    chunks = segment.chunks(2)
    assert [(c.start, c.end) for c in chunks] == [(6, 8), (8, 9)]
    assert chunks[0].copies is segment.copies and chunks[1].copies.size == 0
    rows = []
    for chunk in chunks:
        ptr, idx = chunk.visible_slots()
        rows += [idx[ptr[i] : ptr[i + 1]].tolist() for i in range(chunk.n_queries)]
    assert rows == whole
    assert chunks[1].prefix_tokens.tolist() == [0, 1, 4, 5, 6, 7]
    assert chunks[1].prefix_positions.tolist() == [0, 1, 2, 3, 4, 5]



def test_eviction_takes_dropped_kv_first_and_the_next_turn_loses_nothing() -> None:
    """After a turn that drops message 1, evicting two slots frees exactly its KV (not the older,
    unrelated request's); the next turn still matches through the hole and computes only its own
    new message."""
    pool = SlotPool(64)
    core = CacheCore(pool)
    other = Conversation(((20, 21),), {}, ()).program(0)
    core.finish(core.admit(other))
    agent = Conversation(MESSAGES, {2: (1,)}, ())
    first = core.admit(agent.program(2))
    message_1 = first.plan.segments[0].slots[2:4]
    core.finish(first)
    assert core.tree.evict(2) == 2
    assert (pool.refcount(message_1) == 0).all()
    assert core.tree.match(program_key(other)).resident.all()
    nxt = core.admit(agent.program(3))
    assert nxt.plan.match.n_tokens == 6 and not nxt.plan.match.resident[2:4].any()
    assert np.flatnonzero(nxt.plan.computed).tolist() == [6, 7]
    assert nxt.plan.usage.as_dict() == {"cached_tokens": 4, "repos_tokens": 0, "drop_skipped_tokens": 2,
                                        "computed_tokens": 2}
