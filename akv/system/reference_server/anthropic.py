"""The Anthropic Messages API on the reference server: `/v1/messages` (streamed or not) and
`/v1/messages/count_tokens`, with `context_management.edits` executed as KV drops.

A body is converted to the chat-completions body the OpenAI path serves (content blocks to messages,
`tool_result` blocks to tool messages, `thinking` to `reasoning_content`), the edits are decided by
:func:`akv.agent.anthropic.plan_edits` over those messages with this server's exact token counts, and
the request runs as that OpenAI-path program. `count_tokens` with edits is a dry run: it plans the
request against the cache and reports what serving it would read, re-rotate, compute and drop.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.agent.anthropic import CLEAR_THINKING, CLEAR_TOOL_USES, ContextEdits, ContextManagementError, EditPlan
from akv.agent.anthropic import parse_context_management, plan_edits
from akv.agent.counting import TokenLayout
from akv.system.context.program import ContextProgram
from akv.system.context.provenance import chat_template, token_provenance
from akv.system.context.thinking import retain_thinking
from akv.system.reference_server.protocol import RequestError, parse_chat_request
from akv.system.reference_server.responses import PromptUsage

MESSAGE_FIELDS = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice", "stream",
                            "temperature", "top_p", "stop_sequences", "metadata", "thinking", "context_management"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "context_management"})
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@dataclass(frozen=True)
class AnthropicRequest:
    """A converted request: the chat-completions body (AKV fields added) and the edits it carries."""

    chat: dict[str, Any]
    edits: ContextEdits | None
    plan: EditPlan | None
    stream: bool


def parse(body: Any, engine: Any, *, count_only: bool = False) -> AnthropicRequest:
    """Validate and convert; every problem is a :class:`RequestError` naming the field."""
    if not isinstance(body, Mapping):
        raise _error("body", type(body).__name__, "expected a JSON object")
    known = COUNT_FIELDS if count_only else MESSAGE_FIELDS
    for key in body:
        if key not in known:
            raise _error(key, None, f"unknown field {key!r}")
    if not count_only and (type(body.get("max_tokens")) is not int or body["max_tokens"] < 1):
        raise _error("max_tokens", body.get("max_tokens"), "expected a positive integer")
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body.get("system"), body.get("messages"))}
    if tools:
        chat["tools"] = tools
    chat["max_tokens"] = body.get("max_tokens", 1)
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("stop", "stop_sequences")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "none"):
            raise _error("tool_choice", choice, "only {'type': 'auto'} and {'type': 'none'} are supported")
        chat["tool_choice"] = choice["type"]
    stream = body.get("stream", False)
    if type(stream) is not bool:
        raise _error("stream", stream, "expected true or false")
    plain = parse_chat_request(chat, engine.model_name, engine.content_format)
    edits = plan = None
    if body.get("context_management") is not None:
        try:
            edits = parse_context_management(body["context_management"], has_tools=bool(tools))
        except ContextManagementError as exc:
            raise _error(exc.field, None, str(exc).split(": ", 1)[-1]) from exc
        counter = ServerCounter(engine, thinking=edits.thinking is not None and edits.thinking.keep_turns is not None)
        plan = plan_edits(plain.messages, edits, counter, tools=plain.tools)
        chat.update(plan.fields)
    return AnthropicRequest(chat, edits, plan, stream)


class ServerCounter:
    """The reference server's own token counts per message (its template, tokenizer and provenance);
    ``thinking``: rendered as for a ``thinking_drop`` request (historical reasoning kept)."""

    def __init__(self, engine: Any, *, thinking: bool) -> None:
        source = engine.files.chat_template
        self._template = chat_template(retain_thinking(source)) if thinking else engine.template
        self._tokenizer = engine.files.tokenizer

    def layout(self, messages: Sequence[Mapping[str, object]], *, tools: Sequence[Mapping[str, object]] | None = None,
               chat_template_kwargs: Mapping[str, object] | None = None, api_style: str = "sglang") -> TokenLayout:
        owned = self._template.render_owned(list(messages), tools=list(tools) if tools else None,
                                            add_generation_prompt=True, **dict(chat_template_kwargs or {}))
        return TokenLayout.from_owners(token_provenance(owned, self._tokenizer).owners.tolist(), len(messages))


def applied_edits(request: AnthropicRequest, program: ContextProgram) -> list[dict[str, Any]]:
    """Anthropic's `context_management.applied_edits`: what each edit dropped, its tokens counted
    on the compiled program (prompt tokens a drop hides from the reply)."""
    if request.plan is None or request.edits is None:
        return []
    plan = request.plan
    hidden = ~program.keep[: program.n_prompt]
    owners = program.owners[: program.n_prompt]
    out = []
    if request.edits.thinking is not None and plan.thinking:
        partial = [i for i in plan.thinking if i not in plan.dropped]
        out.append({"type": CLEAR_THINKING, "cleared_thinking_turns": len(plan.thinking),
                    "cleared_input_tokens": int((hidden & np.isin(owners, partial)).sum())})
    if request.edits.tool_uses is not None and plan.dropped:
        out.append({"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(plan.tool_results),
                    "cleared_input_tokens": int((hidden & np.isin(owners, plan.dropped)).sum())})
    return out


def usage(prompt: PromptUsage, output_tokens: int | None) -> dict[str, Any]:
    """Anthropic usage: `cache_read_input_tokens` is KV read from the cache (cached + re-rotated),
    `input_tokens` the rest of the prompt; the AKV counters ride along under `akv`."""
    read = prompt.cached_tokens + prompt.repos_tokens
    out: dict[str, Any] = {"input_tokens": prompt.prompt_tokens - read, "cache_read_input_tokens": read,
                           "cache_creation_input_tokens": 0}
    if output_tokens is not None:
        out["output_tokens"] = output_tokens
    out["akv"] = akv_counters(prompt)
    return out


def akv_counters(prompt: PromptUsage) -> dict[str, int]:
    return {"prompt_tokens": prompt.prompt_tokens, "cached_tokens": prompt.cached_tokens,
            "repos_tokens": prompt.repos_tokens, "computed_tokens": prompt.computed_tokens,
            "drop_skipped_tokens": prompt.drop_skipped_tokens}


def count_tokens_body(prompt: PromptUsage, edits: ContextEdits | None) -> dict[str, Any]:
    """`input_tokens`: the prompt the reply reads after the edits; with edits, Anthropic's
    `context_management.original_input_tokens` and the dry run's counters under `akv`."""
    body: dict[str, Any] = {"input_tokens": prompt.prompt_tokens - prompt.drop_skipped_tokens}
    if edits is not None:
        body["context_management"] = {"original_input_tokens": prompt.prompt_tokens}
    body["akv"] = akv_counters(prompt)
    return body


