"""Reasoning drops for `CachePolicy(keep_thinking_turns=N)`: the `thinking_drop` schedule.

At the boundary of turn t, the reasoning of every assistant message up to the boundary of turn
t - N (a `reasoning_content`, or content opening with a `<think>` block) is dropped, unless the
message itself was already dropped whole. The schedule depends on the messages and the history
only, so every call recomputes the same schedule for the same prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

THINK = "<think>"


def has_reasoning(message: Any) -> bool:
    """True for an assistant message carrying reasoning the server's `thinking_drop` can drop."""
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return False
    given = message.get("reasoning_content")
    content = message.get("content")
    return (isinstance(given, str) and bool(given)) or (isinstance(content, str) and content.lstrip().startswith(THINK))


def thinking_schedule(messages: Sequence[Any], boundaries: Sequence[int], keep_turns: int,
                      dropped_at: Mapping[int, int]) -> dict[str, list[int]]:
    """Wire form `{"boundary": [assistant ids]}`; `dropped_at` maps a wholly dropped message to its anchor."""
    pending = [i for i, m in enumerate(messages) if has_reasoning(m)]
    schedule: dict[str, list[int]] = {}
    for turn in range(keep_turns, len(boundaries)):
        anchor, limit = boundaries[turn], boundaries[turn - keep_turns]
        due = [i for i in pending if i <= limit]
        pending = [i for i in pending if i > limit]
        due = [i for i in due if dropped_at.get(i, anchor + 1) > anchor]
        if due:
            schedule[str(anchor)] = due
    return schedule


def thinking_rule(schedule: dict[str, list[int]], drop_message: dict[str, list[int]]) -> dict[str, Any]:
    """The `drop_rule` carrying the reasoning schedule and the policy's whole-message drops."""
    rule: dict[str, Any] = {"type": "thinking_drop", "thinking": schedule}
    if drop_message:
        rule["drop_messages"] = drop_message
    return rule
