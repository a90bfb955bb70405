"""`keep_text_payload`: KV reuse for harnesses that trim text instead of sending AKV decisions.

Give it the payload the harness is about to send (its trimmed `messages`) and the untrimmed message
list; it returns the payload with `drop_rule: {"type": "keep_text_drop", "full_messages": ...}`,
which the server renders from the full history and drops everything the trimmed list left out. The
projection is checked here as the server checks it (each trimmed message, in order, comes from a
full message with the same role, calls and reasoning, tool id and name, its content a substring),
so a mismatch fails before the request is sent unless `force` is set (the server then serves the
trimmed list as it is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from akv.agent.errors import PayloadError
from akv.agent.payload import check_payload, copy_json

_FINGERPRINT = {"assistant": ("tool_calls", "reasoning_content"), "tool": ("tool_call_id", "name")}


def keep_text_payload(payload: Mapping[str, Any], full_messages: Sequence[Any], *, force: bool = False,
                      api_style: str = "sglang") -> dict[str, Any]:
    """A deep copy of `payload` carrying the `keep_text_drop` rule (under `extra_body` for "openai")."""
    check_payload(payload, api_style)
    trimmed = payload.get("messages")
    if not isinstance(trimmed, list) or not trimmed:
        raise PayloadError("payload field 'messages' must be a non-empty list", field="messages")
    if not isinstance(full_messages, list) or not full_messages:
        raise PayloadError("full_messages must be a non-empty list", field="full_messages")
    if type(force) is not bool:
        raise PayloadError(f"force must be a bool, got {force!r}", field="force")
    if not force:
        _check_projection(trimmed, full_messages)
    rule = {"type": "keep_text_drop", "full_messages": copy_json(full_messages, "full_messages")}
    if force:
        rule["force"] = True
    new = copy_json(dict(payload))
    if api_style == "openai":
        new["extra_body"] = {**new.get("extra_body", {}), "drop_rule": rule}
    else:
        new["drop_rule"] = rule
    return new


def _check_projection(trimmed: list[Any], full: list[Any]) -> None:
    limit = len(full)
    for j in range(len(trimmed) - 1, -1, -1):
        message = trimmed[j]
        text = _content(message, j, "messages")
        for i in range(limit - 1, -1, -1):
            if _fingerprint(full[i]) == _fingerprint(message) and text in _content(full[i], i, "full_messages"):
                limit = i
                break
        else:
            raise PayloadError(f"messages[{j}] is not part of any remaining full message (same role and calls, "
                               "content a substring, in order); pass force=True to send it anyway", message_id=j)


def _content(message: Any, index: int, field: str) -> str:
    if not isinstance(message, Mapping):
        raise PayloadError(f"{field}[{index}] must be an object", message_id=index, field=field)
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise PayloadError(f"{field}[{index}].content must be a string or null for keep_text_drop",
                           message_id=index, field=field)
    return content or ""


def _fingerprint(message: Mapping[str, Any]) -> tuple[Any, ...]:
    role = message.get("role")
    return (role, *(message.get(key) for key in _FINGERPRINT.get(role, ())))
