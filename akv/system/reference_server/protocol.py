"""Parse and validate an OpenAI chat-completions request body into a :class:`ChatRequest`.

Every failure raises :class:`RequestError` naming the JSON field (``messages[3].role``) and the bad
value; the HTTP layer turns it into a 400. Unknown top-level fields are rejected rather than ignored,
so a misspelt AKV field (``drop_messages``) cannot silently turn a context request into a plain one.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from akv.agent.templating import TemplateInputError, template_messages, template_tools
from akv.system.context.drop_rule import KeepTextDrop, RequestRules, is_context_request, parse_request_rules
from akv.system.context.request import render_inputs
from akv.system.context.rules import RuleError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4
DEFAULT_MAX_TOKENS = 128
MAX_JSON_DEPTH = 64
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed accepts
# Names the renderer (and HF ``apply_chat_template``) binds itself: not settable through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "chat_template", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "akvprovenancemark",
})
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# Accepted for compatibility; the reference server has nothing to do with them.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "parallel_tool_calls", "service_tier", "response_format", "modalities",
})
# Accepted only at their neutral value.
NEUTRAL_FIELDS: dict[str, tuple[Any, tuple[type, ...]]] = {
    "presence_penalty": (0, (int, float)), "frequency_penalty": (0, (int, float)), "n": (1, (int,)),
    "logit_bias": (None, (type(None),)),
}
KNOWN_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs",
    "chat_template_kwargs", "drop_message", "reposition", "drop_rule", "akv_dry_run",
}) | IGNORED_FIELDS | frozenset(NEUTRAL_FIELDS)


class RequestError(ValueError):
    """A request field is invalid; ``field`` is its JSON path and ``value`` the offending value."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        self.field = field
        self.value = value
        shown = repr(value)
        super().__init__(f"{field}: {problem}" if shown in problem else f"{field}: {problem} (got {shown})")


@dataclass(frozen=True)
class Sampling:
    """How to pick each token: greedy when ``temperature == 0``. ``max_tokens`` is None when the
    request did not bound its reply (it then gets up to ``DEFAULT_MAX_TOKENS``, as many as fit)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens_field: str = "max_tokens"


@dataclass(frozen=True)
class ChatRequest:
    """A validated request. ``messages`` and ``tools`` are exactly what SGLang 0.5.16 hands the chat
    template (:func:`akv.agent.templating.template_messages` / ``template_tools``; no tools for
    ``tool_choice: "none"``); for ``keep_text_drop`` ``messages`` are the full messages rendered."""

    model: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    rules: RequestRules
    is_context: bool
    sampling: Sampling
    stream: bool
    include_usage: bool
    parse_tool_calls: bool
    logprobs: bool
    top_logprobs: int
    template_kwargs: dict[str, Any]


def parse_chat_request(body: Any, served_model: str, content_format: str = "string") -> ChatRequest:
    """Validate a decoded JSON body against the model this server serves; ``content_format`` is its
    chat template's (see :func:`akv.agent.templating.template_content_format`)."""
    if not isinstance(body, Mapping):
        raise RequestError("body", _short(body), f"expected a JSON object, got {type(body).__name__}")
    _check_json(body)
    for key in body:
        if key not in KNOWN_FIELDS:
            raise RequestError(key, _short(body[key]), f"unknown field {key!r}")
    for key, (neutral, types) in NEUTRAL_FIELDS.items():
        if key in body and not (type(body[key]) in types and body[key] == neutral):
            raise RequestError(key, body[key], f"only {neutral!r} is supported by the reference server")
    model = body.get("model")
    if model != served_model:
        raise RequestError("model", model, f"this server serves {served_model!r}")
    messages = _messages(body.get("messages"), content_format)
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none"):
        raise RequestError("tool_choice", _short(tool_choice), "only 'auto' and 'none' are supported")
    tools = _tools(body.get("tools"), tool_choice)

    drop_message, drop_rule, reposition = body.get("drop_message"), body.get("drop_rule"), body.get("reposition")
    try:
        rules = parse_request_rules(drop_message, drop_rule, reposition, messages)
        full = _full_messages(rules, content_format)
        rendered, rules = render_inputs(messages, rules, full, reposition)
    except RuleError as exc:
        raise RequestError(exc.field, _short(exc.value), str(exc).split(": ", 1)[-1]) from exc
    messages = tuple(rendered)
    is_context = is_context_request(drop_message, drop_rule, reposition)

    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, Mapping):
            raise RequestError("stream_options", _short(stream_options), "expected an object")
        for key in stream_options:
            if key not in ("include_usage", "continuous_usage_stats"):
                raise RequestError(f"stream_options.{key}", _short(stream_options[key]), f"unknown field {key!r}")
        include_usage = _bool(stream_options, "include_usage", False, prefix="stream_options.")

    logprobs = _bool(body, "logprobs", False)
    top_logprobs = body.get("top_logprobs", 0)
    if top_logprobs is None:
        top_logprobs = 0
    if type(top_logprobs) is not int or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError("top_logprobs", top_logprobs, f"expected an int in 0..{MAX_TOP_LOGPROBS}")
    if top_logprobs and not logprobs:
        raise RequestError("top_logprobs", top_logprobs, "needs logprobs: true")

    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise RequestError("chat_template_kwargs", _short(kwargs), "expected an object")
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(f"chat_template_kwargs.{key}", _short(kwargs[key]),
                               f"{key!r} is set by the server, not through chat_template_kwargs")

    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        rules=rules,
        is_context=is_context,
        sampling=_sampling(body),
        stream=stream,
        include_usage=include_usage or (stream and is_context),
        parse_tool_calls=bool(tools),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        template_kwargs=dict(kwargs),
    )


