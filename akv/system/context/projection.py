"""``keep_text_drop``: serve a text-trimmed conversation from the full conversation's KV.

The request's ``messages`` are a *visible projection* of ``full_messages``: each visible message
comes, in order, from a full message with the same fingerprint (role; for assistants their
``tool_calls`` and ``reasoning_content``; for tool results ``tool_call_id`` and ``name``) whose
content holds the visible content (the latest such message and the latest occurrence). The server
renders the full history and, after its last message, drops every full message no visible message
came from (with its template tokens) and, in partly kept messages, the tokens wholly inside the
characters that were cut (template tokens and tokens overlapping the kept text stay).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv.system.context.compiler import TokenDrop
from akv.system.context.drop_rule import KeepTextDrop, RequestRules
from akv.system.context.provenance import TokenProvenance
from akv.system.context.rules import RuleError, RuleShapeError, parse_rules
from akv.system.context.spans import (
    Render,
    SpanError,
    check_content,
    content_starts,
    message_tokens,
    one_drop,
    tokens_inside,
)

_FINGERPRINT = {"assistant": ("tool_calls", "reasoning_content"), "tool": ("tool_call_id", "name")}


class ProjectionError(RuleError):
    """A visible message does not come from any remaining full message."""


@dataclass(frozen=True)
class Projection:
    """Per full message, the kept character range of its content, or None when it is dropped whole;
    ``contents`` are the full contents the ranges index."""

    kept: tuple[tuple[int, int] | None, ...]
    contents: tuple[str, ...]


def project(visible: Sequence[Mapping[str, Any]], full: Sequence[Mapping[str, Any]]) -> Projection:
    """Match ``visible`` into ``full`` from the end, each message to the latest candidate left."""
    for field, messages in (("messages", visible), ("drop_rule.full_messages", full)):
        for i, message in enumerate(messages):
            if not isinstance(message.get("content"), (str, type(None))):
                raise RuleShapeError(f"{field}[{i}].content", None, "keep_text_drop needs string (or null) contents")
    kept: list[tuple[int, int] | None] = [None] * len(full)
    limit = len(full)
    for j in range(len(visible) - 1, -1, -1):
        text = visible[j].get("content") or ""
        key = _fingerprint(visible[j])
        for i in range(limit - 1, -1, -1):
            source = full[i].get("content") or ""
            at = source.rfind(text)
            if at >= 0 and _fingerprint(full[i]) == key:
                kept[i] = (at, at + len(text))
                limit = i
                break
        else:
            raise ProjectionError(f"messages[{j}]", visible[j].get("role"),
                                  "is not part of any remaining message of drop_rule.full_messages "
                                  "(same role and calls, content a substring, in order)")
    return Projection(tuple(kept), tuple(m.get("content") or "" for m in full))


def resolve_keep_text(
    rule: KeepTextDrop, visible: Sequence[Mapping[str, Any]], full: Sequence[Mapping[str, Any]], reposition: Any
) -> tuple[Sequence[Mapping[str, Any]], RequestRules]:
    """The messages to render and the rules to compile: the full history with its projection, or, when
    the projection does not match and ``force`` is set, the visible messages with no drop."""
    try:
        projection = project(visible, full)
    except ProjectionError:
        if not rule.force:
            raise
        return visible, RequestRules(parse_rules(None, reposition, len(visible)))
    return full, RequestRules(parse_rules(None, reposition, len(full)), projection)


def projection_drops(provenance: TokenProvenance, full: Sequence[Mapping[str, Any]], projection: Projection,
                     render: Render) -> tuple[TokenDrop, ...]:
    """The one drop, after the last full message, hiding all that was not kept."""
    if len(full) != len(projection.kept):
        raise SpanError(f"drop_rule.full_messages: {len(full)} messages rendered, {len(projection.kept)} projected")
    for i, span in enumerate(projection.kept):
        if span is not None:
            check_content(full[i].get("content") or "", i, projection.contents[i])
    partial = [i for i, span in enumerate(projection.kept)
               if span is not None and span != (0, len(full[i].get("content") or ""))]
    starts = content_starts(render, full, partial, provenance.text)

    def found() -> Iterator[tuple[int, list[tuple[int, int]]]]:
        for i, span in enumerate(projection.kept):
            content = full[i].get("content") or ""
            if span is None:
                yield i, [message_tokens(provenance, i)]
            elif span != (0, len(content)):
                base = starts[i]
                cut = [(base, base + span[0]), (base + span[1], base + len(content))]
                yield i, list(tokens_inside(provenance, cut, i))

    return one_drop(len(full) - 1, found())


def _fingerprint(message: Mapping[str, Any]) -> tuple[Any, ...]:
    role = message.get("role")
    return (role, *(message.get(key) for key in _FINGERPRINT.get(role, ())))
