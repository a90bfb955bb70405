"""Hooks for the patched ``serving_chat.py``: admit or refuse a context request, then compile its
program from the very prompt SGLang rendered; for ``serving_base.py``: check every request
(:mod:`akv.system.adapter.request_checks`), then convert it, a context request (render, provenance,
compile) in a worker thread, off the HTTP event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from akv.system.adapter import request_checks
from akv.system.adapter.protocol import message_dict, request_rules
from akv.system.context.drop_rule import KeepTextDrop, RequestRules, ThinkingDrop, is_context_request
from akv.system.context.program import ContextProgram
from akv.system.context.provenance import ProvenanceError
from akv.system.context.request import compile_parsed, render_inputs
from akv.system.context.rules import RuleError, RuleShapeError
from akv.system.context.spans import SpanError
from akv.system.context.thinking import retain_thinking

REQUIRED_PAGE_SIZE = 1
ATTENTION_BACKENDS = ("triton", "flashinfer", "fa3")
"""Attention backends that execute context requests (the first is the launcher's default off CUDA)."""
REQUIRED_RADIX_CACHE_BACKEND = "akv"

_CONVERTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="akv-convert")
"""One worker: conversions of context requests run one at a time, the tokenizer is never shared
between two of them, and the event loop keeps serving while one runs."""

_RENDER_ARGUMENTS = frozenset({"tokenizer", "messages", "drop_message", "reposition", "drop_rule", "tools",
                               "add_generation_prompt", "template", "prompt_ids"})
_TEMPLATE_KWARG = "chat_template"  # transformers' apply_chat_template takes the template source under this name

_UNSUPPORTED_OPTIONS: tuple[tuple[str, str], ...] = (
    ("speculative_algorithm", "speculative decoding"),
    ("enable_hierarchical_cache", "the hierarchical cache"),
    ("enable_lora", "LoRA"),
    ("enable_mixed_chunk", "mixed chunked prefill"),
    ("enable_dp_attention", "DP attention"),
    ("disable_radix_cache", "a disabled radix cache"),
    ("optimistic_prefill_attempts", "optimistic prefill on a PD prefill server"),
)


