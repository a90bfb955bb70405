"""CacheOperationHistory: continuity checks across calls, invariants, JSON round-trip."""

from __future__ import annotations

import copy

import pytest

from akv.agent import (
    CacheOperation,
    CacheOperationHistory,
    CachePolicy,
    HistoryError,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)

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
