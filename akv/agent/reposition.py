"""Built-in reposition rules: when to compact positions. A rule is any callable
`(DecisionContext) -> bool`; the policy only repositions when some dropped message is not yet compacted."""

from __future__ import annotations

from dataclasses import dataclass

from akv.agent import checks
from akv.agent.context import DecisionContext
from akv.agent.counting import TokenCounter
from akv.agent.schedule import check_schedule, fires


@dataclass(frozen=True)
class TurnReposition:
    """Reposition at completed turn `after` (1-based) and then every `every` turns (None: only once)."""

    after: int = 1
    every: int | None = 1

    def __post_init__(self) -> None:
        check_schedule("TurnReposition", self.after, self.every)

    def __call__(self, ctx: DecisionContext) -> bool:
        return fires(ctx.turn, self.after, self.every)


@dataclass(frozen=True)
class TokenReposition:
    """Reposition when the next free position (prompt tokens up to the boundary plus the generation
    prompt, minus tokens already compacted away) exceeds `threshold`."""

    threshold: int
    counter: TokenCounter | None = None

    def __post_init__(self) -> None:
        checks.positive_int("TokenReposition", "threshold", self.threshold)
        checks.counter("TokenReposition", self.counter)

    def __call__(self, ctx: DecisionContext) -> bool:
        return ctx.position_length(self.counter) > self.threshold


@dataclass(frozen=True)
class ModelReposition:
    """Reposition at the end of each tool-call batch that carries a successful `tool_name` receipt."""

    tool_name: str = "drop_context"

    def __post_init__(self) -> None:
        checks.tool_name("ModelReposition", self.tool_name)

    def __call__(self, ctx: DecisionContext) -> bool:
        return ctx.model_request_here(self.tool_name)
