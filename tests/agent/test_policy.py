"""CachePolicy.process on hand-worked conversations."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest

from akv.agent import (
    ApproximateTokenCounter,
    CachePolicy,
    ConfigError,
    PayloadError,
    RuleError,
    TokenLayout,
    TokenReposition,
    TokenSelection,
    TokenTrigger,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)

from .conversations import call, payload, result

WORKED = [{"role": "user", "content": "Read A then B."}, call("A"), result("A"), call("B"), result("B")]


@dataclass(frozen=True)
class FixedCounter:
    """Tool results cost `tool` tokens, every other message `other`; the generation prompt `gen`."""

    tool: int = 100
    other: int = 10
    gen: int = 0

    def layout(self, messages, *, tools=None, chat_template_kwargs=None, api_style="sglang"):
        spans, start = [], 0
        for m in messages:
            end = start + (self.tool if m["role"] == "tool" else self.other)
            spans.append((start, end))
            start = end
        return TokenLayout(tuple(spans), self.gen)


def fields(new: dict) -> dict:
    return {k: new[k] for k in ("drop_message", "reposition") if k in new}


def test_worked_example_from_the_issue():
    policy = CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(1),
                         reposition=TurnReposition(after=2, every=2))
    new, history = policy.process(payload(WORKED))
    assert fields(new) == {"drop_message": {"4": [2]}, "reposition": [4]}
    assert [(op.boundary, op.drop, op.reposition) for op in history.operations] == [(4, (2,), True)]


@pytest.mark.parametrize("target, dropped", [("tool", [2]), ("assistant", [1]), ("both", [1, 2])])
def test_turn_selection_targets(target, dropped):
    new, _ = CachePolicy(selector=TurnSelection(1, target=target)).process(payload(WORKED))
    assert fields(new) == {"drop_message": {"4": dropped}}


def test_turn_selection_keeps_count_newest_turns_and_plain_assistant_messages_expire_with_their_turn():
    messages = [{"role": "user", "content": "task"}, {"role": "assistant", "content": "plan"}, call("A"),
                result("A"), call(["B", "C"]), result("C"), result("B"), call("D"), result("D")]
    new, _ = CachePolicy(selector=TurnSelection(2, target="both")).process(payload(messages))
    # turn 1 = messages 0..3, turn 2 = 4..6, turn 3 = 7..8; at turn 3 only turn 1 is older than the newest 2
    assert fields(new) == {"drop_message": {"8": [1, 2, 3]}}


def test_trigger_schedule_after_and_every():
    messages = [{"role": "user", "content": "task"}]
    for i in range(6):
        messages += [call(str(i)), result(str(i))]
    # boundaries (turns 1..6) are messages 2, 4, ..., 12; the trigger fires at turns 3 and 5
    new, _ = CachePolicy(trigger=TurnTrigger(after=3, every=2), selector=TurnSelection(1)).process(payload(messages))
    assert fields(new) == {"drop_message": {"6": [2, 4], "10": [6, 8]}}
    once, _ = CachePolicy(trigger=TurnTrigger(after=3, every=None), selector=TurnSelection(1)).process(
        payload(messages))
    assert fields(once) == {"drop_message": {"6": [2, 4]}}


def test_reposition_only_when_something_new_was_dropped():
    messages = [{"role": "user", "content": "task"}]
    for i in range(4):
        messages += [call(str(i)), result(str(i))]
    policy = CachePolicy(trigger=TurnTrigger(after=2, every=None), selector=TurnSelection(1),
                         reposition=TurnReposition())
    new, _ = policy.process(payload(messages))
    # one drop at turn 2 (message 4); repositioning again at turns 3 and 4 would compact nothing
    assert fields(new) == {"drop_message": {"4": [2]}, "reposition": [4]}


def test_token_trigger_and_token_selection_hand_counted():
    messages = [{"role": "user", "content": "task"}, call("A"), result("A"), call("B"), result("B"), call("C"),
                result("C")]
    counter = FixedCounter(tool=100, other=10)
    # visible prompt at boundaries 2, 4, 6 = 120, 240, 360; the trigger fires at 6 only.
    # Selection from candidates 1..4: drop tool 2 (360 -> 260), tool 4 (-> 160 <= 200).
    policy = CachePolicy(trigger=TokenTrigger(250, counter), selector=TokenSelection(200, counter))
    new, _ = policy.process(payload(messages))
    assert fields(new) == {"drop_message": {"6": [2, 4]}}


@pytest.mark.parametrize("target, dropped", [(340, []), (339, [2]), (240, [2]), (239, [2, 4]), (140, [2, 4]),
                                             (139, [2, 4])])
def test_token_selection_stops_exactly_at_target_tokens(target, dropped):
    messages = [{"role": "user", "content": "task"}, call("A"), result("A"), call("B"), result("B"), call("C"),
                result("C")]
    # visible prompt at boundary 6 = 4 * 10 + 3 * 100 = 340; dropping tool 2 leaves exactly 240, then
    # tool 4 exactly 140. A visible prompt equal to the target is small enough: nothing more is dropped.
    # Below 140 only the current turn's result is left, which is never a candidate.
    policy = CachePolicy(trigger=TurnTrigger(after=3), selector=TokenSelection(target, FixedCounter(100, 10)))
    new, _ = policy.process(payload(messages))
    assert fields(new) == ({"drop_message": {"6": dropped}} if dropped else {})


def test_token_trigger_counts_previous_drops_and_generation_prompt():
    messages = [{"role": "user", "content": "task"}]
    for i in range(4):
        messages += [call(str(i)), result(str(i))]
    counter = FixedCounter(tool=100, other=10, gen=5)
    # prompt at boundary 2k: 10 + k * 110 + 5. Turn 2: 235 > 200 fires, drops message 2 -> 135.
    # Turn 3: 345 - 100 = 245 fires, drops 4. Turn 4: 455 - 200 = 255 fires, drops 6.
    policy = CachePolicy(trigger=TokenTrigger(200, counter), selector=TurnSelection(1))
    new, _ = policy.process(payload(messages))
    assert fields(new) == {"drop_message": {"4": [2], "6": [4], "8": [6]}}


def test_token_reposition_hand_counted():
    messages = [{"role": "user", "content": "task"}]
    for i in range(5):
        messages += [call(str(i)), result(str(i))]
    counter = FixedCounter(tool=100, other=10)
    # drops of 2, 4, 6, 8 at turns 2..5; next position at boundary 2k = 10 + 110k - compacted.
    # Turn 2: 230 <= 300. Turn 3: 340 > 300 -> reposition, compacts 2 and 4 (200).
    # Turn 4: 450 - 200 = 250. Turn 5: 560 - 200 = 360 > 300 -> reposition.
    policy = CachePolicy(selector=TurnSelection(1), reposition=TokenReposition(300, counter))
    new, _ = policy.process(payload(messages))
    assert fields(new) == {"drop_message": {"4": [2], "6": [4], "8": [6], "10": [8]}, "reposition": [6, 10]}


def test_protection_and_excluded_tools_hold_against_any_selector():
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
                call(["A", "M"], ["read_record", "memory"]), result("M"), result("A"),
                {"role": "user", "content": "more"}, call("B"), result("B"), call("C"), result("C")]

    def everything(ctx):
        return range(ctx.boundary + 1)

    new, _ = CachePolicy(selector=everything, exclude_tools=["memory"]).process(payload(messages))
    # system 0, task 1, the memory call 2 and its result 3 are protected; the current turn (the
    # messages after the previous boundary) is never dropped
    assert fields(new) == {"drop_message": {"7": [4], "9": [5, 6, 7]}}
    open_policy = CachePolicy(selector=everything, protect_system=False, protect_first_user=False)
    new, _ = open_policy.process(payload(messages))
    assert fields(new) == {"drop_message": {"7": [0, 1, 2, 3, 4], "9": [5, 6, 7]}}


def test_min_clear_messages_and_tokens():
    messages = [{"role": "user", "content": "task"}]
    for i in range(5):
        messages += [call(str(i)), result(str(i))]
    new, _ = CachePolicy(selector=TurnSelection(1), min_clear_messages=2).process(payload(messages))
    # one expired result per turn: waits until two have accumulated
    assert fields(new) == {"drop_message": {"6": [2, 4], "10": [6, 8]}}
    counter = FixedCounter(tool=100, other=10)
    new, _ = CachePolicy(selector=TurnSelection(1), min_clear_tokens=300, counter=counter).process(payload(messages))
    assert fields(new) == {"drop_message": {"8": [2, 4, 6]}}


def test_user_message_declared_as_completed_turn():
    messages = [{"role": "user", "content": "task"}, call("A"), result("A"), {"role": "user", "content": "next"},
                call("B"), result("B")]
    policy = CachePolicy(selector=TurnSelection(1), reposition=TurnReposition(after=3, every=None))
    new, _ = policy.process(payload(messages), completed_call_message_ids=[2, 3, 5])
    # turns end at 2, 3 (the user message) and 5: at turn 2 the result of turn 1 expires
    assert fields(new) == {"drop_message": {"3": [2]}, "reposition": [5]}


def test_counters_made_inside_a_rule_are_each_counted_with_their_own_layout():
    seen = []

    def selector(ctx):
        # two short-lived counters: the second may reuse the first one's id() once it is freed
        seen.append((ctx.tokens(ApproximateTokenCounter(chars_per_token=1.0, message_overhead=0), [2]),
                     ctx.tokens(ApproximateTokenCounter(chars_per_token=100.0, message_overhead=0), [2])))
        return []

    messages = [{"role": "user", "content": "task"}, call("A"), result("A", "x" * 400), call("B"), result("B")]
    CachePolicy(selector=selector).process(payload(messages))
    assert seen == [(400, 4), (400, 4)]


def test_custom_rules_are_checked():
    def future(ctx):
        return [ctx.boundary + 1]

    with pytest.raises(RuleError, match="returned 3 at boundary 2"):
        CachePolicy(selector=future).process(payload(WORKED))
    with pytest.raises(RuleError, match="must return a bool"):
        CachePolicy(trigger=lambda ctx: 1, selector=TurnSelection(1)).process(payload(WORKED))
    with pytest.raises(RuleError, match="iterable of message ids"):
        CachePolicy(selector=lambda ctx: "2").process(payload(WORKED))


def test_payload_is_deep_copied_and_never_edited():
    original = payload(WORKED)
    snapshot = copy.deepcopy(original)
    new, _ = CachePolicy(selector=TurnSelection(1)).process(original)
    assert original == snapshot
    assert new["messages"] == snapshot["messages"]
    assert new["messages"] is not original["messages"]
    assert new["messages"][1]["tool_calls"][0] is not original["messages"][1]["tool_calls"][0]
    assert {k: v for k, v in new.items() if k not in ("drop_message",)} == snapshot


def test_nothing_decided_leaves_no_akv_fields():
    new, history = CachePolicy().process(payload(WORKED))
    assert new == payload(WORKED)
    assert history.operations == ()


def test_openai_style_puts_fields_in_extra_body():
    new, _ = CachePolicy(selector=TurnSelection(1)).process(payload(WORKED, extra_body={"top_k": 5}),
                                                             api_style="openai")
    assert new["extra_body"] == {"top_k": 5, "drop_message": {"4": [2]}}
    assert "drop_message" not in new


@pytest.mark.parametrize("extra, match", [
    ({"drop_message": {}}, "already has 'drop_message'"),
    ({"reposition": None}, "already has 'reposition'"),
    ({"drop_rule": {"type": "message_drop"}}, "already has 'drop_rule'"),
    ({"extra_body": {"top_k": 1}}, "un-merged 'extra_body'"),
    ({"tools": {"name": "x"}}, "'tools' must be a list"),
])
def test_payload_errors(extra, match):
    with pytest.raises(PayloadError, match=match):
        CachePolicy().process(payload(WORKED, **extra))


def test_openai_style_rejects_akv_fields_inside_extra_body():
    with pytest.raises(PayloadError, match="extra_body already has 'reposition'"):
        CachePolicy().process(payload(WORKED, extra_body={"reposition": [4]}), api_style="openai")
    with pytest.raises(PayloadError, match="api_style"):
        CachePolicy().process(payload(WORKED), api_style="vllm")


@pytest.mark.parametrize("make, match", [
    (lambda: TurnSelection(0), r"TurnSelection.count must be a positive int, got 0"),
    (lambda: TurnSelection(True), r"TurnSelection.count must be a positive int, got True"),
    (lambda: TurnSelection(1, target="user"), r"TurnSelection.target must be one of"),
    (lambda: TurnTrigger(after=0), r"TurnTrigger.after must be a positive int"),
    (lambda: TurnTrigger(every=2.0), r"TurnTrigger.every must be a positive int or None"),
    (lambda: TurnReposition(after=-1), r"TurnReposition.after"),
    (lambda: TokenTrigger(100), r"TokenTrigger needs a token counter"),
    (lambda: TokenSelection(100, counter=object()), r"TokenSelection.counter must have a layout"),
    (lambda: TokenReposition(False, ApproximateTokenCounter()), r"TokenReposition.threshold"),
    (lambda: CachePolicy(trigger=TurnTrigger()), r"trigger needs a selector"),
    (lambda: CachePolicy(selector=5), r"CachePolicy.selector must be callable"),
    (lambda: CachePolicy(min_clear_messages=0), r"min_clear_messages"),
    (lambda: CachePolicy(min_clear_tokens=10), r"needs a token counter"),
    (lambda: CachePolicy(exclude_tools="memory"), r"exclude_tools must be a collection"),
    (lambda: CachePolicy(protect_system=1), r"protect_system must be a bool"),
    (lambda: ApproximateTokenCounter(chars_per_token=0), r"chars_per_token"),
])
def test_constructor_errors(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
