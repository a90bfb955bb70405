"""A gpt-oss tool conversation and its chat-template inputs as SGLang's chat path builds them."""

from __future__ import annotations

import json
from typing import Any

from akv.agent.templating import sglang_template_inputs

TOOLS = [
    {"type": "function", "function": {"name": "read_record", "description": "Read one record by id",
                                      "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                                                     "required": ["id"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the records",
                                      "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]


def call(i: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# 0 system, 1 user, 2 call with analysis in content, 3 result, 4 two calls in one message, 5-6 their
# results, 7 final answer, 8 user, 9 call without analysis, 10 result.
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Read A7, then search for B2."},
    {"role": "assistant", "content": "I should read A7 first.", "tool_calls": [call(1, "read_record", {"id": "A7"})]},
    {"role": "tool", "tool_call_id": "c1", "content": "record A7: 42"},
    {"role": "assistant", "content": None, "tool_calls": [call(2, "search", {"q": "B2"}),
                                                          call(3, "read_record", {"id": "C3"})]},
    {"role": "tool", "tool_call_id": "c2", "content": "B2 is \"blue\""},
    {"role": "tool", "tool_call_id": "c3", "content": "record C3: 7"},
    {"role": "assistant", "content": "A7 is 42 and B2 is blue."},
    {"role": "user", "content": "And C3?"},
    {"role": "assistant", "content": None, "tool_calls": [call(4, "read_record", {"id": "C3"})]},
    {"role": "tool", "tool_call_id": "c4", "content": "record C3: 7"},
]


def template_inputs(n_messages: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Messages and tools of the first ``n_messages`` messages, as SGLang renders them."""
    inputs = sglang_template_inputs(MESSAGES[:n_messages], TOOLS)
    assert inputs.tools is not None
    return list(inputs.messages), list(inputs.tools)


def rendered_ids(tokenizer: Any, n_messages: int) -> list[int]:
    """The template's own render (transformers' apply_chat_template), encoded as SGLang does."""
    messages, tools = template_inputs(n_messages)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