def content_blocks(content: str | None, calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if content:
        blocks.append({"type": "text", "text": content})
    for call in calls:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except (TypeError, ValueError):
            arguments = {}
        blocks.append({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                       "name": function["name"], "input": arguments if isinstance(arguments, dict) else {}})
    return blocks or [{"type": "text", "text": ""}]


def message_body(model: str, blocks: list[dict[str, Any]], stop_reason: str, usage_: dict[str, Any],
                 edits: list[dict[str, Any]] | None) -> dict[str, Any]:
    body = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": stop_reason, "stop_sequence": None, "usage": usage_}
    if edits is not None:
        body["context_management"] = {"applied_edits": edits}
    return body


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def stream_events(start: Mapping[str, Any], blocks: list[dict[str, Any]], stop_reason: str,
                  usage_: dict[str, Any], edits: list[dict[str, Any]] | None) -> bytes:
    """Every event after `message_start`: one block at a time, then the delta with stop reason, usage
    and applied edits, then `message_stop`."""
    out = []
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            out.append(sse("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {"type": "text", "text": ""}}))
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "text_delta", "text": block["text"]}}))
        else:
            out.append(sse("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                "type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}}))
            out.append(sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": i}))
    delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                             "usage": usage_}
    if edits is not None:
        delta["context_management"] = {"applied_edits": edits}
    out.append(sse("message_delta", delta))
    out.append(sse("message_stop", {"type": "message_stop"}))
    return b"".join(out)


def _error(field: str, value: Any, problem: str) -> RequestError:
    """A :class:`RequestError` whose message is ``field: problem`` (the problem names the value)."""
    exc = RequestError(field, value, problem)
    exc.args = (f"{field}: {problem}",)
    return exc


def error_body(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _error("tools", None, "expected a list")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _error(f"tools[{i}].name", None, "a tool needs a non-empty name")
        if tool.get("type") not in (None, "custom"):
            raise _error(f"tools[{i}].type", tool.get("type"), "only custom tools are supported")
        function = {"name": tool["name"], "description": tool.get("description") or "",
                    "parameters": tool.get("input_schema") or {"type": "object", "properties": {}}}
        out.append({"type": "function", "function": function})
    return out


def _text(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, block in enumerate(value):
            if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise _error(f"{field}[{j}]", None, "only text blocks are supported here")
            parts.append(block["text"])
        return "\n".join(parts)
    raise _error(field, None, "expected a string or a list of text blocks")


def _messages(system: Any, value: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(value, list) or not value:
        raise _error("messages", None, "expected a non-empty list of messages")
    for i, message in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise _error(f"{field}.role", None, "expected an object with role 'user' or 'assistant'")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _error(f"{field}.content", None, "expected a string or a list of content blocks")
        texts, reasoning, calls = [], [], []
        for j, block in enumerate(content):
            where = f"{field}.content[{j}]"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise _error(where, None, "a tool_use block needs an id and a name")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(block.get("content", ""), f"{where}.content")})
            else:
                raise _error(f"{where}.type", None, f"unsupported content block {kind!r} in a {role} message")
        if role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if reasoning:
                entry["reasoning_content"] = "\n".join(reasoning)
            if calls:
                entry["tool_calls"] = calls
            if entry["content"] is None and not calls:
                entry["content"] = ""
            out.append(entry)
        elif texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out
