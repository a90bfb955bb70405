"""OpenAI response bodies and stream chunks for one completion (plain JSON dicts)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TokenChoice:
    """A candidate token and its log-probability under the served distribution (before sampling)."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenStep:
    """One generated token with its log-probability and the top alternatives (best first)."""

    chosen: TokenChoice
    top: tuple[TokenChoice, ...]


@dataclass(frozen=True)
class PromptUsage:
    """Prompt-side counters (DESIGN.md §2)."""

    prompt_tokens: int
    cached_tokens: int
    repos_tokens: int
    drop_skipped_tokens: int
    computed_tokens: int


def usage_body(prompt: PromptUsage, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": prompt.cached_tokens,
            "repos_tokens": prompt.repos_tokens,
            "drop_skipped_tokens": prompt.drop_skipped_tokens,
            "computed_tokens": prompt.computed_tokens,
        },
    }


def logprob_entries(steps: Sequence[TokenStep], top_logprobs: int) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` entries; ``token_id`` is an extension naming the vocabulary id."""
    return [
        {
            **_choice(step.chosen),
            "top_logprobs": [_choice(alt) for alt in step.top[:top_logprobs]],
        }
        for step in steps
    ]


def _choice(choice: TokenChoice) -> dict[str, Any]:
    return {
        "token": choice.text,
        "token_id": choice.token_id,
        "logprob": choice.logprob,
        "bytes": list(choice.text.encode("utf-8")),
    }


class ResponseIds:
    """Shared id/created/model fields of one response."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def completion(
        self,
        content: str | None,
        tool_calls: list[dict[str, Any]],
        finish_reason: str,
        usage: dict[str, Any],
        logprobs: list[dict[str, Any]] | None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }],
            "usage": usage,
        }

    def chunk(
        self,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }],
        }

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }


def stream_tool_call_deltas(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One delta entry per call, with its index, id, name and full arguments."""
    return [{"index": i, **call} for i, call in enumerate(tool_calls)]


def error_body(message: str, *, param: str | None, status: int, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"object": "error", "error": {"message": message, "type": kind, "param": param, "code": status}}
