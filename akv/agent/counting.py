"""Token layouts and the counter protocol token rules use; includes a dependency-free estimator."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from akv.agent.errors import ConfigError, TokenCountError


@dataclass(frozen=True)
class TokenLayout:
    """Token spans of a rendered prompt: message i owns tokens `spans[i][0] .. spans[i][1] - 1`; the
    generation prompt owns the `generation_tokens` tokens after the last span."""

    spans: tuple[tuple[int, int], ...]
    generation_tokens: int

    def __post_init__(self) -> None:
        expected = 0
        for i, (start, end) in enumerate(self.spans):
            if start != expected or end < start:
                raise TokenCountError(f"TokenLayout.spans[{i}] = {(start, end)} is not contiguous after "
                                      f"token {expected}")
            expected = end
        if type(self.generation_tokens) is not int or self.generation_tokens < 0:
            raise TokenCountError(f"TokenLayout.generation_tokens must be a non-negative int, "
                                  f"got {self.generation_tokens!r}")

    @classmethod
    def from_owners(cls, owners: Sequence[int], n_messages: int) -> TokenLayout:
        """The layout of a rendered prompt whose token t belongs to message `owners[t]` (in order;
        owner `n_messages` is the generation prompt)."""
        counts = [0] * (n_messages + 1)
        for owner in owners:
            counts[int(owner)] += 1
        spans, start = [], 0
        for count in counts[:n_messages]:
            spans.append((start, start + count))
            start += count
        return cls(tuple(spans), counts[n_messages])

    @property
    def message_tokens(self) -> tuple[int, ...]:
        return tuple(end - start for start, end in self.spans)

    @property
    def prompt_tokens(self) -> int:
        return (self.spans[-1][1] if self.spans else 0) + self.generation_tokens


@runtime_checkable
class TokenCounter(Protocol):
    """Counts the tokens the server will see for a message list."""

    def layout(self, messages: Sequence[Mapping[str, object]], *,
               tools: Sequence[Mapping[str, object]] | None = None,
               chat_template_kwargs: Mapping[str, object] | None = None,
               api_style: str = "sglang") -> TokenLayout: ...


def message_text(message: Mapping[str, object]) -> str:
    """The text a message carries: content (text parts joined), reasoning and tool-call arguments."""
    content = message.get("content")
    calls = message.get("tool_calls")
    reasoning = message.get("reasoning_content")
    if calls is None and reasoning is None and type(content) is str:
        return content
    parts: list[str] = []
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        parts.extend(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    if isinstance(reasoning, str):
        parts.append(reasoning)
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if type(call) is dict or isinstance(call, Mapping) else None
            if type(function) is dict or isinstance(function, Mapping):
                arguments = function.get("arguments")
                parts.append(str(function.get("name", "")))
                parts.append(arguments if isinstance(arguments, str) else json.dumps(arguments))
    return "".join(parts)


@dataclass(frozen=True)
class ApproximateTokenCounter:
    """Estimates tokens as `message_overhead + ceil(characters / chars_per_token)` per message; tool
    schemas count towards message 0. Standard library only; for rules where exactness is not needed."""

    chars_per_token: float = 4.0
    message_overhead: int = 4
    generation_tokens: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.chars_per_token, bool) or not isinstance(self.chars_per_token, (int, float)) \
                or not self.chars_per_token > 0 or math.isinf(self.chars_per_token):
            raise ConfigError(f"ApproximateTokenCounter.chars_per_token must be a positive number, "
                              f"got {self.chars_per_token!r}")
        for name in ("message_overhead", "generation_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigError(f"ApproximateTokenCounter.{name} must be a non-negative int, got {value!r}")

    def layout(self, messages: Sequence[Mapping[str, object]], *,
               tools: Sequence[Mapping[str, object]] | None = None,
               chat_template_kwargs: Mapping[str, object] | None = None,
               api_style: str = "sglang") -> TokenLayout:
        spans = []
        start = 0
        chars_per_token, overhead, ceil = self.chars_per_token, self.message_overhead, math.ceil
        extra = ceil(len(json.dumps(list(tools))) / chars_per_token) if tools else 0
        for message in messages:
            end = start + overhead + extra + ceil(len(message_text(message)) / chars_per_token)
            spans.append((start, end))
            start, extra = end, 0
        return TokenLayout(tuple(spans), self.generation_tokens)