class UnsupportedContextRequest(ValueError):
    """A request with ``drop_message``/``reposition`` uses a mode or server setting AKV cannot serve;
    ``param`` names the request field or server option in the way."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PreparedRules:
    """A context request's resolved rules, stored back into its ``drop_rule`` by
    :func:`prepare_context_request` (only the server can make one; JSON cannot)."""

    rules: RequestRules
    template: str | None = None


def error_param(error: ValueError) -> str | None:
    """The ``param`` of SGLang's 400 for an AKV refusal (None for SGLang's own errors)."""
    if isinstance(error, RuleError):
        return error.field.split("[", 1)[0]
    if isinstance(error, (UnsupportedContextRequest, request_checks.RequestFieldError)):
        return error.param
    if isinstance(error, SpanError):
        return "drop_rule"
    if isinstance(error, ProvenanceError):
        return "messages"
    return None


async def convert_request(serving: Any, request: Any, raw_request: Any) -> Any:
    """``serving._convert_to_internal_request(request, raw_request)`` after
    :func:`akv.system.adapter.request_checks.check`: inline for a plain request (as stock), in the
    worker thread for a context request, whose template render, provenance and compile can take
    seconds for a long conversation."""
    if not is_context_request(getattr(request, "drop_message", None), getattr(request, "drop_rule", None),
                              getattr(request, "reposition", None)):
        return _checked_convert(serving, request, raw_request)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_CONVERTER, _checked_convert, serving, request, raw_request)


def _checked_convert(serving: Any, request: Any, raw_request: Any) -> Any:
    request_checks.check(request)
    return serving._convert_to_internal_request(request, raw_request)


def prepare_context_request(serving: Any, request: Any, is_multimodal: bool) -> RequestRules | None:
    """Rules of a context request after checking it can be served, None for a plain request.

    ``serving`` is SGLang's ``OpenAIServingChat``. ``keep_text_drop`` swaps the full messages into
    the request; ``thinking_drop`` has SGLang render with the template that keeps historical
    reasoning. Raises :class:`UnsupportedContextRequest` or a ``RuleError`` (HTTP 400) naming the
    field or server setting in the way.
    """
    rules = request_rules(request)
    if rules is None:
        return None
    _check_request_mode(request, is_multimodal)
    _check_renderer(serving.template_manager.chat_template_name, serving.chat_encoding_spec)
    _check_server(serving.tokenizer_manager.server_args)
    template = None
    if isinstance(rules.span, KeepTextDrop):
        full = _validated_messages(request, rules.span.full_messages)
        visible = [message_dict(m) for m in request.messages]
        rendered, rules = render_inputs(visible, rules, [message_dict(m) for m in full], request.reposition)
        if rendered is not visible:
            request.messages = full
    elif isinstance(rules.span, ThinkingDrop):
        template = _thinking_template(request, serving.tokenizer_manager.tokenizer)
    request.drop_rule = PreparedRules(rules, template)
    return rules


def compile_context_program(
    request: Any,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    prompt_ids: list[int],
) -> ContextProgram | None:
    """The program of a context request (None for a plain one), from the exact template inputs
    SGLang rendered: its normalised ``messages``, ``tools`` and extra template variables.

    The attributed render must reproduce ``prompt_ids`` token for token (for a byte-level BPE
    tokenizer: ``prompt_ids`` must spell it, and are not encoded again), else
    :class:`UnsupportedContextRequest`; template ownership problems raise ``ProvenanceError``.
    """
    prepared = getattr(request, "drop_rule", None)
    if not isinstance(prepared, PreparedRules):
        rules = request_rules(request)
        if rules is None:
            return None
        if isinstance(rules.span, KeepTextDrop):
            raise UnsupportedContextRequest(
                "drop_rule: keep_text_drop needs prepare_context_request first", "drop_rule")
        prepared = PreparedRules(rules)
    variables = dict(template_kwargs)
    if prepared.template is not None:
        variables.pop(_TEMPLATE_KWARG, None)
    clash = sorted(set(variables) & (_RENDER_ARGUMENTS | {_TEMPLATE_KWARG}))
    if clash:
        raise UnsupportedContextRequest(
            f"chat_template_kwargs[{clash[0]!r}]: collides with an argument AKV renders the template with "
            f"({', '.join(sorted(_RENDER_ARGUMENTS | {_TEMPLATE_KWARG}))}); rename the template variable",
            "chat_template_kwargs",
        )
    compiled = compile_parsed(tokenizer, messages, prepared.rules, tools=tools, template=prepared.template,
                              prompt_ids=prompt_ids, **variables)
    got = compiled.program.token_ids.tolist()
    expected = got if got == list(prompt_ids) else [int(t) for t in prompt_ids]
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise UnsupportedContextRequest(
            f"chat_template: the attributed render differs from the server's prompt at token {at} "
            f"(lengths {len(got)} vs {len(expected)}); drop_message/reposition cannot be placed",
            "messages",
        )
    return compiled.program


def _validated_messages(request: Any, full: tuple[Any, ...]) -> list[Any]:
    """``full_messages`` parsed like ``messages`` (SGLang's pydantic message types)."""
    fields = getattr(type(request), "model_fields", None)
    if fields is None:
        return list(full)
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(fields["messages"].annotation).validate_python(list(full))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"][:2])
        raise RuleShapeError(f"drop_rule.full_messages{where}", None, f"invalid message: {first['msg']}") from exc


def _thinking_template(request: Any, tokenizer: Any) -> str | None:
    """The template that keeps historical reasoning, put where SGLang's render reads it (None when
    the tokenizer's own template already does)."""
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    if _TEMPLATE_KWARG in kwargs:
        raise UnsupportedContextRequest(
            f"chat_template_kwargs[{_TEMPLATE_KWARG!r}]: not supported with drop_rule thinking_drop",
            "chat_template_kwargs")
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str) or retain_thinking(source) == source:
        return None
    kwargs[_TEMPLATE_KWARG] = retain_thinking(source)
    request.chat_template_kwargs = kwargs
    return kwargs[_TEMPLATE_KWARG]


