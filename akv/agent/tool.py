"""`DropContextTool`: a function tool through which the model itself asks to drop earlier messages."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from akv.agent import checks
from akv.agent.counting import TokenCounter, TokenLayout
from akv.agent.errors import ConfigError, HistoryError, PayloadError, TokenCountError
from akv.agent.history import CacheOperationHistory
from akv.agent.messages import parse_conversation
from akv.agent.protection import Protection
from akv.agent.receipts import REJECTED, SCHEDULED, find_model_requests

_DESCRIPTION = (
    "Stop attending to earlier messages of this conversation that are no longer needed (for example "
    "old tool results you have already used). Pass their 0-based message ids. The messages stay in "
    "the transcript but are hidden from you from the next step on; this cannot be undone. The system "
    "prompt, the task and the current step cannot be dropped.")


@dataclass(frozen=True)
class DropContextTool:
    """The `drop_context` tool: `schema()` goes into the request's `tools`; `execute()` validates a call
    and returns the receipt the harness stores as the tool result. Nothing is sent to a server: the
    policy's `ModelTrigger`/`ModelSelection` read successful receipts back from the conversation.

    A receipt says "scheduled" only for a request the policy will carry out: ids that may be dropped
    and, together, at least `min_clear_messages` messages and `min_clear_tokens` tokens (counted by
    `counter`), the policy's own minimums (`CachePolicy.drop_context_tool()` copies them). With
    `ModelTrigger` and `ModelSelection` a scheduled request is dropped at the end of its tool-call
    batch; another trigger applies it when it fires. A smaller request gets an error receipt
    (`below_minimum`) and drops nothing, so the model can ask again with more ids."""

    name: str = "drop_context"
    protection: Protection = field(default_factory=Protection)
    min_clear_messages: int = 1
    min_clear_tokens: int | None = None
    counter: TokenCounter | None = None

    def __post_init__(self) -> None:
        checks.tool_name("DropContextTool", self.name)
        if not isinstance(self.protection, Protection):
            raise ConfigError(f"DropContextTool.protection must be a Protection, got {self.protection!r}")
        checks.positive_int("DropContextTool", "min_clear_messages", self.min_clear_messages)
        checks.positive_int("DropContextTool", "min_clear_tokens", self.min_clear_tokens, optional=True)
        if self.min_clear_tokens is not None:
            checks.counter("DropContextTool (min_clear_tokens)", self.counter)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": _DESCRIPTION,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "message_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                        "minItems": 1, "description": "0-based ids of the messages to drop"},
                        "reason": {"type": "string", "description": "why these messages are no longer needed"},
                    },
                    "required": ["message_ids"],
                },
            },
        }

    def execute(self, arguments: str | Mapping[str, object], messages: Sequence[Mapping[str, object]],
                history: CacheOperationHistory | None = None, *,
                tools: Sequence[Mapping[str, object]] | None = None,
                chat_template_kwargs: Mapping[str, object] | None = None) -> dict[str, Any]:
        """Validate one call against `messages` (the conversation up to and including the assistant
        message that made the call) and `history` (the branch's latest, if any) and return its receipt:
        `{"status": "scheduled", "message_ids": [...]}` or `{"status": "error", "error": ..., <problem>:
        [ids]}` naming every bad id; problems are `unknown`, `protected` (also the current turn),
        `already_dropped` (in `history`), `already_requested` (named by an earlier scheduled receipt and
        not dropped in `history`) and `below_minimum`. `tools` and `chat_template_kwargs` are those of
        the payload, used only to count tokens for `min_clear_tokens`."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
            raise PayloadError(f"DropContextTool.execute: messages must be a list of messages, got "
                               f"{type(messages).__name__}", field="messages")
        if history is not None and not isinstance(history, CacheOperationHistory):
            raise HistoryError(f"DropContextTool.execute: history must be a CacheOperationHistory or None, got "
                               f"{type(history).__name__}")
        ids = _parse_arguments(arguments)
        if isinstance(ids, str):
            return {"status": REJECTED, "error": ids}
        caller = _calling_assistant(messages)
        conversation = parse_conversation(list(messages[:caller])) if caller > 0 else None
        current_from = conversation.boundaries[-1] + 1 if conversation and conversation.boundaries else 0
        protected = self.protection.protected(conversation) if conversation else []
        dropped = set(history.hidden) if history is not None else set()
        requested: set[int] = set()
        if conversation is not None:
            for request in find_model_requests(messages, conversation, self.name):
                requested.update(request.message_ids)
        problems: dict[str, list[int]] = {"unknown": [], "protected": [], "already_dropped": [],
                                          "already_requested": []}
        for i in ids:
            if i < 0 or i >= len(messages):
                problems["unknown"].append(i)
            elif i >= current_from or protected[i]:
                problems["protected"].append(i)
            elif i in dropped:
                problems["already_dropped"].append(i)
            elif i in requested:
                problems["already_requested"].append(i)
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            detail = "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in problems.items())
            return {"status": REJECTED, "error": f"nothing was dropped; invalid message ids ({detail})", **problems}
        ids = sorted(ids)
        short = self._below_minimum(ids, list(messages), tools, chat_template_kwargs)
        if short is not None:
            return {"status": REJECTED, "error": f"nothing was dropped; {short}", "below_minimum": ids}
        return {"status": SCHEDULED, "message_ids": ids,
                "note": "these messages will be hidden from the next step on"}

    def _below_minimum(self, ids: list[int], messages: list[Mapping[str, object]],
                       tools: Sequence[Mapping[str, object]] | None,
                       chat_template_kwargs: Mapping[str, object] | None) -> str | None:
        """Why the policy would skip dropping `ids`, or None when it would drop them."""
        if len(ids) < self.min_clear_messages:
            return (f"{len(ids)} message(s) is fewer than this policy drops at once; name at least "
                    f"{self.min_clear_messages} (min_clear_messages)")
        if self.min_clear_tokens is not None:
            layout = self.counter.layout(messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
            if not isinstance(layout, TokenLayout) or len(layout.spans) != len(messages):
                raise TokenCountError(f"{type(self.counter).__name__}.layout must return a TokenLayout with one "
                                      f"span per message ({len(messages)})")
            spans = layout.spans
            tokens = sum(spans[i][1] - spans[i][0] for i in ids)
            if tokens < self.min_clear_tokens:
                return (f"these messages hold {tokens} tokens, fewer than this policy drops at once; name at "
                        f"least {self.min_clear_tokens} tokens' worth (min_clear_tokens)")
        return None


def _parse_arguments(arguments: str | Mapping[str, object]) -> list[int] | str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "arguments are not valid JSON"
        except RecursionError:
            return "arguments nest too deeply"
    if not isinstance(arguments, Mapping):
        return "arguments must be a JSON object"
    ids = arguments.get("message_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        return f"message_ids must be a non-empty list of integers, got {ids!r}"
    if len(set(ids)) != len(ids):
        return f"message_ids must not repeat an id, got {ids!r}"
    return ids


def _calling_assistant(messages: Sequence[Mapping[str, object]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, Mapping) and message.get("role") == "assistant" and message.get("tool_calls"):
            return i
    raise PayloadError("DropContextTool.execute: messages must end with the assistant message that called the "
                       "tool (no assistant message with tool_calls found)", field="messages")
