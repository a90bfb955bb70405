"""Which messages no rule may drop: system prompt, first user task, results of excluded tools."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from akv.agent.errors import ConfigError
from akv.agent.messages import Conversation


@dataclass(frozen=True)
class Protection:
    """`protect_system`: every system/developer message; `protect_first_user`: the first user message
    (the task); `exclude_tools`: results of these tools and the assistant messages that called them."""

    protect_system: bool = True
    protect_first_user: bool = True
    exclude_tools: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("protect_system", "protect_first_user"):
            if type(getattr(self, name)) is not bool:
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.exclude_tools, str) or not isinstance(self.exclude_tools, Collection):
            raise ConfigError(f"exclude_tools must be a collection of tool names, got {self.exclude_tools!r}")
        bad = [t for t in self.exclude_tools if not isinstance(t, str) or not t]
        if bad:
            raise ConfigError(f"exclude_tools must hold non-empty strings, got {bad!r}")
        object.__setattr__(self, "exclude_tools", frozenset(self.exclude_tools))

    def protected(self, conversation: Conversation) -> list[bool]:
        """`result[i]` is True when message i may never be dropped."""
        roles = conversation.roles
        out = [False] * len(roles)
        if self.protect_system:
            for i, role in enumerate(roles):
                if role in ("system", "developer"):
                    out[i] = True
        if self.protect_first_user and conversation.first_user is not None:
            out[conversation.first_user] = True
        if self.exclude_tools:
            for batch in conversation.batches:
                excluded = [r for r in batch.results if conversation.tool_names[r] in self.exclude_tools]
                for r in excluded:
                    out[r] = True
                if excluded:
                    out[batch.assistant] = True
        return out