def _check_request_mode(request: Any, is_multimodal: bool) -> None:
    if request.n != 1:
        raise UnsupportedContextRequest(f"n: drop_message/reposition need n == 1, got {request.n!r}", "n")
    if request.input_ids is not None:
        raise UnsupportedContextRequest(
            "input_ids: drop_message/reposition need the server to render messages; omit input_ids", "input_ids"
        )
    if request.continue_final_message:
        raise UnsupportedContextRequest(
            "continue_final_message: not supported together with drop_message/reposition", "continue_final_message"
        )
    if is_multimodal:
        raise UnsupportedContextRequest("model: drop_message/reposition are not supported for multimodal models",
                                        "model")


def _check_renderer(chat_template_name: str | None, chat_encoding_spec: str | None) -> None:
    if chat_template_name is not None:
        raise UnsupportedContextRequest(
            f"chat_template: the built-in template {chat_template_name!r} is not supported with "
            "drop_message/reposition; serve with the model's own jinja template", "chat_template"
        )
    if chat_encoding_spec is not None:
        raise UnsupportedContextRequest(
            f"chat_template: the custom encoder {chat_encoding_spec!r} is not supported with "
            "drop_message/reposition; serve with the model's own jinja template", "chat_template"
        )


def _check_server(server_args: Any) -> None:
    # a PD decode server receives a context request's KV: SGLang's chunk cache holds it, no AKV cache
    decode = getattr(server_args, "disaggregation_mode", "null") == "decode"
    for name, what in _UNSUPPORTED_OPTIONS:
        if getattr(server_args, name, None) and not (decode and name == "disable_radix_cache"):
            raise UnsupportedContextRequest(
                f"server configuration: {name} ({what}) is not supported with drop_message/reposition", name
            )
    if getattr(server_args, "pp_size", 1) != 1:
        raise UnsupportedContextRequest(
            f"server configuration: pp_size {server_args.pp_size!r} is not supported with drop_message/reposition",
            "pp_size",
        )
    if decode:
        if server_args.disaggregation_decode_enable_radix_cache:
            raise UnsupportedContextRequest(
                "server configuration: disaggregation_decode_enable_radix_cache (a decode-side radix cache) is not "
                "supported with drop_message/reposition", "disaggregation_decode_enable_radix_cache")
    elif server_args.radix_cache_backend != REQUIRED_RADIX_CACHE_BACKEND:
        raise UnsupportedContextRequest(
            f"server configuration: radix_cache_backend {server_args.radix_cache_backend!r} cannot execute "
            f"drop_message/reposition (needs {REQUIRED_RADIX_CACHE_BACKEND!r}; start with python -m akv.system.launch_server)",
            "radix_cache_backend",
        )
    if server_args.page_size != REQUIRED_PAGE_SIZE:
        raise UnsupportedContextRequest(
            f"server configuration: page_size {server_args.page_size!r} is not supported with "
            f"drop_message/reposition (needs {REQUIRED_PAGE_SIZE}; start with python -m akv.system.launch_server)",
            "page_size",
        )
    for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        value = getattr(server_args, name)
        if value not in (None, *ATTENTION_BACKENDS):
            raise UnsupportedContextRequest(
                f"server configuration: {name} {value!r} is not supported with drop_message/reposition "
                f"(needs one of {', '.join(ATTENTION_BACKENDS)}; start with python -m akv.system.launch_server)", name
            )
