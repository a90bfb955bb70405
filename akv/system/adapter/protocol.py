"""Hooks for the patched ``sglang/srt/entrypoints/openai/protocol.py``: AKV request fields.

``drop_message`` / ``reposition`` / ``drop_rule`` are declared as sent (no pydantic coercion, so
``"1"`` or ``true`` reach the wire rules as they are) and checked by :func:`request_rules` in the
serving path, which SGLang answers with a clean 400. Plain requests parse exactly as stock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from akv.system.context.drop_rule import RequestRules, is_context_request, parse_request_rules
from akv.system.context.rules import RuleError

FIELDS = ("drop_message", "reposition", "drop_rule")
KNOWN = (*FIELDS, "akv_dry_run")
"""Top-level AKV fields of a chat completion (``akv_dry_run``: :mod:`akv.system.adapter.preview`)."""


class UnknownContextField(RuleError):
    """A request field that looks like an AKV cache operation but is not one (a misspelling)."""


def note_unknown_fields(values: Any) -> Any:
    """Body of ``ChatCompletionRequest``'s first 'before' validator: refuse a body that is not a JSON
    object (the stock validators after it read it as a dict); remember top-level keys that look like
    misspelt AKV fields (``drop_messages``, ``repositions``...) so the request is refused with a 400
    instead of being served silently as a plain request."""
    if not isinstance(values, Mapping):
        from pydantic_core import PydanticCustomError

        raise PydanticCustomError("object_type", "the request body must be a JSON object, got {kind}",
                                  {"kind": _json_kind(values)})
    unknown = sorted(k for k in values if isinstance(k, str) and k not in KNOWN and _looks_like_akv(k))
    return {**values, "akv_unknown_fields": unknown} if unknown else values


def request_rules(request: Any) -> RequestRules | None:
    """The parsed cache operations of a request, or None for a plain one; a bad or misspelt field
    raises a ``RuleError`` (``ValueError``) naming it."""
    for key in request.akv_unknown_fields or ():
        raise UnknownContextField(
            key, None, "unknown field; AKV's cache operations are 'drop_message', 'drop_rule' and 'reposition'")
    drop_rule = getattr(request, "drop_rule", None)
    if not is_context_request(request.drop_message, drop_rule, request.reposition):
        return None
    messages = [message_dict(m) for m in request.messages]
    return parse_request_rules(request.drop_message, drop_rule, request.reposition, messages)


def message_dict(message: Any) -> dict[str, Any]:
    """A request message as the plain dict the rules read (pydantic messages are dumped)."""
    return message.model_dump() if hasattr(message, "model_dump") else dict(message)


def _json_kind(value: Any) -> str:
    kinds = ((bool, "a boolean"), (str, "a string"), ((int, float), "a number"), (list, "an array"))
    return "null" if value is None else next((k for t, k in kinds if isinstance(value, t)), type(value).__name__)


def _looks_like_akv(key: str) -> bool:
    lowered = key.lower().replace("-", "_")
    return lowered.startswith(("drop", "repos", "akv"))
