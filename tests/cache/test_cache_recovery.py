"""Which queries run: the least set closed under "a needed query reads it and it is not resident"."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.recovery import SegmentSpan, needed_queries, segment_spans
from akv.system.context.program import ContextProgram

from .conversations import Conversation, conversations

MESSAGES = ((1, 2), (3, 4), (5, 6), (7, 8), (9,))


def _brute_needed(program: ContextProgram, resident: set[int]) -> set[int]:
    """Grow from the last token and generation's reads until nothing missing is read by a needed query."""
    n = program.n_tokens
    needed = {n - 1} | {s for s in range(n) if s not in resident and program.keep[s]}
    changed = True
    while changed:
        changed = False
        for s in range(n):
            if s in needed or s in resident:
                continue
            if any(s < q < program.visible_until[s] for q in needed):
                needed.add(s)
                changed = True
    return needed


@settings(max_examples=150, deadline=None)
@given(conversations(max_messages=6), st.data())
def test_needed_queries_equal_the_brute_force(conv: Conversation, data: st.DataObject) -> None:
    program = conv.program(conv.n_turns - 1)
    matched = data.draw(st.integers(0, program.n_tokens))
    resident = np.array(data.draw(st.lists(st.booleans(), min_size=matched, max_size=matched)), dtype=bool)
    got = needed_queries(program, resident)
    assert set(np.flatnonzero(got).tolist()) == _brute_needed(program, set(np.flatnonzero(resident).tolist()))


def test_a_chain_of_drops_recovers_transitively() -> None:
    """Message 1 is read only by message 2, which only the kept message 3 reads: all three run."""
    program = Conversation(MESSAGES, {2: (1,), 3: (2,)}, ()).program(4)
    resident = np.ones(program.n_tokens, dtype=bool)
    resident[2:8] = False
    assert np.flatnonzero(needed_queries(program, resident)).tolist() == [2, 3, 4, 5, 6, 7, 8]
    resident[6:8] = True
    assert np.flatnonzero(needed_queries(program, resident)).tolist() == [8]


def test_a_message_dropped_right_after_itself_is_never_computed() -> None:
    program = Conversation(MESSAGES, {1: (1,)}, ()).program(2)
    assert np.flatnonzero(needed_queries(program, np.zeros(0, dtype=bool))).tolist() == [0, 1, 4, 5]


def test_segments_cut_at_stage_changes_and_resident_gaps() -> None:
    program = Conversation(MESSAGES, {1: (0,)}, (1,)).program(4)
    needed = np.zeros(program.n_tokens, dtype=bool)
    needed[[0, 1, 3, 4, 5, 8]] = True
    assert segment_spans(program, needed) == (
        SegmentSpan(0, 2, 0), SegmentSpan(3, 4, 0), SegmentSpan(4, 6, 2), SegmentSpan(8, 9, 2),
    )

