"""``thinking_drop``: assistant reasoning is dropped, by default right after each message.

A message's reasoning is its ``reasoning_content`` or a single leading ``<think>…</think>`` block of
its content (not both, no nesting). The dropped tokens are those wholly inside the rendered block:
from ``<think>`` through ``</think>`` and the newlines after it, so the message's own answer still
read them and later messages do not. The template must render historical reasoning: Qwen3's drops it
before the latest user turn, so :func:`retain_thinking` patches that guard for the request.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from akv.system.context.compiler import TokenDrop
from akv.system.context.rules import Drop
from akv.system.context.provenance import TokenProvenance
from akv.system.context.spans import SpanError, message_text, tokens_inside

OPEN, CLOSE = "<think>", "</think>"
# Qwen3's chat template renders reasoning only for assistant messages after the latest user query.
_QWEN3_GUARD = re.compile(r"\{%-?\s*if\s+loop\.index0\s*>\s*ns\.last_query_index\s*-?%\}")


class ThinkingError(SpanError):
    """An assistant message's reasoning cannot be told apart or was not rendered."""


def retain_thinking(template: str) -> str:
    """``template`` with Qwen3's "no reasoning before the latest user turn" guard lifted; other
    templates are returned as they are (a missing block then fails in :func:`thinking_drops`)."""
    return _QWEN3_GUARD.sub("{%- if true %}", template)


def reasoning(message: Mapping[str, Any], index: int) -> str | None:
    """The reasoning text of an assistant message, None when it has none."""
    if message.get("role") != "assistant":
        return None
    content = message.get("content")
    given = message.get("reasoning_content")
    leading = isinstance(content, str) and content.lstrip().startswith(OPEN)
    if isinstance(given, str) and given:
        if leading:
            raise ThinkingError(f"messages[{index}]: has both reasoning_content and a leading {OPEN} block")
        return given
    if not leading:
        return None
    body = content.lstrip()[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0 or OPEN in body[:end]:
        raise ThinkingError(f"messages[{index}].content: its leading {OPEN} block is unclosed or nested")
    return body[:end]


def thinking_drops(provenance: TokenProvenance, messages: Sequence[Mapping[str, Any]],
                   schedule: Sequence[Drop] | None = None) -> tuple[TokenDrop, ...]:
    """The reasoning drops: by ``schedule`` (after each anchor, the reasoning of its listed assistant
    messages), or, without one, each assistant message's reasoning right after that message."""
    if schedule is None:
        schedule = [Drop(i, (i,)) for i, m in enumerate(messages) if reasoning(m, i) is not None]
    drops = []
    for drop in schedule:
        ranges: list[tuple[int, int]] = []
        for i in drop.messages:
            thought = reasoning(messages[i], i)
            if thought is None:
                raise ThinkingError(
                    f"messages[{i}]: has no reasoning to drop (no reasoning_content, no leading {OPEN})")
            start, end = _block(provenance, i, thought)
            ranges.extend(tokens_inside(provenance, [(start, end)], i))
        if ranges:
            drops.append(TokenDrop(drop.anchor, drop.messages, tuple(sorted(ranges))))
    return tuple(drops)


def _block(provenance: TokenProvenance, index: int, thought: str) -> tuple[int, int]:
    lo, hi = message_text(provenance, index)
    region = provenance.text[lo:hi]
    opens, closes = region.count(OPEN), region.count(CLOSE)
    if opens == 0 and closes == 0:
        raise ThinkingError(
            f"messages[{index}]: the chat template did not render its reasoning (it drops historical "
            "reasoning); thinking_drop needs a template that keeps it"
        )
    if opens != 1 or closes != 1:
        raise ThinkingError(f"messages[{index}]: its rendering has {opens} {OPEN} and {closes} {CLOSE} markers; "
                            "the reasoning block is ambiguous")
    start = region.find(OPEN)
    close = region.find(CLOSE)
    if close < start or thought.strip() not in region[start + len(OPEN):close]:
        raise ThinkingError(f"messages[{index}]: its rendered {OPEN} block does not hold its reasoning")
    end = close + len(CLOSE)
    while end < len(region) and region[end] == "\n":
        end += 1
    return lo + start, lo + end
