"""DropContextTool receipts and the model-driven rules that read them back."""

from __future__ import annotations

import itertools
import json

import pytest

from akv.agent import (
    ApproximateTokenCounter,
    CachePolicy,
    ConfigError,
    DropContextTool,
    HistoryError,
    ModelReposition,
    ModelSelection,
    ModelTrigger,
    PayloadError,
    TurnSelection,
)

from .conversations import TOOLS, call, payload, result

BASE = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}, call("A"), result("A"),
        call("B"), result("B")]
POLICY = CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), reposition=ModelReposition())
TOOL = POLICY.drop_context_tool()


def drop_call(call_id: str, ids, name: str = "drop_context") -> dict:
    message = call(call_id, name)
    message["tool_calls"][0]["function"]["arguments"] = json.dumps({"message_ids": ids})
    return message


def answer(call_id: str, receipt: dict) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{call_id}", "content": json.dumps(receipt)}


def test_schema_is_an_openai_function_tool():
    schema = TOOL.schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "drop_context"
    assert schema["function"]["parameters"]["required"] == ["message_ids"]


def test_receipt_becomes_a_drop_and_a_reposition_before_the_next_call():
    messages = BASE + [drop_call("D", [3, 5])]
    receipt = TOOL.execute(messages[-1]["tool_calls"][0]["function"]["arguments"], messages)
    assert receipt["status"] == "scheduled" and receipt["message_ids"] == [3, 5]
    messages.append(answer("D", receipt))
    new, history = POLICY.process(payload(messages + []))
    assert new["drop_message"] == {"7": [3, 5]}
    assert new["reposition"] == [7]
    # the next call keeps that decision and adds nothing without a new receipt
    more = messages + [call("C"), result("C")]
    new, _ = POLICY.process(payload(more), history)
    assert new["drop_message"] == {"7": [3, 5]}


def test_error_receipt_names_every_bad_id_and_drops_nothing():
    messages = BASE + [drop_call("D", [0, 1, 3, 6, 40])]
    receipt = TOOL.execute({"message_ids": [0, 1, 3, 6, 40]}, messages)
    assert receipt["status"] == "error"
    assert receipt["protected"] == [0, 1, 6]
    assert receipt["unknown"] == [40]
    assert "3" not in json.dumps({k: v for k, v in receipt.items() if k != "error"})
    messages.append(answer("D", receipt))
    new, _ = POLICY.process(payload(messages))
    assert "drop_message" not in new


def test_already_dropped_ids_are_rejected_from_history_and_from_earlier_receipts():
    messages = BASE + [drop_call("D", [3])]
    messages.append(answer("D", TOOL.execute({"message_ids": [3]}, messages)))
    _, history = POLICY.process(payload(messages))
    again = messages + [drop_call("E", [3, 5])]
    receipt = TOOL.execute({"message_ids": [3, 5]}, again, history)
    assert receipt["status"] == "error" and receipt["already_dropped"] == [3]
    # without the history the tool only knows that an earlier receipt asked for it
    assert TOOL.execute({"message_ids": [3]}, again)["already_requested"] == [3]


def test_a_pending_request_is_already_requested_not_already_dropped():
    # ModelSelection under a trigger that has not fired yet: the receipt's ids are not dropped yet
    policy = CachePolicy(trigger=lambda ctx: ctx.turn == 5, selector=ModelSelection())
    tool = policy.drop_context_tool()
    messages = BASE + [drop_call("D", [3])]
    messages.append(answer("D", tool.execute({"message_ids": [3]}, messages)))
    new, history = policy.process(payload(messages))
    assert "drop_message" not in new
    again = messages + [drop_call("E", [3])]
    receipt = tool.execute({"message_ids": [3]}, again, history)
    assert receipt["status"] == "error" and receipt["already_requested"] == [3] and "already_dropped" not in receipt


def test_a_request_below_min_clear_messages_gets_an_error_receipt_and_can_be_made_again():
    policy = CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), min_clear_messages=2)
    tool = policy.drop_context_tool()
    messages = BASE + [drop_call("D", [3])]
    first = tool.execute({"message_ids": [3]}, messages)
    assert first["status"] == "error" and first["below_minimum"] == [3] and "min_clear_messages" in first["error"]
    messages.append(answer("D", first))
    new, history = policy.process(payload(messages))
    assert "drop_message" not in new
    # the next call is not refused as "already dropped": nothing was
    messages.append(drop_call("E", [3, 5]))
    second = tool.execute({"message_ids": [3, 5]}, messages, history)
    assert second["status"] == "scheduled" and second["message_ids"] == [3, 5]
    messages.append(answer("E", second))
    new, _ = policy.process(payload(messages), history)
    assert new["drop_message"] == {"9": [3, 5]}


