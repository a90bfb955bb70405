"""What `process()` hands back is independent of the caller's objects, and the history's prefix digest
is the documented chain over the messages as they were at the call."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
import random

import pytest

from akv.agent import (
    CacheOperationHistory,
    CachePolicy,
    HistoryError,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)

from .conversations import payload, random_conversation

POLICY = CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(1), reposition=TurnReposition(after=2, every=2))


def reference_digest(messages: list) -> str:
    """The chain the history format documents, written out with hashlib and json directly."""
    digest = hashlib.sha256(b"akv.agent message prefix").hexdigest()
    for message in messages:
        encoded = json.dumps(message, sort_keys=True, separators=(",", ":")).encode("ascii")
        digest = hashlib.sha256(digest.encode("ascii") + encoded).hexdigest()
    return digest


def containers(value: object) -> dict[int, object]:
    """Every dict and list reachable from `value`, by id (the objects are kept alive in the result)."""
    found: dict[int, object] = {}
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            found[id(item)] = item
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


def rich_payload(messages: list) -> dict:
    return payload(messages, chat_template_kwargs={"enable_thinking": False, "extra": {"keys": [1, 2]}},
                   response_format={"type": "json_object"}, stop=["</done>"])


def conversation(turns: int, seed: int = 3) -> list[dict]:
    return random_conversation(random.Random(seed), turns)


def batch_cut(messages: list, fraction: float) -> int:
    """A message count that ends on a completed tool-call batch, about `fraction` into `messages`."""
    ends = [i + 1 for i, m in enumerate(messages)
            if m["role"] == "tool" and (i + 1 == len(messages) or messages[i + 1]["role"] != "tool")]
    return ends[int(fraction * (len(ends) - 1))]


@pytest.mark.parametrize("api_style", ["sglang", "openai"])
def test_returned_payload_shares_no_container_with_the_input(api_style):
    messages = conversation(6)
    extra = {"extra_body": {"top_k": 5, "nested": {"a": [1]}}} if api_style == "openai" else {}
    original = {**rich_payload(messages), **extra}
    _, first = POLICY.process({**rich_payload(messages[:batch_cut(messages, 0.5)]), **extra}, api_style=api_style)
    for history in (None, first):
        new, _ = POLICY.process(original, history, api_style=api_style)
        assert (new["extra_body"] if api_style == "openai" else new)["drop_message"]
        shared = containers(new).keys() & containers(original).keys()
        assert not shared, [containers(new)[i] for i in shared]


def test_history_snapshot_shares_no_container_with_the_input_or_the_returned_payload():
    messages = conversation(5)
    new, history = POLICY.process(payload(messages))
    snapshot = containers(history.snapshot)
    assert not snapshot.keys() & containers(messages).keys()
    assert not snapshot.keys() & containers(new).keys()


def test_editing_the_returned_payload_in_place_does_not_disturb_the_history():
    messages = conversation(4)
    new, history = POLICY.process(payload(messages))
    for message in new["messages"]:
        message["content"] = "edited by the caller"
        message.get("tool_calls", [{}])[0]["function"] = {"name": "other", "arguments": "{}"}
    longer = conversation(6)
    assert longer[:len(messages)] == messages
    again, _ = POLICY.process(payload(longer), history)
    expected, _ = POLICY.process(payload(longer))
    assert again == expected
    assert history.prefix_digest == reference_digest(messages)


def test_prefix_digest_is_the_documented_chain_on_every_path():
    messages = conversation(8)
    a, b, c = batch_cut(messages, 0.25), batch_cut(messages, 0.5), len(messages)
    _, cold = POLICY.process(payload(messages[:a]))
    _, chained = POLICY.process(payload(messages[:b]), cold)  # cold's digest has not been read yet
    _, chained_again = POLICY.process(payload(messages[:c]), chained)
    assert chained_again.prefix_digest == reference_digest(messages[:c])
    assert chained.prefix_digest == reference_digest(messages[:b])
    assert cold.prefix_digest == reference_digest(messages[:a])
    _, after_read = POLICY.process(payload(messages[:c]), cold)  # cold's digest has been read now
    assert after_read.prefix_digest == reference_digest(messages[:c])
    loaded = CacheOperationHistory.from_json(cold.to_json())
    _, from_loaded = POLICY.process(payload(messages[:c]), loaded)
    assert from_loaded.prefix_digest == reference_digest(messages[:c])
    assert json.loads(from_loaded.to_json())["prefix_digest"] == reference_digest(messages[:c])


def test_prefix_digest_covers_the_messages_as_they_were_at_the_call():
    messages = conversation(3)
    before = copy.deepcopy(messages)
    _, history = POLICY.process(payload(messages))
    messages[1]["content"] = "changed after the call"
    messages.append({"role": "user", "content": "appended after the call"})
    assert history.prefix_digest == reference_digest(before)
    loaded = CacheOperationHistory.from_json(history.to_json())
    with pytest.raises(HistoryError, match="differ"):
        POLICY.process(payload(messages), loaded)


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy, lambda h: pickle.loads(pickle.dumps(h))])
def test_a_history_whose_digest_was_not_read_copies_and_compares(clone):
    messages = conversation(4)
    _, history = POLICY.process(payload(messages))
    _, twin = POLICY.process(payload(messages))
    cloned = clone(history)
    assert cloned == history == twin
    assert hash(cloned) == hash(twin)
    assert cloned.prefix_digest == reference_digest(messages)
    new, _ = POLICY.process(payload(conversation(5)), cloned)
    expected, _ = POLICY.process(payload(conversation(5)))
    assert new == expected
