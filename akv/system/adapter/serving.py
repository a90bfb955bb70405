"""Hooks for the patched ``serving_chat.py``: admit or refuse a context request, then compile its
program from the very prompt SGLang rendered; for ``serving_base.py``: convert a context request
(render, provenance, compile) in a worker thread, off the HTTP event loop."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from akv.system.adapter.protocol import request_rules
from akv.system.context.program import ContextProgram
from akv.system.context.request import compile_request
from akv.system.context.provenance import ProvenanceError
from akv.system.context.rules import ContextRules, RuleError, is_plain_request
from akv.system.context.wire import encode_program

REQUIRED_PAGE_SIZE = 1
REQUIRED_ATTENTION_BACKEND = "triton"
REQUIRED_RADIX_CACHE_BACKEND = "akv"

_CONVERTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="akv-convert")
"""One worker: conversions of context requests run one at a time, the tokenizer is never shared
between two of them, and the event loop keeps serving while one runs."""

_RENDER_ARGUMENTS = frozenset({"tokenizer", "messages", "drop_message", "reposition", "tools", "add_generation_prompt"})

_UNSUPPORTED_OPTIONS: tuple[tuple[str, str], ...] = (
    ("speculative_algorithm", "speculative decoding"),
    ("enable_hierarchical_cache", "the hierarchical cache"),
    ("enable_lora", "LoRA"),
    ("enable_mixed_chunk", "mixed chunked prefill"),
    ("enable_dp_attention", "DP attention"),
    ("disable_radix_cache", "a disabled radix cache"),
)


class UnsupportedContextRequest(ValueError):
    """A request with ``drop_message``/``reposition`` uses a mode or server setting AKV cannot serve;
    ``param`` names the request field or server option in the way."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def error_param(error: ValueError) -> str | None:
    """The ``param`` of SGLang's 400 for an AKV refusal (None for SGLang's own errors)."""
    if isinstance(error, RuleError):
        return error.field.split("[", 1)[0]
    if isinstance(error, UnsupportedContextRequest):
        return error.param
    if isinstance(error, ProvenanceError):
        return "messages"
    return None


async def convert_request(serving: Any, request: Any, raw_request: Any) -> Any:
    """``serving._convert_to_internal_request(request, raw_request)``: inline for a plain request
    (stock behaviour), in the worker thread for a context request, whose template render,
    provenance and compile can take seconds for a long conversation."""
    if is_plain_request(getattr(request, "drop_message", None), getattr(request, "reposition", None)):
        return serving._convert_to_internal_request(request, raw_request)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_CONVERTER, serving._convert_to_internal_request, request, raw_request)


def prepare_context_request(serving: Any, request: Any, is_multimodal: bool) -> ContextRules | None:
    """Rules of a context request after checking it can be served, None for a plain request.

    ``serving`` is SGLang's ``OpenAIServingChat``. Raises :class:`UnsupportedContextRequest`
    (HTTP 400) naming the field or server setting in the way.
    """
    rules = request_rules(request)
    if rules is None:
        return None
    _check_request_mode(request, is_multimodal)
    _check_renderer(serving.template_manager.chat_template_name, serving.chat_encoding_spec)
    _check_server(serving.tokenizer_manager.server_args)
    return rules


def encode_context_program(program: ContextProgram | None) -> bytes | None:
    """The program's wire form for the scheduler (None for a plain request)."""
    return None if program is None else encode_program(program)


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

    The attributed render must reproduce ``prompt_ids`` token for token, else
    :class:`UnsupportedContextRequest`; template ownership problems raise ``ProvenanceError``.
    """
    if is_plain_request(request.drop_message, request.reposition):
        return None
    clash = sorted(set(template_kwargs) & _RENDER_ARGUMENTS)
    if clash:
        raise UnsupportedContextRequest(
            f"chat_template_kwargs[{clash[0]!r}]: collides with an argument AKV renders the template with "
            f"({', '.join(sorted(_RENDER_ARGUMENTS))}); rename the template variable", "chat_template_kwargs"
        )
    compiled = compile_request(
        tokenizer, messages, drop_message=request.drop_message, reposition=request.reposition, tools=tools,
        **template_kwargs,
    )
    expected = [int(t) for t in prompt_ids]
    got = compiled.program.token_ids.tolist()
    if got != expected:
        at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise UnsupportedContextRequest(
            f"chat_template: the attributed render differs from the server's prompt at token {at} "
            f"(lengths {len(got)} vs {len(expected)}); drop_message/reposition cannot be placed",
            "messages",
        )
    return compiled.program


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
    for name, what in _UNSUPPORTED_OPTIONS:
        if getattr(server_args, name, None):
            raise UnsupportedContextRequest(
                f"server configuration: {name} ({what}) is not supported with drop_message/reposition", name
            )
    if getattr(server_args, "pp_size", 1) != 1:
        raise UnsupportedContextRequest(
            f"server configuration: pp_size {server_args.pp_size!r} is not supported with drop_message/reposition",
            "pp_size",
        )
    if server_args.radix_cache_backend != REQUIRED_RADIX_CACHE_BACKEND:
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
        if value not in (None, REQUIRED_ATTENTION_BACKEND):
            raise UnsupportedContextRequest(
                f"server configuration: {name} {value!r} is not supported with drop_message/reposition "
                f"(needs {REQUIRED_ATTENTION_BACKEND!r}; start with python -m akv.system.launch_server)", name
            )
