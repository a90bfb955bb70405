"""Assembling chat-completion stream events into one `GenerationResult`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from akv.agent.errors import ContextLengthError, IncompleteStreamError, StreamError
from akv.agent.results import GenerationResult, Timings, ToolCall, Usage
from akv.agent.sse import SSEEvent

_CONTEXT_LENGTH = re.compile(
    r"context[ _]length|context window|maximum context|longer than the model|exceeds the model|"
    r"too many tokens|prompt is too long", re.IGNORECASE)


def is_context_length_error(text: str) -> bool:
    """True when an error text says the prompt does not fit the model's context."""
    return bool(_CONTEXT_LENGTH.search(text))


@dataclass
class _CallParts:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class StreamAssembler:
    """Consumes SSE events of `/v1/chat/completions` (stream=true) in order."""

    def __init__(self) -> None:
        self.done = False
        self.events = 0
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, _CallParts] = {}
        self._usage: dict[str, Any] | None = None
        self._finish: str | None = None
        self._id: str | None = None
        self._model: str | None = None

    def accept(self, event: SSEEvent) -> bool:
        """Take one event; True when it carried output (content, reasoning or a tool-call fragment).
        Raises StreamError / ContextLengthError on error events and malformed data."""
        self.events += 1
        if event.data.strip() == "[DONE]":
            self.done = True
            return False
        if self.done:
            raise StreamError(f"SSE data after [DONE]: {event.data[:200]!r}", body=event.data)
        try:
            chunk = json.loads(event.data)
        except RecursionError:
            raise StreamError("SSE event nests too deeply to decode", body=event.data) from None
        except ValueError:
            if not event.terminated:
                raise IncompleteStreamError(f"stream ended in the middle of an event after {self.events - 1} "
                                            f"events (no [DONE])", body=event.data) from None
            raise StreamError(f"SSE event is not JSON: {event.data[:200]!r}", body=event.data) from None
        if not isinstance(chunk, dict):
            raise StreamError(f"SSE event is not a JSON object: {event.data[:200]!r}", body=event.data)
        if chunk.get("error") is not None or chunk.get("object") == "error" or event.event == "error":
            _raise_stream_error(chunk, event.data)
        self._id = chunk.get("id", self._id)
        self._model = chunk.get("model", self._model)
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise StreamError(f"usage must be an object, got {usage!r}", body=event.data)
            self._usage = usage
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise StreamError(f"choices must be a list, got {choices!r}", body=event.data)
        output = False
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                raise StreamError(f"only one choice (index 0) is supported, got {choice!r}", body=event.data)
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise StreamError(f"delta must be an object, got {delta!r}", body=event.data)
            output |= self._delta(delta, event.data)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return output

    def _delta(self, delta: dict[str, Any], raw: str) -> bool:
        output = False
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._content.append(content)
            output = True
        reasoning = delta.get("reasoning_content", delta.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            self._reasoning.append(reasoning)
            output = True
        for position, fragment in enumerate(delta.get("tool_calls") or ()):
            if not isinstance(fragment, dict):
                raise StreamError(f"tool_calls fragment must be an object, got {fragment!r}", body=raw)
            index = fragment.get("index", position)
            function = fragment.get("function") or {}
            if type(index) is not int or not isinstance(function, dict):
                raise StreamError(f"tool_calls fragment needs an int index and a function object, got {fragment!r}",
                                  body=raw)
            for name, value in (("id", fragment.get("id")), ("function.name", function.get("name")),
                                ("function.arguments", function.get("arguments"))):
                if value is not None and not isinstance(value, str):
                    raise StreamError(f"tool_calls fragment {name} must be a string, got {value!r}", body=raw)
            parts = self._calls.setdefault(index, _CallParts())
            if fragment.get("id") and not parts.id:
                parts.id = fragment["id"]
            if function.get("name") and not parts.name:
                parts.name = function["name"]
            if function.get("arguments"):
                parts.arguments.append(function["arguments"])
            output = True
        return output

    def result(self, timings: Timings) -> GenerationResult:
        if not self.done:
            raise IncompleteStreamError(f"stream ended before [DONE] after {self.events} events")
        calls = tuple(ToolCall(p.id or f"call_{i}", p.name, "".join(p.arguments))
                      for i, p in sorted(self._calls.items()))
        return GenerationResult(
            content="".join(self._content),
            reasoning_content="".join(self._reasoning) if self._reasoning else None,
            tool_calls=calls,
            finish_reason=self._finish,
            usage=Usage.from_json(self._usage) if self._usage is not None else None,
            response_id=self._id,
            model=self._model,
            timings=timings,
        )

    @property
    def completion_tokens(self) -> int | None:
        value = (self._usage or {}).get("completion_tokens")
        return value if type(value) is int else None


def _raise_stream_error(chunk: dict[str, Any], raw: str) -> None:
    error = chunk.get("error", chunk)
    message = error.get("message") if isinstance(error, dict) else error
    text = str(message if message is not None else raw)
    status = error.get("code") if isinstance(error, dict) and type(error.get("code")) is int else None
    if is_context_length_error(text) or (isinstance(error, dict) and error.get("code") == "context_length_exceeded"):
        raise ContextLengthError(f"context length exceeded: {text}", status=status, body=raw)
    raise StreamError(f"error event in stream: {text}", status=status, body=raw)
