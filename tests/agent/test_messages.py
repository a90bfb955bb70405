"""Validation of the message list: every structural error names the message and the problem."""

from __future__ import annotations

import pytest

from akv.agent import CachePolicy, PayloadError
from akv.agent.messages import parse_conversation

from .conversations import call, payload, result

USER = {"role": "user", "content": "task"}


@pytest.mark.parametrize("messages, message_id, match", [
    ([USER, {"role": "robot", "content": "x"}], 1, r"message 1: unknown role 'robot'"),
    ([USER, {"role": ["user"], "content": "x"}], 1, r"message 1: unknown role \['user'\]"),
    ([USER, "hello"], 1, r"message 1: must be an object"),
    ([USER, result("A")], 1, r"message 1: tool result without a preceding assistant tool call"),
    ([USER, call("A"), result("A"), result("A")], 3, r"message 3: extra tool result: tool_call_id 'call_A' answers"),
    ([USER, call("A"), result("B")], 2, r"message 2: extra tool result: tool_call_id 'call_B' does not answer"),
    ([USER, call(["A", "B"]), result("A"), USER], 1, r"message 1: missing tool results for call ids \['call_B'\] "
                                                     r"before message 3"),
    ([USER, call("A")], 1, r"message 1: missing tool results .* at the end of the conversation"),
    ([USER, call(["A", "A"])], 1, r"message 1: duplicate tool-call id 'call_A'"),
    ([USER, {"role": "assistant", "tool_calls": {"id": "x"}}], 1, r"message 1: tool_calls must be a list"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f"}}]}], 1,
     r"message 1: tool_calls\[0\].id must be a non-empty string"),
    ([USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}], 1,
     r"message 1: tool_calls\[0\].function.name"),
    ([USER, {"role": "tool", "content": "x"}], 1, r"message 1: tool result without"),
])
def test_structural_errors_name_the_message(messages, message_id, match):
    with pytest.raises(PayloadError, match=match) as info:
        CachePolicy().process(payload(messages))
    assert info.value.message_id == message_id


def test_empty_or_missing_messages():
    for bad in ({"model": "m"}, {"model": "m", "messages": []}, {"model": "m", "messages": "hi"}):
        with pytest.raises(PayloadError, match="'messages' must be a non-empty list"):
            CachePolicy().process(bad)


def test_batches_and_boundaries():
    messages = [{"role": "system", "content": "s"}, USER, {"role": "assistant", "content": "plan"},
                call(["A", "B"]), result("B"), result("A"), USER, call("C"), result("C")]
    conversation = parse_conversation(messages)
    assert [(b.assistant, b.results) for b in conversation.batches] == [(3, (4, 5)), (7, (8,))]
    assert conversation.boundaries == (5, 8)
    assert conversation.first_user == 1
    assert conversation.tool_names[4] == "read_record"
    assert conversation.batch_of == (-1, -1, -1, 0, 0, 0, -1, 1, 1)


@pytest.mark.parametrize("ids, match", [
    ([5, 8, 6], r"6 does not strictly increase after 8"),
    ([4, 5, 8], r"message 4 is a tool result that does not complete its batch"),
    ([2, 5, 8], r"message 2 has role 'assistant'"),
    ([5], r"missing \[8\]"),
    ([5, 8, 9], r"9 is not a message id in \[0, 9\)"),
    ([5, True, 8], r"True is not a message id"),
    ("58", r"must be a sequence"),
])
def test_completed_call_message_ids_errors(ids, match):
    messages = [{"role": "system", "content": "s"}, USER, {"role": "assistant", "content": "plan"},
                call(["A", "B"]), result("B"), result("A"), USER, call("C"), result("C")]
    with pytest.raises(PayloadError, match=match):
        parse_conversation(messages, ids)


def test_user_turns_accepted():
    messages = [USER, call("A"), result("A"), USER, call("C"), result("C")]
    assert parse_conversation(messages, [2, 3, 5]).boundaries == (2, 3, 5)
