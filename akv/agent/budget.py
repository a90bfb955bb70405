"""The live-budget preset: a model-driven policy that also keeps the live length (the tokens the next
query reads, which are the positions it uses once every drop is repositioned) under a budget, so an
agent can run past the model's context length without hand-tuned thresholds.

The model drops what it names with the drop tool; when the live length exceeds `live_token_budget`
the oldest droppable messages are dropped as well, down to `low_water` of the budget (so the next
drops wait for several turns), and every drop is repositioned at once."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from akv.agent import checks
from akv.agent.context import DecisionContext
from akv.agent.counting import TokenCounter
from akv.agent.errors import ConfigError
from akv.agent.policy import CachePolicy
from akv.agent.selectors import ModelSelection


@dataclass(frozen=True)
class LiveBudgetTrigger:
    """Fire when this boundary carries a successful `tool_name` receipt, or when the visible prompt
    (up to the boundary, with the generation prompt, minus dropped messages) exceeds `live_token_budget`."""

    live_token_budget: int
    counter: TokenCounter | None = None
    tool_name: str = "drop_context"

    def __post_init__(self) -> None:
        checks.positive_int("LiveBudgetTrigger", "live_token_budget", self.live_token_budget)
        checks.counter("LiveBudgetTrigger", self.counter)
        checks.tool_name("LiveBudgetTrigger", self.tool_name)

    def __call__(self, ctx: DecisionContext) -> bool:
        return ctx.model_request_here(self.tool_name) or ctx.visible_tokens(self.counter) > self.live_token_budget


@dataclass(frozen=True)
class LiveBudgetSelection:
    """Select what the model named in successful `tool_name` receipts, then the oldest droppable
    messages until the visible prompt is at most `target_tokens` (or nothing droppable is left)."""

    target_tokens: int
    counter: TokenCounter | None = None
    tool_name: str = "drop_context"

    def __post_init__(self) -> None:
        checks.positive_int("LiveBudgetSelection", "target_tokens", self.target_tokens)
        checks.counter("LiveBudgetSelection", self.counter)
        checks.tool_name("LiveBudgetSelection", self.tool_name)

    def __call__(self, ctx: DecisionContext) -> list[int]:
        candidates = set(ctx.candidates)
        named = sorted(set(ModelSelection(self.tool_name)(ctx)) & candidates)
        spans = ctx.layout(self.counter).spans
        excess = ctx.visible_tokens(self.counter) - self.target_tokens - sum(spans[i][1] - spans[i][0] for i in named)
        chosen = set(named)
        for i in ctx.droppable():
            if excess <= 0:
                break
            if i not in chosen:
                chosen.add(i)
                excess -= spans[i][1] - spans[i][0]
        return sorted(chosen)


def _repositions_each_drop(ctx: DecisionContext) -> bool:
    """Reposition at every boundary that drops, so positions stay equal to the visible tokens."""
    return bool(ctx.dropping)


def live_budget_policy(live_token_budget: int, counter: TokenCounter, *, tool_name: str = "drop_context",
                       low_water: float = 0.75, exclude_tools: Collection[str] = (), protect_system: bool = True,
                       protect_first_user: bool = True, keep_thinking_turns: int | None = None) -> CachePolicy:
    """A `CachePolicy` that drops what the model names with `tool_name` and keeps the live length at
    most `live_token_budget` tokens (as `counter` counts them), dropping the oldest droppable
    messages down to `low_water * live_token_budget` when it is exceeded; each drop is repositioned.

    Choose `live_token_budget` as the model's context length less `max_tokens` and the largest turn
    the harness expects (what a turn adds is computed before the next drop)."""
    checks.positive_int("live_budget_policy", "live_token_budget", live_token_budget)
    if type(low_water) not in (int, float) or not 0 < low_water <= 1:
        raise ConfigError(f"live_budget_policy.low_water must be a number in (0, 1], got {low_water!r}")
    target = max(1, int(live_token_budget * low_water))
    return CachePolicy(trigger=LiveBudgetTrigger(live_token_budget, counter, tool_name),
                       selector=LiveBudgetSelection(target, counter, tool_name),
                       reposition=_repositions_each_drop, exclude_tools=exclude_tools,
                       protect_system=protect_system, protect_first_user=protect_first_user,
                       keep_thinking_turns=keep_thinking_turns)
