"""Builders for tool-using conversations, used by the agent tests."""

from __future__ import annotations

import json
import random
from typing import Any

TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": {"type": "object", "properties": {}}}}
         for name in ("read_record", "search", "memory")]


def call(call_ids: str | list[str], name: str | list[str] = "read_record") -> dict[str, Any]:
    """An assistant message calling one tool per id."""
    ids = [call_ids] if isinstance(call_ids, str) else call_ids
    names = [name] * len(ids) if isinstance(name, str) else name
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{i}", "type": "function",
                            "function": {"name": n, "arguments": json.dumps({"id": i})}}
                           for i, n in zip(ids, names)]}


def result(call_id: str, content: str | None = None) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{call_id}", "content": content or f"record {call_id}"}


def random_conversation(rng: random.Random, turns: int, *, system: bool = True,
                        result_chars: tuple[int, int] = (10, 60)) -> list[dict[str, Any]]:
    """A system prompt, a user task, then `turns` tool-call batches with occasional user and plain
    assistant messages; results answer their calls in a random order."""
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": "You are an agent."})
    messages.append({"role": "user", "content": "Solve the task."})
    counter = 0
    for _ in range(turns):
        if rng.random() < 0.15:
            messages.append({"role": "user", "content": "Keep going."})
        if rng.random() < 0.15:
            messages.append({"role": "assistant", "content": "Thinking aloud."})
        width = rng.randint(1, 3)
        ids = [str(counter + k) for k in range(width)]
        counter += width
        names = [rng.choice(["read_record", "search", "memory"]) for _ in ids]
        messages.append(call(ids, names))
        order = ids[:]
        rng.shuffle(order)
        for i in order:
            messages.append(result(i, "x" * rng.randint(*result_chars)))
    return messages


def payload(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": messages, "tools": TOOLS, "temperature": 0.0, **extra}
