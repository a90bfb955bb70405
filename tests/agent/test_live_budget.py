"""The live-budget preset: over a long random agent run the visible prompt after each boundary's
decision stays under the budget (counted by hand from the counter's layout), every drop is
repositioned at its own anchor, the model's own drop requests are honoured under the budget too,
and bad settings are ConfigErrors."""

from __future__ import annotations

import random

import pytest

from akv.agent import ApproximateTokenCounter, ConfigError, live_budget_policy

from .conversations import TOOLS, call, payload, random_conversation, result
from .test_tool import answer, drop_call

COUNTER = ApproximateTokenCounter()
BUDGET = 400


def visible_after(messages: list, drops: dict[str, list[int]], boundary: int) -> int:
    """Tokens the query after ``boundary`` reads: its prefix and the generation prompt, minus every
    message dropped at an anchor up to ``boundary``."""
    layout = COUNTER.layout(messages, tools=TOOLS)
    hidden = {i for anchor, ids in drops.items() if int(anchor) <= boundary for i in ids}
    return layout.spans[boundary][1] + layout.generation_tokens - sum(
        layout.spans[i][1] - layout.spans[i][0] for i in hidden)


def test_a_long_run_stays_under_the_budget_and_every_drop_is_repositioned() -> None:
    messages = random_conversation(random.Random(7), 80, result_chars=(40, 160))
    sent, _ = live_budget_policy(BUDGET, COUNTER).process(payload(messages))
    drops = sent["drop_message"]
    assert visible_after(messages, {}, len(messages) - 1) > 8 * BUDGET  # the text is far over the budget
    assert sorted(int(a) for a in drops) == sent["reposition"]
    boundaries = [i for i in range(len(messages) - 1)
                  if messages[i]["role"] == "tool" and messages[i + 1]["role"] != "tool"]
    for previous, b in zip([1, *boundaries], boundaries):
        # at most the budget, unless everything before the current turn (but the protected system
        # prompt and task) is already dropped
        floor = visible_after(messages, {str(b): list(range(2, previous + 1))}, b)
        assert visible_after(messages, drops, b) <= max(BUDGET, floor), b
    # drops wait for the budget: fewer anchors than turns, each bringing the live length to the low water
    assert len(drops) < len(boundaries) // 2
    assert sum(visible_after(messages, drops, int(a)) <= 0.75 * BUDGET for a in drops) > len(drops) // 2


def test_the_models_request_is_honoured_under_the_budget() -> None:
    policy = live_budget_policy(10_000, COUNTER)
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}, call("A"), result("A"),
                call("B"), result("B"), drop_call("D", [3])]
    receipt = policy.drop_context_tool().execute(messages[-1]["tool_calls"][0]["function"]["arguments"], messages)
    messages.append(answer("D", receipt))
    sent, _ = policy.process(payload(messages))
    assert sent["drop_message"] == {"7": [3]} and sent["reposition"] == [7]


@pytest.mark.parametrize("kwargs, needle", [
    ({"live_token_budget": 0}, "live_token_budget"),
    ({"live_token_budget": 100, "low_water": 1.5}, "low_water"),
    ({"live_token_budget": 100, "counter": None}, "counter"),
])
def test_bad_settings_are_config_errors(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        live_budget_policy(**{"counter": COUNTER, **kwargs})
