"""Request normalisation: the template sees messages and tools exactly as SGLang 0.5.16 hands them over
(expected values written by hand from SGLang's serving_chat / protocol models)."""

from __future__ import annotations

from typing import Any

import pytest

from akv.system.reference_server.protocol import RequestError, parse_chat_request

TOOL = {"type": "function", "function": {"name": "read_record", "description": "Read one record.",
                                         "parameters": {"type": "object"}, "x-extra": 1}}


def parse(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_chat_request(body, "m")


def test_messages_are_normalised_like_sglang() -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "go", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_record", "arguments": '{"record_id": "A"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "part one"},
                                                           {"type": "text", "text": "part two"}]},
    ]
    request = parse_chat_request({"model": "m", "messages": messages}, "m")
    # string content format: text parts join with a space for every role; the tool call keeps its
    # model_dump() shape (nested None "index" is not stripped)
    assert request.messages == (
        {"role": "system", "content": "Be  brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "index": None, "type": "function",
             "function": {"name": "read_record", "arguments": {"record_id": "A"}}}]},
        {"role": "tool", "content": "part one part two", "tool_call_id": "c1"},
    )
    kept = parse_chat_request({"model": "m", "messages": messages}, "m", content_format="openai").messages
    assert kept[0] == {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}
    assert kept[3] == {"role": "tool", "tool_call_id": "c1", "content": "part one part two"}


def test_tools_are_rendered_as_sglang_dumps_them() -> None:
    assert parse(tools=[TOOL]).tools == ({
        "type": "function",
        "function": {"description": "Read one record.", "name": "read_record", "parameters": {"type": "object"},
                     "strict": False},
        "defer_loading": None,
    },)
    bare = parse(tools=[{"type": "function", "function": {"name": "f"}, "defer_loading": True}]).tools
    assert bare == ({"type": "function", "defer_loading": True, "function": {
        "description": None, "name": "f", "parameters": None, "strict": False, "defer_loading": True}},)
    assert parse(tools=[TOOL], tool_choice="none").tools == ()


def test_usage_chunk_policy() -> None:
    assert parse(stream=True).include_usage is False
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert parse(stream=True, reposition=[0]).include_usage is True
    assert parse(reposition=[0]).is_context and not parse().is_context


def test_null_or_empty_fields_are_a_plain_request_as_on_the_sglang_server() -> None:
    assert not parse(drop_message={}).is_context
    assert not parse(drop_message=None, reposition=None).is_context
    assert parse(stream=True, drop_message={}).include_usage is False


@pytest.mark.parametrize(("fields", "field"), [
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"stop": ["a", ""]}, "stop"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"seed": 1.5}, "seed"),
    ({"top_p": 0}, "top_p"),
])
def test_invalid_fields_are_named(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as info:
        parse(**fields)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")
