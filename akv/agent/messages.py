"""Validation of the chat message list and its structure: roles, tool-call batches, turn boundaries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from akv.agent.errors import PayloadError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Batch:
    """An assistant message with tool calls and the tool messages answering them, in order."""

    assistant: int
    results: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.results[-1]


@dataclass(frozen=True)
class Conversation:
    """The validated structure of a message list.

    `tool_names[i]` is the function name a tool message answers (None for other roles);
    `batch_of[i]` is the index into `batches` of the batch holding message i, or -1.
    `boundaries` are the message ids at which the policy decides: the last result of every
    completed tool-call batch, plus any user messages the caller declared as completed turns."""

    roles: tuple[str, ...]
    tool_names: tuple[str | None, ...]
    batches: tuple[Batch, ...]
    batch_of: tuple[int, ...]
    boundaries: tuple[int, ...]
    first_user: int | None

    def __len__(self) -> int:
        return len(self.roles)


def _tool_calls(message: Mapping[str, object], i: int) -> dict[str, str]:
    """Function name by tool-call id, in call order."""
    calls = message.get("tool_calls")
    if calls is None:
        return {}
    if not isinstance(calls, list):
        raise PayloadError(f"message {i}: tool_calls must be a list, got {type(calls).__name__}",
                           message_id=i, field="tool_calls")
    out: dict[str, str] = {}
    for k, call in enumerate(calls):
        if type(call) is not dict and not isinstance(call, Mapping):
            raise PayloadError(f"message {i}: tool_calls[{k}] must be an object", message_id=i, field="tool_calls")
        call_id = call.get("id")
        function = call.get("function")
        name = function.get("name") if type(function) is dict or isinstance(function, Mapping) else None
        if not isinstance(call_id, str) or not call_id:
            raise PayloadError(f"message {i}: tool_calls[{k}].id must be a non-empty string, got {call_id!r}",
                               message_id=i, field="tool_calls")
        if not isinstance(name, str) or not name:
            raise PayloadError(f"message {i}: tool_calls[{k}].function.name must be a non-empty string, "
                               f"got {name!r}", message_id=i, field="tool_calls")
        if call_id in out:
            raise PayloadError(f"message {i}: duplicate tool-call id {call_id!r}", message_id=i, field="tool_calls")
        out[call_id] = name
    return out


def parse_conversation(messages: object,
                       completed_call_message_ids: Sequence[int] | None = None) -> Conversation:
    """Validate `messages` and find its tool-call batches and decision boundaries.

    Raises PayloadError naming the message id for unknown roles, orphan tool messages, duplicate
    tool-call ids, missing or extra tool results, and bad `completed_call_message_ids`."""
    if not isinstance(messages, list) or not messages:
        raise PayloadError("payload field 'messages' must be a non-empty list", field="messages")
    n = len(messages)
    roles: list[str] = []
    tool_names: list[str | None] = [None] * n
    batch_of = [-1] * n
    batches: list[Batch] = []
    ends: list[int] = []
    first_user: int | None = None
    pending: dict[str, str] = {}
    open_assistant = -1
    open_results: list[int] = []

    def close_batch(at: int) -> None:
        nonlocal open_assistant, open_results
        if pending:
            raise PayloadError(
                f"message {open_assistant}: missing tool results for call ids {sorted(pending)}"
                + (f" before message {at}" if at < n else " at the end of the conversation"),
                message_id=open_assistant, field="messages")
        index = len(batches)
        batch_of[open_assistant] = index
        for r in open_results:
            batch_of[r] = index
        batches.append(Batch(open_assistant, tuple(open_results)))
        ends.append(open_results[-1])
        open_assistant, open_results = -1, []

    for i, message in enumerate(messages):
        if type(message) is not dict and not isinstance(message, Mapping):
            raise PayloadError(f"message {i}: must be an object, got {type(message).__name__}",
                               message_id=i, field="messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise PayloadError(f"message {i}: unknown role {role!r} (expected one of {sorted(ROLES)})",
                               message_id=i, field="role")
        roles.append(role)  # type: ignore[arg-type]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if open_assistant < 0:
                raise PayloadError(f"message {i}: tool result without a preceding assistant tool call",
                                   message_id=i, field="tool_call_id")
            if not isinstance(call_id, str) or call_id not in pending:
                problem = ("answers a call already answered" if isinstance(call_id, str) and any(
                    messages[r].get("tool_call_id") == call_id for r in open_results)
                    else f"does not answer any call of message {open_assistant}")
                raise PayloadError(f"message {i}: extra tool result: tool_call_id {call_id!r} {problem}",
                                   message_id=i, field="tool_call_id")
            tool_names[i] = pending.pop(call_id)
            open_results.append(i)
            continue
        if open_assistant >= 0:
            close_batch(i)
        if role == "assistant":
            calls = _tool_calls(message, i)
            if calls:
                open_assistant = i
                pending = calls
        elif role == "user" and first_user is None:
            first_user = i
    if open_assistant >= 0:
        close_batch(n)
    native = tuple(ends)
    boundaries = native if completed_call_message_ids is None else _explicit_boundaries(
        completed_call_message_ids, roles, native)
    return Conversation(tuple(roles), tuple(tool_names), tuple(batches), tuple(batch_of), boundaries, first_user)


def _explicit_boundaries(ids: Sequence[int], roles: list[str], native: tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise PayloadError("completed_call_message_ids must be a sequence of message ids",
                           field="completed_call_message_ids")
    native_set = set(native)
    previous = -1
    for i in ids:
        if type(i) is not int or not 0 <= i < len(roles):
            raise PayloadError(f"completed_call_message_ids: {i!r} is not a message id in [0, {len(roles)})",
                               field="completed_call_message_ids")
        if i <= previous:
            raise PayloadError(f"completed_call_message_ids: {i} does not strictly increase after {previous}",
                               message_id=i, field="completed_call_message_ids")
        if roles[i] == "tool" and i not in native_set:
            raise PayloadError(f"completed_call_message_ids: message {i} is a tool result that does not "
                               f"complete its batch", message_id=i, field="completed_call_message_ids")
        if roles[i] not in ("tool", "user"):
            raise PayloadError(f"completed_call_message_ids: message {i} has role {roles[i]!r}; a completed "
                               f"turn ends at a tool or user message", message_id=i,
                               field="completed_call_message_ids")
        previous = i
    missing = sorted(native_set.difference(ids))
    if missing:
        raise PayloadError(f"completed_call_message_ids must include every completed tool-call batch; "
                           f"missing {missing}", message_id=missing[0], field="completed_call_message_ids")
    return tuple(ids)
