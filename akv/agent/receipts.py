"""Reading `drop_context` receipts back out of the conversation, where the harness stored them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from akv.agent.messages import Conversation

SCHEDULED = "scheduled"
REJECTED = "error"


@dataclass(frozen=True)
class ModelRequest:
    """A successful `drop_context` receipt: the model asked to drop `message_ids`; the request takes
    effect at `boundary`, the end of the tool-call batch that carried it."""

    boundary: int
    message_ids: tuple[int, ...]


def parse_receipt(content: object) -> tuple[int, ...] | None:
    """The ids of a successful receipt stored as a tool message's content, else None."""
    if not isinstance(content, str) or '"status"' not in content:
        return None
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("status") != SCHEDULED:
        return None
    ids = data.get("message_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        return None
    return tuple(ids)


def find_model_requests(messages: Sequence[Mapping[str, object]], conversation: Conversation,
                        tool_name: str) -> tuple[ModelRequest, ...]:
    """Every successful receipt of `tool_name` in the conversation, in message order."""
    found = []
    for batch in conversation.batches:
        for r in batch.results:
            if conversation.tool_names[r] == tool_name:
                ids = parse_receipt(messages[r].get("content"))
                if ids is not None:
                    found.append(ModelRequest(batch.end, ids))
    return tuple(found)
