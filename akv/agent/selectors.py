"""Built-in selectors: what to drop when the trigger fires. A selector is any callable
`(DecisionContext) -> Iterable[int]`; the policy removes protected, hidden and current-turn ids."""

from __future__ import annotations

import bisect
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
class ResultSelection:
    """Keep the newest `count` tool results; select every older tool result. Counts results, not
    turns: with parallel calls (several results per batch) the two differ, and this is the window the
    published reference's headline numbers used. Results already dropped or protected still count
    towards the `count` newest, so the window is the same whatever else the policy drops.

    Anchor: the boundary being decided, i.e. the end of the tool-call batch whose results pushed the
    older ones out of the window. The reference anchors each drop at the result that made it expire,
    which can sit inside a batch; `CachePolicy` decides only at completed turns, and the two anchors
    give the next query the same visible messages and the server the same reuse (the results after
    a mid-batch anchor are new tokens, prefilled either way). They differ only in whether the later
    results of that batch attend to the expired result when they are prefilled."""

    count: int

    def __post_init__(self) -> None:
        checks.positive_int("ResultSelection", "count", self.count)

    def __call__(self, ctx: DecisionContext) -> list[int]:
        batches = ctx.conversation.batches
        newest = bisect.bisect_right(batches, ctx.boundary, key=lambda b: b.end)
        kept = 0
        limit = -1
        for batch in reversed(batches[:newest]):
            if kept + len(batch.results) > self.count:
                limit = batch.results[-(self.count - kept) - 1]
                break
            kept += len(batch.results)
        if limit < 0:
            return []
        out = []
        for i in ctx.droppable(("tool",)):
            if i > limit:
                break
            out.append(i)
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
