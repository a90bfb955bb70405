"""The chat-template inputs SGLang 0.5.16 builds from an OpenAI chat payload (standard library only).

`sglang_template_inputs` returns the `messages` and `tools` exactly as SGLang's
`OpenAIServingChat._apply_jinja_template` passes them to `tokenizer.apply_chat_template`: each message
is its pydantic `model_dump()` (unknown keys dropped, unset fields None), assistant tool-call arguments
are JSON-decoded, `content: null` becomes "", list content is flattened or kept depending on the
template's content format, top-level None keys are stripped, and a tool message's text parts are
joined with a space; each tool is its `Tool.model_dump()` (`description`/`parameters` default None,
`strict` False, `defer_loading` None and propagated into the function). Only text (and, in
assistant messages, thinking) content parts are supported. Values SGLang's pydantic models would
coerce (e.g. `"strict": "yes"`) are rejected here instead."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv.agent.errors import PayloadError

CONTENT_FORMATS = ("string", "openai")
GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder")
_MESSAGE_FIELDS = ("content", "tool_call_id", "name", "reasoning_content", "tool_calls", "tools")
_THINKING_TYPES = ("thinking", "reasoning")
_CONTENT_LOOP_NAMES = ("message", "msg", "m")
_MULTIMODAL_WORDS = ("image", "audio", "video", "vision")


class TemplateInputError(PayloadError):
    """A message or tool cannot be turned into template inputs; `field` is its JSON path (e.g.
    `messages[2].tool_calls[0].function.arguments`), `value` the offending value."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        super().__init__(f"{field}: {problem} (got {value!r})", field=field)
        self.value = value
        self.problem = problem


@dataclass(frozen=True)
class TemplateInputs:
    """What the chat template receives: `messages`, and `tools` (None when no tool is rendered)."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None


def sglang_template_inputs(messages: Sequence[Mapping[str, Any]],
                           tools: Sequence[Mapping[str, Any]] | None = None, *,
                           tool_choice: Any = None, content_format: str = "string") -> TemplateInputs:
    """Messages and tools of a chat payload as SGLang 0.5.16 hands them to the chat template.

    `tool_choice` is the payload's field (None: "auto" when there are tools); `content_format` is
    the template's ("string" or "openai", see `template_content_format`). The inputs are not modified."""
    return TemplateInputs(tuple(template_messages(messages, content_format=content_format)),
                          template_tools(tools, tool_choice))


def template_messages(messages: Sequence[Mapping[str, Any]], *,
                      content_format: str = "string") -> list[dict[str, Any]]:
    """Each message as SGLang's jinja path prepares it for the template."""
    if content_format not in CONTENT_FORMATS:
        raise TemplateInputError("content_format", content_format, f"expected one of {list(CONTENT_FORMATS)}")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TemplateInputError("messages", messages, "expected a list of messages")
    return [_prepare(_dump_message(m, f"messages[{i}]"), content_format) for i, m in enumerate(messages)]


def template_tools(tools: Sequence[Mapping[str, Any]] | None,
                   tool_choice: Any = None) -> tuple[dict[str, Any], ...] | None:
    """The tools SGLang renders: every tool's `model_dump()`, only the named one for a function
    `tool_choice`, none for "none" or an empty list."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TemplateInputError("tools", tools, "expected a list of tools")
    dumped = [_dump_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = "auto" if tool_choice is None else tool_choice
    if not dumped or choice == "none":
        return None
    if choice in ("auto", "required"):
        return tuple(dumped)
    if not isinstance(choice, Mapping) or choice.get("type", "function") != "function" or \
            not isinstance(choice.get("function"), Mapping):
        raise TemplateInputError("tool_choice", tool_choice,
                                 "expected 'auto', 'required', 'none' or {'type': 'function', 'function': {'name': ...}}")
    return tuple(t for t in dumped if t["function"]["name"] == choice["function"].get("name"))


def template_content_format(chat_template: str, parsed: Any) -> str:
    """SGLang's detection: "openai" when the template mentions image/audio/video/vision or loops over
    `message.content` (also `msg`/`m`, through filters, tests and slices), else "string". `parsed` is
    the template's jinja2 AST (`environment.parse(chat_template)`), None when it does not parse."""
    if any(word in chat_template for word in _MULTIMODAL_WORDS):
        return "openai"
    if parsed is None:
        return "string"
    return "openai" if any(_iterates_content(node.iter) for node in _walk(parsed)
                           if type(node).__name__ == "For") else "string"


def _walk(node: Any) -> Any:
    yield node
    for child in node.iter_child_nodes():
        yield from _walk(child)


def _iterates_content(node: Any) -> bool:
    kind = type(node).__name__
    if kind in ("Filter", "Test"):
        return node.node is not None and _iterates_content(node.node)
    if kind == "Getitem" and type(node.arg).__name__ == "Slice":
        return _iterates_content(node.node)
    if kind == "Getitem":
        key_matches = type(node.arg).__name__ == "Const" and node.arg.value == "content"
    elif kind == "Getattr":
        key_matches = node.attr == "content"
    else:
        return False
    base = node.node
    return key_matches and type(base).__name__ == "Name" and base.ctx == "load" and base.name in _CONTENT_LOOP_NAMES


