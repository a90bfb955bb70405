"""`ResultSelection(k)` keeps the k newest tool results, counted as results (not turns), checked
against a brute force over random conversations with parallel calls."""

from __future__ import annotations

import json
import random

import pytest

from akv.agent import CachePolicy, ConfigError, ResultSelection, TurnSelection


def _batch(first: int, width: int) -> list[dict]:
    ids = [f"c{first + k}" for k in range(width)]
    calls = [{"id": i, "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": i})}}
             for i in ids]
    return [{"role": "assistant", "content": None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": i, "content": f"result {i}"} for i in ids]


def _conversation(widths: list[int], rng: random.Random | None = None) -> list[dict]:
    messages = [{"role": "system", "content": "agent"}, {"role": "user", "content": "task"}]
    first = 0
    for width in widths:
        if rng is not None and rng.random() < 0.2:
            messages.append({"role": "user", "content": "go on"})
        messages.extend(_batch(first, width))
        first += width
    return messages


def _payload(messages: list[dict]) -> dict:
    return {"model": "m", "messages": messages}


def _brute_force(messages: list[dict], keep: int) -> dict[int, list[int]]:
    """Per batch end: the tool results older than the `keep` newest up to it, minus those dropped
    earlier and those of the batch just completed."""
    roles = [m["role"] for m in messages]
    ends = [i for i, r in enumerate(roles) if r == "tool" and (i + 1 == len(roles) or roles[i + 1] != "tool")]
    dropped: set[int] = set()
    out = {}
    for end in ends:
        batch_start = max(i for i in range(end + 1) if roles[i] == "assistant")
        results = [i for i in range(end + 1) if roles[i] == "tool"]
        expired = [i for i in results[:-keep] if i not in dropped and i < batch_start]
        if expired:
            out[end] = expired
            dropped.update(expired)
    return out


def test_seven_turns_of_two_calls_keep_12_drops_the_two_oldest_results():
    messages = _conversation([2] * 7)
    sent, _ = CachePolicy(selector=ResultSelection(12)).process(_payload(messages))
    assert sent["drop_message"] == {str(len(messages) - 1): [3, 4]}
    assert [messages[i]["content"] for i in (3, 4)] == ["result c0", "result c1"]
    by_turns, _ = CachePolicy(selector=TurnSelection(12)).process(_payload(messages))
    assert "drop_message" not in by_turns


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_parallel_calls(seed):
    rng = random.Random(seed)
    widths = [rng.randint(1, 4) for _ in range(rng.randint(1, 14))]
    messages = _conversation(widths, rng)
    keep = rng.randint(1, 9)
    sent, _ = CachePolicy(selector=ResultSelection(keep)).process(_payload(messages))
    got = {int(k): v for k, v in sent.get("drop_message", {}).items()}
    assert got == _brute_force(messages, keep)


def test_incremental_calls_decide_the_same_as_one_call():
    messages = _conversation([3, 1, 2, 3, 2, 1, 3])
    policy = CachePolicy(selector=ResultSelection(4))
    history = None
    for end in range(2, len(messages) + 1):
        if messages[end - 1]["role"] == "tool" and (end == len(messages) or messages[end]["role"] != "tool"):
            sent, history = policy.process(_payload(messages[:end]), history)
    whole, _ = policy.process(_payload(messages))
    assert sent["drop_message"] == whole["drop_message"]


@pytest.mark.parametrize("count", [0, -1, True, 2.0])
def test_count_must_be_a_positive_int(count):
    with pytest.raises(ConfigError, match="ResultSelection.count"):
        ResultSelection(count)


def test_a_user_boundary_counts_the_results_before_it():
    messages = _conversation([2]) + [{"role": "user", "content": "go on"}]
    sent, _ = CachePolicy(selector=ResultSelection(1)).process(_payload(messages), completed_call_message_ids=[4, 5])
    assert sent["drop_message"] == {"5": [3]}
