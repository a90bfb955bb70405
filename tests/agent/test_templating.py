"""`akv.agent.templating`: the template inputs SGLang 0.5.16 builds from a chat payload. Expected values
are written by hand from SGLang's pydantic models (protocol.py `Tool`/`Function`/`ToolCall`/message
params, `model_dump()`) and serving_chat.py `_apply_jinja_template` / `process_content_for_template_format`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from akv.agent import PayloadError
from akv.agent.templating import (
    TemplateInputError,
    sglang_template_inputs,
    template_content_format,
    template_messages,
    template_tools,
)

PARAMS = {"type": "object", "properties": {"id": {"type": "string"}}}


def test_tools_are_their_pydantic_model_dump_in_field_order():
    tools = [
        {"type": "function", "function": {"name": "read", "description": "Read one.", "parameters": PARAMS,
                                          "strict": True, "x-vendor": 1}},
        {"function": {"name": "bare"}},
        {"type": "function", "defer_loading": True, "function": {"name": "late", "parameters": PARAMS}},
        {"type": "function", "defer_loading": False, "function": {"name": "own", "defer_loading": True}},
    ]
    dumped = template_tools(tools)
    # key order matters: templates render tools with tojson
    assert [json.dumps(t) for t in dumped] == [
        '{"type": "function", "function": {"description": "Read one.", "name": "read", "parameters": '
        '{"type": "object", "properties": {"id": {"type": "string"}}}, "strict": true}, "defer_loading": null}',
        '{"type": "function", "function": {"description": null, "name": "bare", "parameters": null, '
        '"strict": false}, "defer_loading": null}',
        '{"type": "function", "function": {"description": null, "name": "late", "parameters": '
        '{"type": "object", "properties": {"id": {"type": "string"}}}, "strict": false, "defer_loading": true}, '
        '"defer_loading": true}',
        '{"type": "function", "function": {"description": null, "name": "own", "parameters": null, '
        '"strict": false, "defer_loading": true}, "defer_loading": false}',
    ]


def test_tool_choice_selects_the_rendered_tools():
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b")]
    assert [t["function"]["name"] for t in template_tools(tools)] == ["a", "b"]
    assert [t["function"]["name"] for t in template_tools(tools, "required")] == ["a", "b"]
    assert template_tools(tools, "none") is None
    assert template_tools([], "auto") is None
    assert template_tools(None) is None
    named = template_tools(tools, {"type": "function", "function": {"name": "b"}})
    assert [t["function"]["name"] for t in named] == ["b"]


def test_messages_are_dumped_and_normalised_like_sglang():
    messages = [
        {"role": "System", "content": "Be brief.", "x-note": "dropped"},
        {"role": "user", "content": "go", "name": "alice"},
        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"id": "A"}'}},
            {"id": "c2", "index": 1, "function": {"name": "read", "arguments": {"id": "B"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": None},
        {"role": "tool", "tool_call_id": "c2", "name": None,
         "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    ]
    original = copy.deepcopy(messages)
    prepared = template_messages(messages)
    assert prepared == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "index": None, "type": "function", "function": {"name": "read", "arguments": {"id": "A"}}},
            {"id": "c2", "index": 1, "type": "function", "function": {"name": "read", "arguments": {"id": "B"}}}]},
        {"role": "tool", "content": "", "tool_call_id": "c1"},
        {"role": "tool", "content": "part one part two", "tool_call_id": "c2"},
    ]
    assert [list(m) for m in prepared][2] == ["role", "content", "reasoning_content", "tool_calls"]
    assert messages == original


def test_list_content_per_template_content_format():
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    messages = [{"role": "system", "content": parts},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "ok"}]},
                {"role": "tool", "tool_call_id": "c", "content": parts}]
    assert template_messages(messages, content_format="string") == [
        {"role": "system", "content": "Be  brief."},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "Be  brief.", "tool_call_id": "c"},
    ]
    openai = template_messages(messages, content_format="openai")
    assert openai == [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "tool", "tool_call_id": "c", "content": "Be  brief."},
    ]
    assert list(openai[2]) == ["role", "tool_call_id", "content"]  # content moves last in this path


def test_template_inputs_bundle_messages_and_tools():
    inputs = sglang_template_inputs([{"role": "user", "content": "hi"}],
                                    [{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    assert inputs.messages == ({"role": "user", "content": "hi"},)
    assert inputs.tools is None


@pytest.mark.parametrize(("messages", "tools", "field"), [
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}], None,
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}], None,
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None, "messages[0].content[0]"),
    ([{"role": "user", "content": None}], None, "messages[0].content"),
    ([{"role": "robot", "content": "x"}], None, "messages[0].role"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
     "tools[0].function.strict"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": 3}}], "tools[0].function.name"),
    ([{"role": "user", "content": "x"}], [{"type": "function"}], "tools[0]"),
])
def test_bad_inputs_name_the_field(messages, tools, field):
    with pytest.raises(TemplateInputError) as info:
        sglang_template_inputs(messages, tools)
    assert isinstance(info.value, PayloadError)
    assert info.value.field == field
    assert str(info.value).startswith(field + ": ")


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
    ("{% for message in messages %}{% for c in message['content'] %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for msg in messages %}{% for c in msg.content | reverse %}{{ c }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for c in m.content[1:] %}{{ c }}{% endfor %}{% endfor %}", "openai"),
    ("{% for x in messages %}{% for c in x.content %}{{ c }}{% endfor %}{% endfor %}", "string"),
    ("{# vision model #}{% for m in messages %}{{ m.content }}{% endfor %}", "openai"),
])
def test_content_format_detection(template, expected):
    jinja2 = pytest.importorskip("jinja2")
    assert template_content_format(template, jinja2.Environment().parse(template)) == expected


def test_unparsable_template_is_string_format():
    assert template_content_format("{% for %}", None) == "string"


def test_module_is_standard_library_only():
    code = ("import sys, json; before = set(sys.modules); import akv.agent.templating; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    added = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout)
    assert {m.split(".")[0] for m in added} - set(sys.stdlib_module_names) <= {"akv"}
    assert not [m for m in added if m.startswith("akv.system")]
