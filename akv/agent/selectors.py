"""Built-in selectors: what to drop when the trigger fires. A selector is any callable
`(DecisionContext) -> Iterable[int]`; the policy removes protected, hidden and current-turn ids."""

from __future__ import annotations

from dataclasses import dataclass

from akv.agent import checks
from akv.agent.context import DecisionContext
from akv.agent.counting import TokenCounter
from akv.agent.errors import ConfigError

_TARGET_ROLES = {"tool": ("tool",), "assistant": ("assistant",), "both": ("tool", "assistant")}


@dataclass(frozen=True)
class TurnSelection:
    """Keep the newest `count` completed turns; select the older messages of the `target` roles
    ("tool" results, "assistant" messages, or "both"). An assistant message expires with its turn,
    which is when all its tool results expire."""

    count: int
    target: str = "tool"

    def __post_init__(self) -> None:
        checks.positive_int("TurnSelection", "count", self.count)
        if self.target not in _TARGET_ROLES:
            raise ConfigError(f"TurnSelection.target must be one of {sorted(_TARGET_ROLES)}, got {self.target!r}")

    def __call__(self, ctx: DecisionContext) -> list[int]:
        expired_turns = ctx.turn - self.count
        if expired_turns <= 0:
            return []
        limit = ctx.conversation.boundaries[expired_turns - 1]
        out = []
        for role in _TARGET_ROLES[self.target]:
            for i in ctx.droppable((role,)):
                if i > limit:
                    break
                out.append(i)
        out.sort()
        return out


@dataclass(frozen=True)
class TokenSelection:
    """Select the oldest droppable tool results until the visible prompt is at most
    `target_tokens` (or nothing droppable is left)."""

    target_tokens: int
    counter: TokenCounter | None = None

    def __post_init__(self) -> None:
        checks.positive_int("TokenSelection", "target_tokens", self.target_tokens)
        checks.counter("TokenSelection", self.counter)

    def __call__(self, ctx: DecisionContext) -> list[int]:
        excess = ctx.visible_tokens(self.counter) - self.target_tokens
        spans = ctx.layout(self.counter).spans
        out = []
        for i in ctx.droppable(("tool",)):
            if excess <= 0:
                break
            out.append(i)
            excess -= spans[i][1] - spans[i][0]
        return out


@dataclass(frozen=True)
class ModelSelection:
    """Select the ids the model named in successful `tool_name` receipts up to this boundary (ids
    after a receipt's own boundary are ignored)."""

    tool_name: str = "drop_context"

    def __post_init__(self) -> None:
        checks.tool_name("ModelSelection", self.tool_name)

    def __call__(self, ctx: DecisionContext) -> list[int]:
        return [i for r in ctx.model_requests(self.tool_name) for i in r.message_ids if 0 <= i <= r.boundary]
