"""Built-in triggers: when to drop. A trigger is any callable `(DecisionContext) -> bool`."""

from __future__ import annotations

from dataclasses import dataclass

from akv.agent import checks
from akv.agent.context import DecisionContext
from akv.agent.counting import TokenCounter
from akv.agent.schedule import check_schedule, fires


@dataclass(frozen=True)
class TurnTrigger:
    """Fire at completed turn `after` (1-based) and then every `every` turns (None: only once)."""

    after: int = 1
    every: int | None = 1

    def __post_init__(self) -> None:
        check_schedule("TurnTrigger", self.after, self.every)

    def __call__(self, ctx: DecisionContext) -> bool:
        return fires(ctx.turn, self.after, self.every)


@dataclass(frozen=True)
class TokenTrigger:
    """Fire when the visible prompt (prompt up to the boundary plus the generation prompt, minus
    dropped messages) exceeds `threshold` tokens as `counter` counts them."""

    threshold: int
    counter: TokenCounter | None = None

    def __post_init__(self) -> None:
        checks.positive_int("TokenTrigger", "threshold", self.threshold)
        checks.counter("TokenTrigger", self.counter)

    def __call__(self, ctx: DecisionContext) -> bool:
        return ctx.visible_tokens(self.counter) > self.threshold


@dataclass(frozen=True)
class ResultTrigger:
    """Fire when more than `count` tool results precede the boundary (Anthropic's `tool_uses` trigger)."""

    count: int

    def __post_init__(self) -> None:
        checks.positive_int("ResultTrigger", "count", self.count)

    def __call__(self, ctx: DecisionContext) -> bool:
        batches = ctx.conversation.batches
        return sum(sum(1 for r in b.results if r <= ctx.boundary) for b in batches) > self.count


@dataclass(frozen=True)
class ModelTrigger:
    """Fire at the end of each tool-call batch that carries a successful `tool_name` receipt."""

    tool_name: str = "drop_context"

    def __post_init__(self) -> None:
        checks.tool_name("ModelTrigger", self.tool_name)

    def __call__(self, ctx: DecisionContext) -> bool:
        return ctx.model_request_here(self.tool_name)
