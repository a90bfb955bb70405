"""CacheOperationHistory: continuity checks across calls, invariants, JSON round-trip."""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.agent import (
    CacheOperation,
    CacheOperationHistory,
    CachePolicy,
    HistoryError,
    PayloadError,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)

from akv.agent.jsonvalue import MAX_DEPTH, same_json

from .conversations import call, payload, result

POLICY = CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(1), reposition=TurnReposition(after=2, every=2))


def conversation(turns: int) -> list[dict]:
    messages = [{"role": "user", "content": "task"}]
    for i in range(turns):
        messages += [call(str(i)), result(str(i))]
    return messages


def test_history_continues_across_calls_and_keeps_past_decisions():
    _, h2 = POLICY.process(payload(conversation(2)))
    new, h4 = POLICY.process(payload(conversation(4)), h2)
    assert h4.operations[:len(h2.operations)] == h2.operations
    assert new["drop_message"] == {"4": [2], "6": [4], "8": [6]}
    assert new["reposition"] == [4, 8]
    assert h4.message_count == 9


def test_past_decisions_are_not_recomputed():
    _, h1 = CachePolicy().process(payload(conversation(3)))
    new, h2 = POLICY.process(payload(conversation(4)), h1)
    # the earlier history decided nothing for turns 1-3; only turn 4 (boundary 8) is decided now
    assert new["drop_message"] == {"8": [2, 4, 6]}
    assert new["reposition"] == [8]


def test_no_new_messages_no_new_decision():
    _, h = POLICY.process(payload(conversation(2)))
    new, again = POLICY.process(payload(conversation(2)), h)
    assert again is h
    assert new["drop_message"] == {"4": [2]}


def test_edited_earlier_message_raises():
    _, h = POLICY.process(payload(conversation(2)))
    edited = conversation(3)
    edited[2]["content"] = "a different result"
    with pytest.raises(HistoryError, match="messages 0..4 differ"):
        POLICY.process(payload(edited), h)


def test_in_place_edit_of_an_earlier_message_raises():
    messages = conversation(2)
    _, h = POLICY.process(payload(messages))
    messages[2]["content"] = "rewritten in place"
    with pytest.raises(HistoryError, match="differ"):
        POLICY.process(payload(messages + [call("x"), result("x")]), h)
    messages = conversation(2)
    _, h = POLICY.process(payload(messages))
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{}"
    with pytest.raises(HistoryError, match="differ"):
        POLICY.process(payload(messages + [call("x"), result("x")]), h)


def test_history_loaded_from_json_checks_the_prefix_by_digest():
    _, h = POLICY.process(payload(conversation(2)))
    loaded = CacheOperationHistory.from_json(h.to_json())
    assert loaded.snapshot is None
    edited = conversation(3)
    edited[0]["content"] = "another task"
    with pytest.raises(HistoryError, match="messages 0..4 differ"):
        POLICY.process(payload(edited), loaded)
    reordered = conversation(3)
    reordered[0] = dict(reversed(list(reordered[0].items())))
    new, _ = POLICY.process(payload(reordered), loaded)
    assert new["drop_message"] == {"4": [2], "6": [4]}


def test_other_model_tools_or_template_settings_raise():
    _, h = POLICY.process(payload(conversation(2)))
    for change in ({"model": "other"}, {"tools": []}, {"chat_template_kwargs": {"enable_thinking": False}}):
        with pytest.raises(HistoryError, match="settings"):
            POLICY.process({**payload(conversation(3)), **change}, h)
    with pytest.raises(HistoryError, match="settings"):
        POLICY.process(payload(conversation(3)), h, api_style="openai")


def test_sampling_fields_may_change_between_calls():
    _, h = POLICY.process(payload(conversation(2)))
    new, _ = POLICY.process({**payload(conversation(3)), "temperature": 0.7, "max_tokens": 10}, h)
    assert new["drop_message"] == {"4": [2], "6": [4]}


def test_history_from_a_longer_branch_raises():
    _, h = POLICY.process(payload(conversation(3)))
    with pytest.raises(HistoryError, match="covers 7 messages but the payload has only 5"):
        POLICY.process(payload(conversation(2)), h)


def test_json_round_trip():
    _, h = POLICY.process(payload(conversation(4)))
    back = CacheOperationHistory.from_json(h.to_json())
    assert back == h
    new, _ = POLICY.process(payload(conversation(5)), back)
    assert new["drop_message"]["10"] == [8]


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d["operations"].append({"boundary": 2, "drop": [1], "reposition": False}), "strictly increase"),
    (lambda d: d["operations"][1].update(drop=[2]), "already dropped"),
    (lambda d: d["operations"][1].update(drop=[9]), "drop id 9"),
    (lambda d: d["operations"][1].update(drop=[], reposition=False), "neither drops"),
    (lambda d: d.update(message_count=6), "not among"),
    (lambda d: d["operations"][0].update(reposition=1), "reposition must be a bool"),
    (lambda d: d.update(message_count=True), "message_count"),
])
def test_from_json_rejects_broken_histories(mutate, match):
    import json

    _, h = POLICY.process(payload(conversation(3)))
    data = json.loads(h.to_json())
    mutate(data)
    with pytest.raises(HistoryError, match=match):
        CacheOperationHistory.from_json(json.dumps(data))