def _full_messages(rules: RequestRules, content_format: str) -> tuple[dict[str, Any], ...] | None:
    """``keep_text_drop``'s full messages, validated like ``messages`` (fields named under drop_rule)."""
    if not isinstance(rules.span, KeepTextDrop):
        return None
    try:
        return _messages(list(rules.span.full_messages), content_format)
    except RequestError as exc:
        raise RequestError("drop_rule.full_" + exc.field, exc.value, str(exc).split(": ", 1)[-1]) from exc


def _messages(value: Any, content_format: str) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", _short(value), "expected a non-empty list of messages")
    for i, raw in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(raw, Mapping):
            raise RequestError(field, _short(raw), f"expected an object, got {type(raw).__name__}")
        role = raw.get("role")
        if role not in ROLES:
            raise RequestError(f"{field}.role", role, f"role must be one of {list(ROLES)}")
        if raw.get("content") is None and not (role == "assistant" and raw.get("tool_calls")):
            needs = "content or tool_calls" if role == "assistant" else "content"
            raise RequestError(f"{field}.content", None, f"{role} message needs {needs}")
    try:
        messages = template_messages(value, content_format=content_format)
    except TemplateInputError as exc:
        raise RequestError(exc.field, _short(exc.value), exc.problem) from exc
    except RecursionError as exc:
        raise RequestError("messages", f"{len(value)} messages", "nested too deeply to render") from exc
    for i, message in enumerate(messages):
        _check_json(message, f"messages[{i}]")
        for j, call in enumerate(message.get("tool_calls") or ()):
            name = (call.get("function") or {}).get("name")
            if not isinstance(name, str) or not name:
                raise RequestError(f"messages[{i}].tool_calls[{j}].function.name", _short(name),
                                   "a tool call needs a non-empty function name")
    _check_tool_results(messages)
    return tuple(messages)


def _tools(value: Any, tool_choice: Any) -> tuple[dict[str, Any], ...]:
    if isinstance(value, list):
        for i, tool in enumerate(value):
            if isinstance(tool, Mapping) and tool.get("type", "function") != "function":
                raise RequestError(f"tools[{i}].type", _short(tool.get("type")), "only 'function' tools are supported")
    try:
        return template_tools(value, tool_choice) or ()
    except TemplateInputError as exc:
        raise RequestError(exc.field, _short(exc.value), exc.problem) from exc


def _sampling(body: Mapping[str, Any]) -> Sampling:
    temperature = _number(body, "temperature", 0.0, low=0.0, high=2.0)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise RequestError("top_p", top_p, "must be greater than 0")
    seed = body.get("seed")
    low, high = SEED_RANGE
    if seed is not None and (type(seed) is not int or not low <= seed <= high):
        raise RequestError("seed", _short(seed), "expected an int in [-2**63, 2**64 - 1]")
    max_tokens, max_tokens_field = None, "max_tokens"
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            if type(value) is not int or value <= 0:
                raise RequestError(key, _short(value), "expected a positive int")
            max_tokens, max_tokens_field = value, key
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise RequestError("stop", _short(stop), f"expected a string or up to {MAX_STOP_STRINGS} non-empty strings")
    if "" in stops:
        raise RequestError("stop", stop, "stop strings must be non-empty")
    return Sampling(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens, stop=stops,
                    max_tokens_field=max_tokens_field)


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Every tool message answers a call of the assistant message its run of tool messages follows."""
    calls_at, ids = -1, list[Any]()
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls_at, ids = i, [call.get("id") for call in message["tool_calls"]]
        elif role == "tool":
            if calls_at < 0:
                raise RequestError(f"messages[{i}]", "tool", "a tool result must follow an assistant message "
                                   "with tool_calls (and only other tool results)")
            call_id = message.get("tool_call_id")
            if call_id is not None and None not in ids and call_id not in ids:
                raise RequestError(f"messages[{i}].tool_call_id", _short(call_id),
                                   f"matches no tool call of messages[{calls_at}] (ids {sorted(map(str, ids))})")
        else:
            calls_at, ids = -1, []


def _check_json(body: Any, root: str = "") -> None:
    """Bounded nesting and no lone surrogates anywhere (neither survives rendering or tokenising)."""
    stack: list[tuple[str, Any, int]] = [(root, body, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestError(path, "...", f"nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                raise RequestError(path or "body", _short(value, 60), "a lone UTF-16 surrogate is not text")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                name = f"{path}.{key}" if path else str(key)
                if _LONE_SURROGATE.search(str(key)):
                    raise RequestError(path or "body", _short(key, 60), "a lone UTF-16 surrogate is not text")
                stack.append((name, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))


def _number(body: Mapping[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and low <= value <= high):
        raise RequestError(key, value, f"expected a number in [{low}, {high}]")
    return float(value)


def _bool(body: Mapping[str, Any], key: str, default: bool, *, prefix: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(prefix + key, value, "expected true or false")
    return value


def _short(value: Any, limit: int = 200) -> Any:
    """The value itself when small, else a truncated JSON rendering (error messages stay readable)."""
    text = json.dumps(value, default=repr)
    return value if len(text) <= limit else text[:limit] + "..."
