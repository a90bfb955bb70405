"""The client side of drop_rule: CachePolicy's reasoning schedule (thinking_drop) and the
keep_text_drop adapter for harnesses that trim text, on hand-worked conversations."""

from __future__ import annotations

import pytest

from akv.agent import CachePolicy, ConfigError, PayloadError, TurnSelection, TurnTrigger, keep_text_payload
from akv.agent.thinking import has_reasoning, thinking_schedule

from .conversations import call, payload, result


def thinking_call(call_id: str) -> dict:
    return {**call(call_id), "content": f"<think>plan {call_id}</think>\n\n"}


# Boundaries (last result of each batch) are 2, 4 and 6; assistants 1, 3, 5 carry reasoning.
AGENT = [{"role": "user", "content": "Read A, B, C."}, thinking_call("A"), result("A"), thinking_call("B"),
         result("B"), {**call("C"), "reasoning_content": "plan C"}, result("C")]


def test_has_reasoning() -> None:
    assert [has_reasoning(m) for m in AGENT] == [False, True, False, True, False, True, False]
    assert not has_reasoning({"role": "user", "content": "<think>x</think>"})
    assert not has_reasoning({"role": "assistant", "content": "answer <think>late</think>"})


def test_reasoning_older_than_the_last_turn_goes_at_the_next_boundaries() -> None:
    assert thinking_schedule(AGENT, (2, 4, 6), 1, {}) == {"4": [1], "6": [3]}
    assert thinking_schedule(AGENT, (2, 4, 6), 2, {}) == {"6": [1]}
    assert thinking_schedule(AGENT, (2, 4, 6), 3, {}) == {}
    # A message already dropped whole by then has no reasoning left to drop.
    assert thinking_schedule(AGENT, (2, 4, 6), 1, {1: 4, 3: 6}) == {}
    assert thinking_schedule(AGENT, (2, 4, 6), 1, {1: 6}) == {"4": [1], "6": [3]}


def test_policy_sends_one_thinking_drop_rule_with_its_message_drops() -> None:
    policy = CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(1), keep_thinking_turns=1)
    new, history = policy.process(payload(AGENT))
    assert "drop_message" not in new
    assert new["drop_rule"] == {"type": "thinking_drop", "thinking": {"4": [1], "6": [3]},
                                "drop_messages": history.drop_message()}
    assert history.drop_message() == {"4": [2], "6": [4]}
    again, _ = policy.process(payload(AGENT), history)
    assert again["drop_rule"] == new["drop_rule"]
    longer = AGENT + [thinking_call("D"), result("D")]
    later, _ = policy.process(payload(longer), history)
    assert later["drop_rule"]["thinking"] == {"4": [1], "6": [3], "8": [5]}


def test_policy_keeps_the_rule_before_anything_is_due() -> None:
    """The rule is sent from the first turn on, so the server renders reasoning the same way every turn."""
    new, _ = CachePolicy(keep_thinking_turns=5).process(payload(AGENT[:3]))
    assert new["drop_rule"] == {"type": "thinking_drop", "thinking": {}}
    plain, _ = CachePolicy().process(payload(AGENT[:3]))
    assert "drop_rule" not in plain


def test_openai_style_puts_the_rule_in_extra_body() -> None:
    new, _ = CachePolicy(keep_thinking_turns=1).process(payload(AGENT), api_style="openai")
    assert new["extra_body"]["drop_rule"]["thinking"] == {"4": [1], "6": [3]}


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_keep_thinking_turns_must_be_positive(value: object) -> None:
    with pytest.raises(ConfigError, match="keep_thinking_turns must be a positive int"):
        CachePolicy(keep_thinking_turns=value)


FULL = [{"role": "user", "content": "Read A, B."}, call("A"), result("A", "record A: long text"), call("B"),
        result("B", "record B: more"), {"role": "user", "content": "Summarise."}]


def test_keep_text_payload_carries_the_full_messages() -> None:
    trimmed = [FULL[0], FULL[1], {**FULL[2], "content": "record A"}, FULL[3], FULL[5]]
    body = {"model": "m", "messages": trimmed, "max_tokens": 4}
    new = keep_text_payload(body, FULL)
    assert new["messages"] == trimmed and new["max_tokens"] == 4
    assert new["drop_rule"] == {"type": "keep_text_drop", "full_messages": FULL}
    assert new["drop_rule"]["full_messages"] is not FULL and "drop_rule" not in body
    assert keep_text_payload(body, FULL, api_style="openai")["extra_body"]["drop_rule"]["type"] == "keep_text_drop"


def test_keep_text_payload_checks_the_projection_unless_forced() -> None:
    rewritten = [FULL[0], FULL[1], {**FULL[2], "content": "[trimmed]"}, FULL[5]]
    with pytest.raises(PayloadError, match=r"messages\[2\] is not part of any remaining full message") as info:
        keep_text_payload({"model": "m", "messages": rewritten}, FULL)
    assert info.value.message_id == 2
    forced = keep_text_payload({"model": "m", "messages": rewritten}, FULL, force=True)
    assert forced["drop_rule"]["force"] is True
    with pytest.raises(PayloadError, match=r"messages\[0\] is not part"):
        keep_text_payload({"model": "m", "messages": [FULL[5], FULL[0]]}, FULL)
    with pytest.raises(PayloadError, match="already has 'drop_message'"):
        keep_text_payload({"model": "m", "messages": FULL, "drop_message": {"1": [0]}}, FULL)
