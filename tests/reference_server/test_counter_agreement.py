"""The client's ChatTemplateTokenCounter counts exactly the prompt tokens the reference server (the CPU
stand-in for SGLang 0.5.16) reports for the same payload with tools: both render the template inputs
SGLang builds (`akv.agent.templating`), so tools carry their pydantic `model_dump()` fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from akv.agent import send_chat_request
from akv.agent.tokens import ChatTemplateTokenCounter

pytest.importorskip("transformers")

MODEL = "tiny-test"
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": {"type": "object", "properties": {}}}}
         for name in ("read_record", "search", "memory")]
# SGLang's Tool.model_dump() of TOOLS[0], written by hand from its pydantic models.
DUMPED_TOOL = ('{"type": "function", "function": {"description": "read_record tool", "name": "read_record", '
               '"parameters": {"type": "object", "properties": {}}, "strict": false}, "defer_loading": null}')


def call(ids: list[str], name: str = "read_record") -> dict[str, Any]:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{i}", "type": "function",
                            "function": {"name": name, "arguments": json.dumps({"id": i})}} for i in ids]}


def result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{call_id}", "content": content}


# The payload of tests/agent/test_served.py (the H200 check against SGLang).
MESSAGES = [{"role": "system", "content": "You are a careful agent."},
            {"role": "user", "content": "Read records A, B and C, then answer."},
            call(["A", "B"]), result("B", "record B: the value is 7"), result("A", "record A: the value is 5"),
            call(["C"], "search"), result("C", "search result C: nothing found"),
            {"role": "assistant", "content": "Still looking."}, {"role": "user", "content": "Continue."},
            call(["D"], "memory"), result("D", "memory D: stored")]


@pytest.fixture(scope="module")
def counter(served: Any) -> ChatTemplateTokenCounter:
    return ChatTemplateTokenCounter.from_pretrained(str(served.model_dir))  # as tests/agent/test_served.py


@pytest.mark.parametrize("n", [2, 5, 7, len(MESSAGES)])
@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
def test_counter_equals_served_prompt_tokens_with_tools(served: Any, counter: ChatTemplateTokenCounter,
                                                        n: int, kwargs: dict[str, Any] | None) -> None:
    payload: dict[str, Any] = {"model": MODEL, "messages": MESSAGES[:n], "tools": TOOLS, "max_tokens": 1}
    if kwargs is not None:
        payload["chat_template_kwargs"] = kwargs
    layout = counter.layout(MESSAGES[:n], tools=TOOLS, chat_template_kwargs=kwargs)
    reply = send_chat_request(served.url, payload, timeout=120)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == layout.prompt_tokens


def test_counter_renders_tools_in_their_served_shape(counter: ChatTemplateTokenCounter) -> None:
    text = counter.render(MESSAGES[:2], tools=TOOLS[:1]).text
    assert f"<tools>\n{DUMPED_TOOL}\n</tools>" in text


def test_list_content_and_tool_choice_none_count_as_served(served: Any, counter: ChatTemplateTokenCounter) -> None:
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                *MESSAGES[1:5]]
    messages[3] = {**messages[3], "content": [{"type": "text", "text": "record B:"}, {"type": "text", "text": "7"}]}
    for tool_choice in ("auto", "none"):
        payload = {"model": MODEL, "messages": messages, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 1}
        reply = send_chat_request(served.url, payload, timeout=120)
        rendered = counter.render(messages, tools=TOOLS, tool_choice=tool_choice)
        assert reply.usage.prompt_tokens == len(rendered.token_ids), tool_choice
