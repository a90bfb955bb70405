"""Incremental Server-Sent Events parser: bytes in any chunking -> complete events."""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from akv.agent.errors import StreamError

_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its `data` lines joined with newlines, and its `event` type if any;
    `terminated` is False for an event the stream ended in (no blank line after it)."""

    data: str
    event: str | None = None
    terminated: bool = True


class SSEParser:
    """Feed raw bytes as they arrive; get back the events they complete. UTF-8 (BOM tolerated),
    CR / LF / CRLF line ends (also split across chunks), comments and unknown fields ignored."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._text = ""
        self._started = False
        self._data: list[str] = []
        self._event: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self._consume(self._decode(chunk, final=False), final=False)

    def close(self) -> list[SSEEvent]:
        """End of stream: process the last line and dispatch a pending event."""
        events = self._consume(self._decode(b"", final=True), final=True)
        if self._data:
            events.append(self._dispatch(terminated=False))
        return events

    def _decode(self, chunk: bytes, *, final: bool) -> str:
        try:
            text = self._decoder.decode(chunk, final)
        except UnicodeDecodeError as exc:
            raise StreamError(f"SSE stream is not valid UTF-8: {exc}") from None
        if not self._started and text:
            self._started = True
            if text.startswith("\ufeff"):
                text = text[1:]
        return text

    def _consume(self, text: str, *, final: bool) -> list[SSEEvent]:
        text = self._text + text
        events: list[SSEEvent] = []
        start = 0
        for match in _LINE_END.finditer(text):
            if match.group() == "\r" and match.end() == len(text) and not final:
                break
            event = self._line(text[start:match.start()])
            if event is not None:
                events.append(event)
            start = match.end()
        rest = text[start:]
        if final and rest:
            event = self._line(rest)
            if event is not None:
                events.append(event)
            rest = ""
        self._text = rest
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            if self._data:
                return self._dispatch()
            self._event = None
            return None
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None

    def _dispatch(self, *, terminated: bool = True) -> SSEEvent:
        event = SSEEvent("\n".join(self._data), self._event, terminated)
        self._data, self._event = [], None
        return event