def test_from_json_rejects_non_json():
    with pytest.raises(HistoryError, match="not valid JSON"):
        CacheOperationHistory.from_json("{")


def test_operations_are_immutable():
    op = CacheOperation(4, (2,), True)
    with pytest.raises(AttributeError):
        op.boundary = 5  # type: ignore[misc]
    with pytest.raises(HistoryError, match="must be a tuple"):
        CacheOperation(4, [2])  # type: ignore[arg-type]


def test_history_boundaries_must_be_turns_of_the_payload():
    messages = [{"role": "user", "content": "task"}, call("A"), result("A"), {"role": "user", "content": "next"},
                call("B"), result("B")]
    _, h = POLICY.process(payload(messages), completed_call_message_ids=[2, 3, 5])
    assert h.operations[0].boundary == 3
    with pytest.raises(HistoryError, match=r"operations at messages \[3\] are not completed turns"):
        POLICY.process(payload(messages + [call("C"), result("C")]), h)


def test_process_does_not_mutate_history():
    _, h = POLICY.process(payload(conversation(2)))
    snapshot = copy.deepcopy(h)
    POLICY.process(payload(conversation(4)), h)
    assert h == snapshot


def tagged(value) -> list[dict]:
    messages = conversation(2)
    messages[0]["metadata"] = value
    return messages


def json_text(value) -> str:
    return json.dumps(value, sort_keys=True)


@pytest.mark.parametrize("before, after", [
    (1, True), (True, 1), (0, False), (1, 1.0), (0.0, -0.0), ([1, 2], [True, 2]), ({"a": 1}, {"a": True}),
    ("x", "x"), (1.5, 1.5), ({"a": 1, "b": [None]}, {"b": [None], "a": 1}), (float("nan"), float("nan")),
])
def test_continuity_is_the_same_in_memory_and_after_a_json_round_trip(before, after):
    _, in_memory = POLICY.process(payload(tagged(before)))
    from_json = CacheOperationHistory.from_json(in_memory.to_json())
    expected_same = json_text(before) == json_text(after)
    for history in (in_memory, from_json):
        edited = tagged(after) + [call("x"), result("x")]
        if expected_same:
            POLICY.process(payload(edited), history)
        else:
            with pytest.raises(HistoryError, match="differ"):
                POLICY.process(payload(edited), history)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | st.sampled_from([0.0, -0.0, 1.0, 2.5, float("nan")])
    | st.sampled_from(["", "a", "1"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES, JSON_VALUES)
def test_same_json_is_equality_of_json_text(a, b):
    assert same_json(a, b) is (json_text(a) == json_text(b))


@pytest.mark.parametrize("tools, field, match", [
    ([{1: "x", "a": 2}], "tools[0]", "key 1 (int) is not a string; JSON object keys must be strings"),
    ([{"type": "function", "function": {("name",): "f"}}], "tools[0].function", "key ('name',) (tuple) is not a string"),
    ([{"type": "function", "function": {"name": "f", "parameters": object()}}], "tools[0].function.parameters",
     "object is not a JSON value"),
])
def test_tools_that_are_not_json_raise_a_payload_error_naming_the_path(tools, field, match):
    with pytest.raises(PayloadError, match=re.escape(match)) as info:
        POLICY.process(payload(conversation(2), tools=tools))
    assert info.value.field == field


def nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_deep_nesting_is_refused_with_a_bounded_clear_error():
    # the messages list and a message object are two levels; content may nest MAX_DEPTH - 2 more
    messages = conversation(2)
    messages[4]["content"] = nested(MAX_DEPTH - 2)
    POLICY.process(payload(messages))
    messages[4]["content"] = nested(MAX_DEPTH - 1)
    with pytest.raises(PayloadError, match=f"nested deeper than {MAX_DEPTH} levels") as info:
        POLICY.process(payload(messages))
    assert info.value.message_id == 4 and info.value.field.startswith("messages[4].content")
    messages[4]["content"] = nested(100_000)
    with pytest.raises(PayloadError, match=f"nested deeper than {MAX_DEPTH} levels"):
        POLICY.process(payload(messages))
    _, history = POLICY.process(payload(conversation(2)))
    later = conversation(3)
    later[6]["content"] = nested(100_000)
    with pytest.raises(PayloadError, match=r"messages\[6\].content") as info:
        POLICY.process(payload(later), history)
    assert info.value.message_id == 6
    for field in ("tools", "chat_template_kwargs", "metadata"):
        with pytest.raises(PayloadError, match=f"{field}.*nested deeper than {MAX_DEPTH} levels") as info:
            POLICY.process(payload(conversation(2), **{field: nested(100_000)}))
        assert info.value.field.startswith(field)


def test_non_json_values_in_messages_name_the_message():
    messages = conversation(2)
    messages[3]["tool_calls"][0]["function"]["arguments"] = {"id": {1, 2}}
    with pytest.raises(PayloadError, match=r"messages\[3\].tool_calls\[0\].function.arguments.id: set is not a "
                                           r"JSON value") as info:
        POLICY.process(payload(messages))
    assert info.value.message_id == 3
