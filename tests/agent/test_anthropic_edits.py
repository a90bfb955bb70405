"""`akv.agent.anthropic`: Anthropic's context edits validated field by field and turned into drops on
`CachePolicy`'s rules; each expectation is counted from the message list by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest

from akv.agent import ApproximateTokenCounter
from akv.agent.anthropic import ContextManagementError, parse_context_management, plan_edits

COUNTER = ApproximateTokenCounter()


def conversation(n_turns: int, tools: tuple[str, ...] = ("read",), thinking: bool = False) -> list[dict[str, Any]]:
    """user 0; turn i: assistant 2i+1 calling tools[i % len(tools)], its tool result 2i+2."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i in range(n_turns):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": tools[i % len(tools)], "arguments": json.dumps({"i": i})}}
        assistant: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        if thinking:
            assistant["reasoning_content"] = f"thought {i}"
        messages += [assistant, {"role": "tool", "tool_call_id": f"c{i}", "content": "x" * 200}]
    return messages


def edits(*edit: dict[str, Any]) -> Any:
    return parse_context_management({"edits": list(edit)}, has_tools=True)


def test_tool_uses_trigger_keeps_the_newest_results() -> None:
    plan = plan_edits(conversation(5), edits({"type": "clear_tool_uses_20250919",
                                              "trigger": {"type": "tool_uses", "value": 3},
                                              "keep": {"type": "tool_uses", "value": 2}}), COUNTER)
    # results at 2, 4, 6, 8, 10: the trigger fires from the 4th result (boundary 8) on
    assert plan.fields == {"drop_message": {"8": [2, 4], "10": [6]}}
    assert plan.tool_results == plan.dropped == (2, 4, 6)


def test_token_trigger_clear_at_least_and_excluded_tools() -> None:
    messages = conversation(6, tools=("read", "memo"))
    sizes = COUNTER.layout(messages).message_tokens
    threshold = sum(sizes[:7]) + 3  # the prompt passes it only after the 4th result (message 8)
    plan = plan_edits(messages, edits({"type": "clear_tool_uses_20250919",
                                       "trigger": {"type": "input_tokens", "value": threshold},
                                       "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["memo"]}),
                      COUNTER)
    # memo results (4, 8, 12) are never dropped; read results older than the newest result are
    assert plan.fields == {"drop_message": {"8": [2, 6], "12": [10]}}
    least = sizes[2] + sizes[6] + 1  # two results are too few tokens: nothing until a third is selectable
    plan = plan_edits(messages, edits({"type": "clear_tool_uses_20250919",
                                       "trigger": {"type": "input_tokens", "value": threshold},
                                       "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["memo"],
                                       "clear_at_least": {"type": "input_tokens", "value": least}}), COUNTER)
    assert plan.fields == {"drop_message": {"12": [2, 6, 10]}}


def test_clear_tool_inputs_drops_the_calling_message_too() -> None:
    plan = plan_edits(conversation(3), edits({"type": "clear_tool_uses_20250919", "clear_tool_inputs": True,
                                              "trigger": {"type": "tool_uses", "value": 1},
                                              "keep": {"type": "tool_uses", "value": 1}}), COUNTER)
    assert plan.fields == {"drop_message": {"4": [1, 2], "6": [3, 4]}}
    assert plan.tool_results == (2, 4)


def test_clear_thinking_maps_onto_thinking_drop() -> None:
    messages = conversation(3, thinking=True)
    plan = plan_edits(messages, edits({"type": "clear_thinking_20251015",
                                       "keep": {"type": "thinking_turns", "value": 1}}), COUNTER)
    assert plan.fields == {"drop_rule": {"type": "thinking_drop", "thinking": {"4": [1], "6": [3]}}}
    assert plan.thinking == (1, 3) and plan.dropped == ()
    keep_all = plan_edits(messages, edits({"type": "clear_thinking_20251015", "keep": "all"}), COUNTER)
    assert keep_all.fields == {} and keep_all.thinking == ()


@pytest.mark.parametrize(("value", "has_tools", "field"), [
    ({"edits": [{"type": "clear_everything"}]}, True, "context_management.edits[0].type"),
    ({"edits": [{"type": "clear_tool_uses_20250919"}]}, False, "context_management.edits[0].type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
                 "keep": {"type": "tool_uses", "value": 3}}]}, True, "context_management.edits[0].keep.value"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "turns", "value": 2}}]}, True,
     "context_management.edits[0].trigger.type"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 0}}]}, True,
     "context_management.edits[0].keep.value"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "read"}]}, True,
     "context_management.edits[0].exclude_tools"),
    ({"edits": [{"type": "clear_tool_uses_20250919", "clear_tool_inputs": "yes"}]}, True,
     "context_management.edits[0].clear_tool_inputs"),
    ({"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]}, True,
     "context_management.edits[1].type"),
    ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}, "x": 1}]}, True,
     "context_management.edits[0].x"),
    ({"edit": []}, True, "context_management.edit"),
    ([], True, "context_management"),
])
def test_bad_edits_name_the_field(value: Any, has_tools: bool, field: str) -> None:
    with pytest.raises(ContextManagementError) as error:
        parse_context_management(value, has_tools=has_tools)
    assert error.value.field == field and str(error.value).startswith(field + ": ")
