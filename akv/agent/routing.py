"""Conversation affinity behind a router: the routing key of a conversation.

A conversation's KV lives on the worker that served it, and every branch (fork) of it shares the KV
of its first messages. The routing key names the conversation's *root*: the model, tools and
template settings, and the messages up to and including the first user message (every message
when there is none). Forks of one conversation share it, conversations with another root do not,
and it never changes as the conversation grows. A router that pins keys to workers (smg with
``--routing-key-override`` or ``--policy manual``, see ``python -m akv.system.launch_router``)
then sends every turn of every branch to the worker holding its KV."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from akv.agent.errors import PayloadError
from akv.agent.jsonvalue import validate_json

ROUTING_HEADER = "x-smg-routing-key"
"""The header smg reads a routing key from; ``send_chat_request`` sets it."""

_ROOT_SETTINGS = ("model", "tools", "chat_template_kwargs", "reasoning_effort")
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def conversation_root(messages: list[Any]) -> list[Any]:
    """The messages every branch of the conversation starts with: up to and including the first
    user message (all of them when there is none)."""
    for i, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return messages[:i + 1]
    return messages


def routing_key(payload: Mapping[str, Any]) -> str:
    """The routing key of the conversation ``payload`` belongs to (``akv-`` and 32 hex digits).
    Settings under ``extra_body`` (the OpenAI SDK's form) count as top-level ones. PayloadError
    when ``messages`` is not a non-empty list or the root is not JSON."""
    if not isinstance(payload, Mapping):
        raise PayloadError(f"payload must be a mapping, got {type(payload).__name__}")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise PayloadError("messages must be a non-empty list to derive a routing key", field="messages")
    extra = payload.get("extra_body")
    sources = [payload, extra] if isinstance(extra, Mapping) else [payload]
    settings = {key: next((s[key] for s in sources if key in s), None) for key in _ROOT_SETTINGS}
    root = conversation_root(messages)
    validate_json(root, "messages")
    for key, value in settings.items():
        validate_json(value, key)
    digest = hashlib.sha256(_ENCODER.encode({"settings": settings, "root": root}).encode("ascii"))
    return "akv-" + digest.hexdigest()[:32]