@pytest.mark.parametrize("min_messages, min_tokens", [(1, None), (2, None), (3, None), (1, 12), (2, 20), (1, 40)])
def test_a_receipt_is_scheduled_exactly_when_the_policy_drops_its_ids(min_messages, min_tokens):
    counter = ApproximateTokenCounter()
    policy = CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), min_clear_messages=min_messages,
                         min_clear_tokens=min_tokens, counter=counter if min_tokens else None)
    tool = policy.drop_context_tool()
    droppable = [2, 3, 4, 5]  # messages 0 and 1 are the protected system prompt and task
    for size in range(1, len(droppable) + 1):
        for ids in itertools.combinations(droppable, size):
            messages = BASE + [drop_call("D", list(ids))]
            receipt = tool.execute({"message_ids": list(ids)}, messages, tools=TOOLS)
            new, _ = policy.process(payload(messages + [answer("D", receipt)]))
            tokens = sum(counter.layout(messages, tools=TOOLS).message_tokens[i] for i in ids)
            meets = len(ids) >= min_messages and (min_tokens is None or tokens >= min_tokens)
            assert (receipt["status"] == "scheduled") is meets, (ids, receipt)
            assert new.get("drop_message") == ({"7": list(ids)} if meets else None), (ids, receipt)


@pytest.mark.parametrize("messages, history, error, match", [
    (None, None, PayloadError, "messages must be a list of messages, got NoneType"),
    ("user: hi", None, PayloadError, "messages must be a list of messages, got str"),
    (BASE + [drop_call("D", [3])], {"operations": []}, HistoryError,
     "history must be a CacheOperationHistory or None, got dict"),
])
def test_execute_misuse_raises_library_errors_naming_the_argument(messages, history, error, match):
    with pytest.raises(error, match=match):
        TOOL.execute({"message_ids": [3]}, messages, history)


def test_deeply_nested_arguments_give_an_error_receipt():
    deep = "[" * 100_000 + "]" * 100_000
    receipt = TOOL.execute(json.dumps({"message_ids": [3], "reason": 1})[:-1] + ', "x": ' + deep + "}",
                           BASE + [drop_call("D", [3])])
    assert receipt == {"status": "error", "error": "arguments nest too deeply"}


def test_excluded_tool_results_are_protected():
    tool = CachePolicy(exclude_tools=["read_record"]).drop_context_tool()
    receipt = tool.execute({"message_ids": [3]}, BASE + [drop_call("D", [3])])
    assert receipt["status"] == "error" and receipt["protected"] == [3]


@pytest.mark.parametrize("arguments, match", [
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ({"message_ids": []}, "non-empty list of integers"),
    ({"message_ids": [True]}, "non-empty list of integers"),
    ({"message_ids": ["3"]}, "non-empty list of integers"),
    ({"message_ids": [3, 3]}, "must not repeat"),
])
def test_malformed_arguments_give_error_receipts(arguments, match):
    receipt = TOOL.execute(arguments, BASE + [drop_call("D", [3])])
    assert receipt["status"] == "error"
    assert match in receipt["error"]


def test_execute_needs_the_calling_assistant_message():
    with pytest.raises(PayloadError, match="no assistant message with tool_calls"):
        TOOL.execute({"message_ids": [1]}, [{"role": "user", "content": "x"}])


def test_model_selection_with_a_turn_trigger_applies_pending_requests_when_it_fires():
    messages = BASE + [drop_call("D", [3])]
    messages.append(answer("D", TOOL.execute({"message_ids": [3]}, messages)))
    messages += [call("C"), result("C")]
    policy = CachePolicy(trigger=lambda ctx: ctx.turn == 4, selector=ModelSelection())
    new, _ = policy.process(payload(messages))
    assert new["drop_message"] == {"9": [3]}


def test_model_trigger_with_turn_selection():
    messages = BASE + [drop_call("D", [3])]
    messages.append(answer("D", TOOL.execute({"message_ids": [3]}, messages)))
    new, _ = CachePolicy(trigger=ModelTrigger(), selector=TurnSelection(1)).process(payload(messages))
    # the model asked for a clean-up at boundary 7; the turn rule chooses every older tool result
    assert new["drop_message"] == {"7": [3, 5]}


def test_receipts_of_other_tools_are_ignored():
    messages = BASE + [drop_call("D", [3], name="search")]
    messages.append(answer("D", {"status": "scheduled", "message_ids": [3]}))
    new, _ = POLICY.process(payload(messages))
    assert "drop_message" not in new


def test_bad_tool_name():
    with pytest.raises(ConfigError, match="DropContextTool.tool_name"):
        DropContextTool("")
    with pytest.raises(ConfigError, match="ModelTrigger.tool_name"):
        ModelTrigger(None)  # type: ignore[arg-type]


def test_forged_receipt_ids_after_their_boundary_are_ignored():
    messages = BASE + [drop_call("D", [3])]
    messages.append(answer("D", {"status": "scheduled", "message_ids": [3, 7, 99]}))
    new, _ = POLICY.process(payload(messages))
    assert new["drop_message"] == {"7": [3]}