def _dump_message(message: Any, field: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TemplateInputError(field, message, "expected an object")
    role = message.get("role")
    if role == "user":
        content = message.get("content")
        if content is None:
            raise TemplateInputError(f"{field}.content", content, "a user message needs content")
        return {"role": role, "content": _dump_content(content, f"{field}.content", role)}
    role = role.lower() if isinstance(role, str) else role
    if role not in GENERIC_ROLES:
        raise TemplateInputError(f"{field}.role", message.get("role"),
                                 f"role must be one of {['user', *GENERIC_ROLES]}")
    dumped: dict[str, Any] = {"role": role}
    for key in _MESSAGE_FIELDS:
        value = message.get(key)
        if value is None:
            dumped[key] = None
        elif key == "content":
            dumped[key] = _dump_content(value, f"{field}.content", role)
        elif key == "tool_calls":
            dumped[key] = _dump_tool_calls(value, f"{field}.tool_calls", decode=role == "assistant")
        elif key == "tools":
            if not isinstance(value, list):
                raise TemplateInputError(f"{field}.tools", value, "expected a list of tools")
            dumped[key] = [_dump_tool(t, f"{field}.tools[{j}]") for j, t in enumerate(value)]
        else:
            dumped[key] = _string(value, f"{field}.{key}")
    return dumped


def _dump_content(content: Any, field: str, role: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateInputError(field, content, "expected a string, a list of content parts or null")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "text":
            parts.append({"type": "text", "text": _string(part.get("text"), f"{field}[{j}].text")})
        elif kind in _THINKING_TYPES and role == "assistant":
            thinking, text = part.get("thinking"), part.get("text")
            if (thinking is None) == (text is None):
                raise TemplateInputError(f"{field}[{j}]", part, "a thinking part needs exactly one of thinking, text")
            parts.append({"type": kind, "thinking": _optional_string(thinking, f"{field}[{j}].thinking"),
                          "text": _optional_string(text, f"{field}[{j}].text")})
        else:
            raise TemplateInputError(f"{field}[{j}]", part, "only text parts (and thinking parts in assistant "
                                                            "messages) are supported")
    return parts


def _dump_tool_calls(calls: Any, field: str, *, decode: bool) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise TemplateInputError(field, calls, "expected a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        item = f"{field}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise TemplateInputError(f"{item}.function", function, "expected an object with name and arguments")
        if call.get("type", "function") != "function":
            raise TemplateInputError(f"{item}.type", call.get("type"), "expected 'function'")
        index = call.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise TemplateInputError(f"{item}.index", index, "expected an int or null")
        name, arguments = function.get("name"), function.get("arguments")
        if isinstance(arguments, str) and decode:
            arguments = _decode_arguments(arguments, f"{item}.function.arguments")
        elif isinstance(arguments, Mapping):
            arguments = copy.deepcopy(dict(arguments))
        elif arguments is not None and not isinstance(arguments, str):
            raise TemplateInputError(f"{item}.function.arguments", arguments, "expected a JSON string or an object")
        out.append({
            "id": _optional_string(call.get("id"), f"{item}.id"),
            "index": index,
            "type": "function",
            "function": {"name": _optional_string(name, f"{item}.function.name"),
                         "arguments": arguments},
        })
    return out


def _decode_arguments(text: str, field: str) -> dict[str, Any]:
    try:
        decoded = json.loads(text)
    except ValueError as exc:
        raise TemplateInputError(field, text, "tool-call arguments must be valid JSON") from exc
    if not isinstance(decoded, dict):
        raise TemplateInputError(field, text, "tool-call arguments must be a JSON object")
    return decoded


def _prepare(message: dict[str, Any], content_format: str) -> dict[str, Any]:
    """`content None -> ""`, then SGLang's `process_content_for_template_format` and
    `normalize_tool_content`."""
    if message.get("content") is None:
        message["content"] = ""
    content = message["content"]
    if not isinstance(content, list):
        prepared = {k: v for k, v in message.items() if v is not None}
    elif content_format == "openai":
        prepared = {k: v for k, v in message.items() if v is not None and k != "content"}
        prepared["content"] = [{"type": "text", "text": p["text"]} for p in content if p["type"] == "text"]
    else:
        texts = [p["text"] for p in content if p["type"] == "text"]
        prepared = {k: v for k, v in {**message, "content": " ".join(texts)}.items() if v is not None}
    if prepared["role"] == "tool" and isinstance(prepared["content"], list):
        prepared["content"] = " ".join(p["text"] for p in prepared["content"])
    return prepared


def _dump_tool(tool: Any, field: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        raise TemplateInputError(field, tool, "expected {'type': 'function', 'function': {'name': ...}}")
    kind = tool.get("type", "function")
    function = tool["function"]
    description, strict = function.get("description"), function.get("strict", False)
    if description is not None:
        _string(description, f"{field}.function.description")
    if not isinstance(strict, bool):
        raise TemplateInputError(f"{field}.function.strict", strict, "expected true or false")
    defer_loading = _optional_bool(tool.get("defer_loading"), f"{field}.defer_loading")
    function_defer = _optional_bool(function.get("defer_loading"), f"{field}.function.defer_loading")
    dumped: dict[str, Any] = {
        "description": description,
        "name": _string(function.get("name"), f"{field}.function.name"),
        "parameters": copy.deepcopy(function.get("parameters")),
        "strict": strict,
    }
    if function_defer is None:
        function_defer = defer_loading
    if function_defer is not None:
        dumped["defer_loading"] = function_defer
    return {"type": _string(kind, f"{field}.type"), "function": dumped, "defer_loading": defer_loading}


def _optional_bool(value: Any, field: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TemplateInputError(field, value, "expected true, false or null")
    return value


def _optional_string(value: Any, field: str) -> str | None:
    return None if value is None else _string(value, field)


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise TemplateInputError(field, value, f"expected a string, got {type(value).__name__}")
    return value
