"""Trajectories: seeded generation, JSONL round trip, the demo-run loader, and chat messages whose
token counts under a real chat template equal the requested ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from akv.agent import ApproximateTokenCounter
from akv.agent.messages import parse_conversation
from bench.agent_replay.chat import Filler, realize, skeleton
from bench.agent_replay.trajectories import (
    BROWSE,
    SWE,
    MessageSpec,
    Trajectory,
    TrajectoryError,
    default_set,
    from_messages,
    generate,
    load_demo_run,
    load_jsonl,
    to_jsonl,
)


def test_generation_is_deterministic_and_follows_the_statistics():
    a, b = generate(BROWSE, 5), generate(BROWSE, 5)
    assert a == b and generate(BROWSE, 6) != a
    assert BROWSE.turns[0] <= len(a.calls) - 1 <= BROWSE.turns[1]
    tools = [s for s in a.specs if s.role == "tool"]
    low, high = BROWSE.tool_result.low, BROWSE.tool_result.high
    assert all(low + BROWSE.message_overhead <= s.tokens <= high + BROWSE.message_overhead for s in tools)
    widths = {s.calls for s in a.specs if s.role == "assistant"} - {0}
    assert widths <= {1, 2, 3, 4} and max(widths) > 1
    assert a.specs[-1].role == "assistant" and a.specs[-1].calls == 0
    for s in a.specs:
        if s.role == "assistant":
            assert s.tokens == a.generation_tokens + s.generated + 1


def test_default_set_is_long():
    for t in default_set():
        assert len(t.calls) >= 30
        assert t.total_tokens > 100_000


def test_jsonl_round_trip(tmp_path: Path):
    trajectories = [generate(SWE, 1, "a", turns=4), generate(BROWSE, 2, "b", turns=3)]
    to_jsonl(trajectories, tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl") == trajectories


def test_jsonl_minimal_lines_and_errors(tmp_path: Path):
    path = tmp_path / "run.jsonl"
    rows = [{"role": "system", "tokens": 10}, {"role": "user", "tokens": 5},
            {"role": "assistant", "tokens": 9, "generated": 5, "calls": 1}, {"role": "tool", "tokens": 30},
            {"role": "assistant", "tokens": 8, "generated": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (t,) = load_jsonl(path)
    assert t.name == "run" and t.calls == (2, 4) and t.specs[3] == MessageSpec("tool", 30)
    path.write_text(json.dumps({"role": "tool", "tokens": 3}) + "\n")
    with pytest.raises(TrajectoryError, match="message 0 is a tool result without a pending call"):
        load_jsonl(path)
    path.write_text(json.dumps({"role": "user", "tokens": 3, "colour": 1}) + "\n")
    with pytest.raises(TrajectoryError, match="unknown fields"):
        load_jsonl(path)


def test_assistant_must_hold_its_generation_prompt():
    with pytest.raises(TrajectoryError, match="message 1 has 4 tokens"):
        Trajectory("t", (MessageSpec("user", 3), MessageSpec("assistant", 4, generated=2)), 3)


def test_skeleton_is_a_valid_tool_conversation():
    t = generate(BROWSE, 3, turns=6)
    conversation = parse_conversation(skeleton(t))
    assert [len(b.results) for b in conversation.batches] == [s.calls for s in t.specs if s.calls]


def test_realize_with_the_approximate_counter():
    t = generate(SWE, 4, turns=5)
    counter = ApproximateTokenCounter()
    messages = realize(t, counter, Filler.for_approximate())
    assert list(counter.layout(messages).message_tokens) == [s.tokens for s in t.specs]


def test_realize_with_a_chat_template_counts_exactly(tiny_counter):
    t = generate(BROWSE, 1, turns=4)
    messages = realize(t, tiny_counter, Filler.for_tokenizer(tiny_counter.tokenizer))
    layout = tiny_counter.layout(messages)
    assert list(layout.message_tokens) == [s.tokens for s in t.specs]
    assert parse_conversation(messages).boundaries  # real tool calls and results


def test_realize_refuses_messages_smaller_than_their_scaffolding(tiny_counter):
    t = Trajectory("t", (MessageSpec("system", 1), MessageSpec("user", 20), MessageSpec("assistant", 9, 5)), 3)
    with pytest.raises(TrajectoryError, match="message 0 .* scaffolding"):
        realize(t, tiny_counter, Filler.for_tokenizer(tiny_counter.tokenizer))


def _write_demo_run(root: Path, messages: list[dict], replies: list[tuple[int, dict, int]]) -> Path:
    """The demo's layout: steps/NN/{payload_before,reply,usage}.json (examples/akv_demo/artifacts.py)."""
    for step, (n, reply, completion) in enumerate(replies, 1):
        folder = root / "steps" / f"{step:02d}"
        folder.mkdir(parents=True)
        (folder / "payload_before.json").write_text(json.dumps({"model": "m", "messages": messages[:n]}))
        (folder / "reply.json").write_text(json.dumps({"message": reply, "finish_reason": "stop"}))
        (folder / "usage.json").write_text(json.dumps({"prompt_tokens": 1, "completion_tokens": completion}))
    return root


def test_demo_run_loader(tmp_path: Path):
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_record", "arguments": "{\"record_id\": \"R-1\"}"}}]}
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Where?"}, call,
                {"role": "tool", "tool_call_id": "c1", "content": "record text " * 20}]
    final = {"role": "assistant", "content": "It ended up in Busan."}
    run = _write_demo_run(tmp_path / "runs" / "demo1", messages, [(2, call, 6), (4, final, 7)])
    counter = ApproximateTokenCounter()
    t = load_demo_run(run, counter)
    assert t.name == "demo1" and t.calls == (2, 4)
    assert [s.tokens for s in t.specs] == list(counter.layout(messages + [final]).message_tokens)
    assert (t.specs[2].generated, t.specs[4].generated) == (6, 7)
    assert t.messages == tuple(messages + [final])


def test_from_messages_defaults_generated_to_the_reply_body():
    counter = ApproximateTokenCounter()
    messages = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y" * 80}]
    t = from_messages("t", messages, counter)
    assert t.specs[1].generated == t.specs[1].tokens - counter.generation_tokens - 1
