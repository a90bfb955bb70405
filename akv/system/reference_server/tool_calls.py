"""Turn generated text into OpenAI content + tool calls, and stream content without leaking call markup.

Models served here write calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
Qwen/ChatML convention the tiny and SmolLM2 templates use). A reply whose call blocks do not all parse
is returned as plain content, untouched.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def split_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, calls)``: content is the text before the first call (None when empty)."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.finditer(text, start):
        call = _parse_call(block.group(1))
        if call is None:
            return text, []
        calls.append(call)
    if not calls or text[start:].count(OPEN) != len(calls):
        return text, []
    content = text[:start].rstrip()
    return (content or None), calls


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": parsed["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ContentStreamer:
    """Feeds the full text so far; returns the new content safe to stream now.

    With tool parsing on, text from ``<tool_call>`` on is withheld (and a suffix that could still
    become ``<tool_call>`` is held back until it cannot)."""

    def __init__(self, parse_tool_calls: bool) -> None:
        self._parse = parse_tool_calls
        self._sent = 0
        self._in_call = False

    def feed(self, text: str) -> str:
        if self._in_call:
            return ""
        limit = len(text)
        if self._parse:
            at = text.find(OPEN, self._sent)
            if at >= 0:
                self._in_call = True
                limit = at
            else:
                limit = len(text) - _partial_marker_length(text)
        delta = text[self._sent:limit] if limit > self._sent else ""
        self._sent = max(self._sent, limit)
        return delta

    def rest(self, final_content: str | None) -> str:
        """What remains to stream once the reply is final (``final_content`` from ``split_tool_calls``)."""
        content = final_content or ""
        return content[self._sent:] if len(content) > self._sent else ""


def _partial_marker_length(text: str) -> int:
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
