"""The three demo policies (``--policy turn|token|model``) built from akv.agent's rules."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from akv.agent import (
    ApproximateTokenCounter,
    CachePolicy,
    DropContextTool,
    ModelReposition,
    ModelSelection,
    ModelTrigger,
    TokenCounter,
    TokenReposition,
    TokenSelection,
    TokenTrigger,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)

POLICY_KINDS = ("turn", "token", "model")


@dataclass(frozen=True)
class DemoPolicy:
    """A policy plus, for the model-driven kind, the ``drop_context`` tool offered to the model."""

    policy: CachePolicy
    drop_tool: DropContextTool | None
    description: str


def make_counter(tokenizer_dir: Path | None) -> TokenCounter:
    """The model's own template counter when its directory is known (needs the ``tokenization`` extra),
    else the dependency-free estimate."""
    if tokenizer_dir is None:
        return ApproximateTokenCounter()
    from akv.agent.tokens import ChatTemplateTokenCounter

    return ChatTemplateTokenCounter.from_pretrained(str(tokenizer_dir))


def make_policy(kind: str, *, record_tokens: int, counter: TokenCounter | None = None) -> DemoPolicy:
    """``record_tokens`` is the size of one record as ``counter`` counts it; token thresholds scale
    with it. ``counter`` defaults to the dependency-free estimate."""
    if kind == "turn":
        return DemoPolicy(CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(2),
                                      reposition=TurnReposition(after=1, every=1)), None,
                          "keep the 2 newest records, drop older ones; reposition after each drop")
    if kind == "token":
        counter = counter or ApproximateTokenCounter()
        threshold, target = 3 * record_tokens, 2 * record_tokens
        return DemoPolicy(CachePolicy(trigger=TokenTrigger(threshold, counter),
                                      selector=TokenSelection(target, counter),
                                      reposition=TokenReposition(threshold, counter)), None,
                          f"drop oldest records once the visible prompt exceeds ~{threshold} tokens "
                          f"(down to ~{target}); reposition past ~{threshold} positions; counted by "
                          f"{type(counter).__name__}")
    if kind == "model":
        policy = CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), reposition=ModelReposition())
        return DemoPolicy(policy, policy.drop_context_tool(),
                          "the model calls drop_context to hide records it no longer needs")
    raise ValueError(f"policy must be one of {list(POLICY_KINDS)}, got {kind!r}")
