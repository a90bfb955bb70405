"""Hooks for the patched ``sglang/srt/entrypoints/openai/protocol.py``: AKV request fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from akv.system.context.rules import ContextRules, is_plain_request, parse_rules


def check_context_fields(values: Any) -> Any:
    """Body of ``ChatCompletionRequest``'s 'before' validator: check ``drop_message``/``reposition``.

    Runs the context rules on the raw JSON values (so ``"1"`` or ``true`` are not coerced to ids)
    against ``len(messages)``; a bad value raises a ``RuleError`` (a ``ValueError``) naming the
    field, which SGLang answers with HTTP 400. Plain requests pass through untouched.
    """
    if not isinstance(values, Mapping):
        return values
    drop_message = values.get("drop_message")
    reposition = values.get("reposition")
    if is_plain_request(drop_message, reposition):
        return values
    messages = values.get("messages")
    if isinstance(messages, (list, tuple)):
        parse_rules(drop_message, reposition, len(messages))
    return values


def request_rules(request: Any) -> ContextRules | None:
    """The parsed cache operations of a validated request, or None for a plain request."""
    drop_message = request.drop_message
    reposition = request.reposition
    if is_plain_request(drop_message, reposition):
        return None
    return parse_rules(drop_message, reposition, len(request.messages))
