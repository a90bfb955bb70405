"""Character spans of a rendered prompt -> the tokens they hold (text drops at token granularity).

A message's content is found verbatim inside the characters its tokens cover; a span of it maps to
the tokens lying wholly inside the span (a token straddling the span's edge is kept). Anything that
would need a guess (content rendered changed, or found more than once in its message's rendering)
raises :class:`SpanError` naming the message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from akv.system.context.compiler import TokenDrop
from akv.system.context.drop_rule import TextDrop, merge_spans
from akv.system.context.provenance import ProvenanceError, TokenProvenance


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


def locate(provenance: TokenProvenance, message: int, piece: str, what: str) -> int:
    """Start, in the rendered text, of the one verbatim occurrence of ``piece`` in ``message``'s rendering."""
    lo, hi = message_text(provenance, message)
    region = provenance.text[lo:hi]
    first = region.find(piece)
    if first < 0:
        raise SpanError(f"messages[{message}].{what}: not rendered verbatim by the chat template, so its "
                        "characters cannot be placed")
    if region.find(piece, first + 1) >= 0:
        raise SpanError(f"messages[{message}].{what}: occurs more than once in the message's rendering, so its "
                        "characters cannot be placed")
    return lo + first


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


def text_drops(provenance: TokenProvenance, messages: Sequence[Mapping[str, Any]], rule: TextDrop
               ) -> tuple[TokenDrop, ...]:
    """The one drop a ``text_drop`` rule makes (none when it selects no whole token)."""
    ranges: list[tuple[int, int]] = []
    touched = []
    for selection in rule.selections:
        i = selection.message
        if selection.whole:
            found = [message_tokens(provenance, i)]
        else:
            base = locate(provenance, i, messages[i]["content"], "content")
            found = list(tokens_inside(provenance, [(base + s, base + e) for s, e in selection.ranges], i))
        found = [r for r in found if r[0] < r[1]]
        if found:
            touched.append(i)
            ranges.extend(found)
    if not ranges:
        return ()
    return (TokenDrop(rule.anchor, tuple(touched), merge_spans(ranges)),)
