"""Character spans of a rendered prompt -> the tokens they hold (text drops at token granularity).

Where a message's content lies in the prompt is measured, not searched for: the template is rendered
once more with a private-use sentinel appended to each content that must be placed, and the result
must be the prompt with only the sentinels inserted, each right after a verbatim copy of its content.
A span of the content maps to the tokens lying wholly inside it (a token straddling the span's edge is
kept). Anything else (content rewritten by the template, a template that reacts to the sentinel)
raises :class:`SpanError` naming the message.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from akv.system.context.compiler import TokenDrop, merge_spans
from akv.system.context.drop_rule import TextDrop
from akv.system.context.provenance import ProvenanceError, TokenProvenance


Render = Callable[[Sequence[Mapping[str, Any]]], str]
"""Renders messages exactly as the prompt was rendered (same template, tools and variables)."""



class SpanError(ProvenanceError):
    """A text span cannot be placed on the rendered prompt without guessing."""


def message_tokens(provenance: TokenProvenance, message: int) -> tuple[int, int]:
    """Half-open token range owned by ``message`` (owners are non-decreasing)."""
    owners = provenance.owners
    return int(np.searchsorted(owners, message, "left")), int(np.searchsorted(owners, message, "right"))


def message_text(provenance: TokenProvenance, message: int) -> tuple[int, int]:
    """Half-open character range covered by the tokens ``message`` owns."""
    start, end = message_tokens(provenance, message)
    if start == end:
        return 0, 0
    return int(provenance.offsets[start, 0]), int(provenance.offsets[end - 1, 1])


def check_content(actual: Any, index: int, expected: str) -> None:
    """The rendered message ``index`` still has (as ``actual``) the content a rule was parsed against."""
    if actual != expected:
        raise SpanError(f"messages[{index}].content: differs from the content the drop_rule was checked against "
                        "(the server normalised it)")


def content_starts(render: Render, messages: Sequence[Mapping[str, Any]], indices: Sequence[int], text: str
                   ) -> dict[int, int]:
    """Start, in the rendered ``text``, of the content of each message in ``indices``."""
    if not indices:
        return {}
    nonce = secrets.token_hex(6)
    sentinel = re.compile(f"\ue000{nonce}([0-9]+)\ue001")
    marked = [dict(m) for m in messages]
    for i in indices:
        marked[i]["content"] = f"{messages[i]['content']}\ue000{nonce}{i}\ue001"
    variant = render(marked)
    ends: dict[int, int] = {}
    removed = 0
    for match in sentinel.finditer(variant):
        i = int(match.group(1))
        if i in ends or i not in indices:
            raise SpanError(f"messages[{i}].content: the chat template renders it more than once")
        ends[i] = match.start() - removed
        removed += match.end() - match.start()
    starts = {}
    for i in indices:
        content = messages[i]["content"]
        if i not in ends or sentinel.sub("", variant) != text or text[ends[i] - len(content) : ends[i]] != content:
            raise SpanError(f"messages[{i}].content: not rendered verbatim by the chat template, so its "
                            "characters cannot be placed")
        starts[i] = ends[i] - len(content)
    return starts


def tokens_inside(provenance: TokenProvenance, spans: Sequence[tuple[int, int]], message: int
                  ) -> tuple[tuple[int, int], ...]:
    """Token ranges of ``message`` whose characters lie wholly inside the character ``spans``."""
    offsets = provenance.offsets
    lo, hi = message_tokens(provenance, message)
    starts, ends = offsets[lo:hi, 0], offsets[lo:hi, 1]
    out = []
    for a, b in merge_spans(spans):
        first = lo + int(np.searchsorted(starts, a, "left"))
        last = lo + int(np.searchsorted(ends, b, "right"))
        if first < last:
            out.append((first, last))
    return merge_spans(out)


def text_drops(provenance: TokenProvenance, messages: Sequence[Mapping[str, Any]], rule: TextDrop, render: Render
               ) -> tuple[TokenDrop, ...]:
    """The one drop a ``text_drop`` rule makes (none when it selects no whole token)."""
    for selection in rule.selections:
        check_content(messages[selection.message].get("content"), selection.message, selection.content)
    starts = content_starts(render, messages, [s.message for s in rule.selections if not s.whole], provenance.text)

    def found() -> Iterator[tuple[int, list[tuple[int, int]]]]:
        for selection in rule.selections:
            i = selection.message
            if selection.whole:
                yield i, [message_tokens(provenance, i)]
            else:
                base = starts[i]
                yield i, list(tokens_inside(provenance, [(base + s, base + e) for s, e in selection.ranges], i))

    return one_drop(rule.anchor, found())


def one_drop(anchor: int, found: Iterable[tuple[int, Sequence[tuple[int, int]]]]) -> tuple[TokenDrop, ...]:
    """The single drop at ``anchor`` of the token ranges found per message (none when no range holds
    a token)."""
    touched: list[int] = []
    ranges: list[tuple[int, int]] = []
    for message, spans in found:
        spans = [r for r in spans if r[0] < r[1]]
        if spans:
            touched.append(message)
            ranges.extend(spans)
    return (TokenDrop(anchor, tuple(touched), merge_spans(ranges)),) if ranges else ()
