"""The tool-use conversation both servers' Anthropic tests send: a user question, then per turn an
assistant tool call and its result, as Anthropic messages and as the same OpenAI-path messages."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

SCHEMA = {"type": "object", "properties": {"id": {"type": "string"}}}
TOOLS = [{"name": "read_record", "description": "read a record", "input_schema": SCHEMA}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_record", "description": "read a record",
                                                  "parameters": SCHEMA}}]
QUESTION = "Where is shipment 7? Start at record 0."


def record(i: int) -> str:
    return f"record {i}: {i * 3 + 2} crates, seal {i * 131 % 997}; next {i + 1}"


def anthropic_messages(n_turns: int, thought: Callable[[int], str] | None = None) -> list[dict[str, Any]]:
    """``n_turns`` tool uses as Anthropic messages; ``thought(i)``: a thinking block leads turn ``i``."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for i in range(n_turns):
        thinking = [] if thought is None else [{"type": "thinking", "thinking": thought(i), "signature": "local"}]
        messages.append({"role": "assistant", "content": [
            *thinking, {"type": "tool_use", "id": f"toolu_{i}", "name": "read_record", "input": {"id": str(i)}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": record(i)}]})
    return messages


def openai_messages(n_turns: int, reasoning: Callable[[int], str] | None = None) -> list[dict[str, Any]]:
    """The same conversation as OpenAI messages (0: user; turn i: assistant 2i+1, tool 2i+2);
    ``reasoning(i)``: turn ``i``'s ``reasoning_content``."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for i in range(n_turns):
        call: dict[str, Any] = {"role": "assistant", "tool_calls": [{"id": f"toolu_{i}", "type": "function",
                                "function": {"name": "read_record", "arguments": json.dumps({"id": str(i)})}}]}
        if reasoning is not None:
            call = {"role": "assistant", "content": None, "reasoning_content": reasoning(i), **call}
        messages.append(call)
        messages.append({"role": "tool", "tool_call_id": f"toolu_{i}", "content": record(i)})
    return messages
