"""What a streamed chat completion assembles into."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One tool call of the generated message; `arguments` is the raw JSON text the model produced."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _count(details: Mapping[str, Any], key: str) -> int | None:
    value = details.get(key)
    return value if type(value) is int else None


@dataclass(frozen=True)
class Usage:
    """Token usage. `cached_tokens` (resident KV read without re-rotation), `repos_tokens` (read after
    re-rotation) and `drop_skipped_tokens` (dropped, never read) come from usage.prompt_tokens_details;
    None where the server did not report them. `raw` is the usage object as sent."""

    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None
    cached_tokens: int | None
    repos_tokens: int | None
    drop_skipped_tokens: int | None
    raw: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, usage: Mapping[str, Any]) -> Usage:
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, Mapping) else {}
        return cls(_count(usage, "prompt_tokens"), _count(usage, "completion_tokens"), _count(usage, "total_tokens"),
                   _count(details, "cached_tokens"), _count(details, "repos_tokens"),
                   _count(details, "drop_skipped_tokens"), dict(usage))


@dataclass(frozen=True)
class Timings:
    """Seconds from sending the request: to the first output (TTFT) and to the end of the stream
    (total); TPOT = (last output - first output) / (completion tokens - 1), None when undefined."""

    ttft_s: float | None
    tpot_s: float | None
    total_s: float


@dataclass(frozen=True)
class GenerationResult:
    """The assembled reply of one streamed chat completion."""

    content: str
    reasoning_content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str | None
    usage: Usage | None
    response_id: str | None
    model: str | None
    timings: Timings

    def as_message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message
