"""``cold_single_peak`` (the fewest births a request holds on an idle server, which sizes the
admission refusal and clips ``max_new_tokens``) equals the peak of the plan it stands for: the cold
plan with births rotated in place, its lifetimes counted by ``BirthLifetimes`` (the slow reference,
kept here), over random conversations, long ones with many drops and repositions, token-range
drops, and generated tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from akv.system.cache.lifetimes import BirthLifetimes, cold_single_peak
from akv.system.cache.occurrence import cold_plan
from akv.system.context.compiler import append_generated, compile_program, compile_token_drops
from akv.system.context.program import ContextProgram
from akv.system.context.rules import parse_rules
from akv.system.context.wire import decode_program, encode_program
from tests.cache.conversations import Conversation, conversations
from tests.context.test_compiler_token_drops import Case, cases


def plan_peak(program: ContextProgram) -> int:
    """The slow reference: build the plan, count its births' lifetimes, add its copy slots."""
    draft = cold_plan(program, births_in_place=True)
    assert draft.n_copy_slots == 0  # every copy rotates one of the request's births in place
    return BirthLifetimes.of(draft.plan, program.n_tokens).single_peak() + draft.n_copy_slots


def check_turns(conversation: Conversation, generated: bool) -> None:
    for turn in range(conversation.n_turns):
        program = conversation.program(turn)
        if generated:
            program = append_generated(program, conversation.reply(turn))
        assert cold_single_peak(program) == plan_peak(program), (turn, conversation)


@settings(max_examples=300, deadline=None)
@given(conversations(), st.booleans())
def test_small_conversations(conversation: Conversation, generated: bool) -> None:
    check_turns(conversation, generated)


@settings(max_examples=60, deadline=None)
@given(conversations(vocab=50, max_messages=18, max_len=40), st.booleans())
def test_long_conversations_with_many_drops_and_repositions(conversation: Conversation, generated: bool) -> None:
    check_turns(conversation, generated)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_token_range_drops(case: Case) -> None:
    assume(case.owners or case.generated)
    ids = np.arange(len(case.owners))
    program = compile_token_drops(ids, case.owners, case.drops, case.repositions, case.n_messages)
    program = append_generated(program, list(range(case.generated)))
    assert cold_single_peak(program) == cold_single_peak(decode_program(encode_program(program))) == plan_peak(program)


def test_worked_by_hand() -> None:
    # messages 0, 1, 2 own tokens 0..2, 3..5, 6..10
    owners = np.repeat(np.arange(3), [3, 3, 5])
    ids = np.arange(11)

    def peak(drops: dict[str, list[int]]) -> int:
        return cold_single_peak(compile_program(ids, owners, parse_rules(drops, [1], 3), 3))

    # message 0 dropped after message 1: computed, read by the first segment (tokens 0..5), given back
    # before the second (6..10) runs, which holds 3 + 5
    assert peak({"1": [0]}) == 8
    # messages 0 and 1 dropped after message 1: no later query reads them, so never computed
    assert peak({"1": [0, 1]}) == 5
    # message 1 dropped after message 2 (the end of the text): the last segment reads it
    assert peak({"2": [1]}) == 11
