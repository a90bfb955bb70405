"""Length checks of a context request in SGLang (the tokenizer manager, the scheduler, the
``req_to_token`` rows): the model's context length bounds its live length
(:mod:`akv.system.context.limits`), not its text. The text, one ``req_to_token`` column per token
and per generated token, is bounded by the row width: the context length widened to
:func:`text_limit` columns."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from akv.system.adapter.serving import UnsupportedContextRequest
from akv.system.context.limits import live_length, live_length_problem
from akv.system.context.program import ContextProgram
from akv.system.context.wire import WireError, decode_program, encode_program

TEXT_TOKENS_ENV = "AKV_MAX_TEXT_TOKENS"
TEXT_FACTOR = 4
"""Without ``AKV_MAX_TEXT_TOKENS``, a context request's text (prompt and generated tokens) may be up
to this many times the model's context length."""


class EncodedProgram(bytes):
    """A context program's wire form with its live length and text length, read by the tokenizer
    manager's length check without decoding; it travels on to the scheduler as plain bytes
    (:func:`wire_bytes`: SGLang's msgspec transport takes no subclass)."""

    live_length: int
    n_tokens: int

    def __new__(cls, data: bytes, program: ContextProgram) -> EncodedProgram:
        made = super().__new__(cls, data)
        made.live_length = live_length(program)
        made.n_tokens = program.n_tokens
        return made


def text_limit(context_len: int) -> int:
    """Columns of a ``req_to_token`` row: the most tokens (prompt and generated) a context request's
    text may have; ``AKV_MAX_TEXT_TOKENS`` when set (never below the context length)."""
    raw = os.environ.get(TEXT_TOKENS_ENV, "").strip()
    try:
        wanted = int(raw) if raw else TEXT_FACTOR * context_len
    except ValueError as exc:
        raise ValueError(f"{TEXT_TOKENS_ENV}={raw!r}: expected a positive integer") from exc
    return max(wanted, context_len)


def extra_columns(context_len: int) -> int:
    """Columns a ``req_to_token`` row gets beyond SGLang's own width (the context length)."""
    return text_limit(context_len) - context_len


def request_problem(program: ContextProgram, max_new_tokens: int | None, context_len: int) -> str | None:
    """Why the context request does not fit (its live length with ``max_new_tokens``, or its text
    beyond :func:`text_limit`), worded for a 400 on ``messages``; None when it fits."""
    problem = live_length_problem(program, max_new_tokens, context_len)
    if problem is not None:
        return problem
    limit = text_limit(context_len)
    if program.n_tokens >= limit:
        return (f"the text has {program.n_tokens} tokens, more than the {limit - 1} this server holds for one "
                f"request (live length {live_length(program)}; raise {TEXT_TOKENS_ENV} on the server)")
    return None


def request_program(req: Any, data: bytes, context_len: int | None) -> ContextProgram | str:
    """The program ``data`` carries for SGLang's ``req``, or a 400 message: malformed, not the request's
    tokens, or a live length over ``context_len`` (:func:`request_problem`)."""
    try:
        program = decode_program(data)
    except WireError as exc:
        return f"context_program: {exc}"
    if not np.array_equal(program.token_ids, np.asarray(req.origin_input_ids)):  # SGLang's array("q"): no copy
        return "context_program: its tokens differ from the request's input_ids"
    if context_len is not None:
        problem = request_problem(program, None, context_len)
        if problem is not None:
            return f"messages: {problem}"
    return program


def encode_checked(program: ContextProgram | None, sampling_params: dict[str, Any],
                   context_len: int) -> EncodedProgram | None:
    """The program's wire form for the scheduler (None for a plain request), after checking that it
    fits: :class:`UnsupportedContextRequest` on ``messages`` (HTTP 400) when it does not."""
    if program is None:
        return None
    problem = request_problem(program, sampling_params.get("max_new_tokens"), context_len)
    if problem is not None:
        raise UnsupportedContextRequest(f"messages: {problem}", "messages")
    return EncodedProgram(encode_program(program), program)


def wire_bytes(program: bytes | None) -> bytes | None:
    """What the tokenizer manager sends the scheduler for ``context_program``: plain bytes."""
    return None if program is None else bytes(program)


def input_tokens(obj: Any, input_ids: list[int] | None) -> int:
    """What the tokenizer manager's length check counts: a context request's live length, a plain
    request's input tokens (stock)."""
    program = getattr(obj, "context_program", None)
    if isinstance(program, EncodedProgram):
        return program.live_length
    return len(input_ids) if input_ids is not None else 0


def held_length(req: Any) -> int:
    """What the scheduler's ``max_new_tokens`` clip counts as the input: a context request's live
    length (its text's columns are clipped by :func:`akv.system.adapter.scheduling.attach`); on a PD
    decode server, the program's next position."""
    state, pd = getattr(req, "akv", None), getattr(req, "akv_pd", None)
    if pd is not None:
        return pd.layout.next_position
    return len(req.origin_input_ids) if state is None else live_length(state.base)


def validate_input_length(stock: Any, req: Any, max_req_input_len: int, allow_auto_truncate: bool) -> str | None:
    """SGLang's ``validate_input_length`` for a plain request; for a context request its live length
    against ``max_req_input_len`` (a context request is never truncated: its drops name its tokens)."""
    state = getattr(req, "akv", None)
    if state is None:
        return stock(req, max_req_input_len, allow_auto_truncate)
    problem = live_length_problem(state.base, None, max_req_input_len)
    if problem is None:
        return None
    req.akv = None  # refused before it took anything: SGLang aborts it as a plain request
    return f"messages: {problem}"
