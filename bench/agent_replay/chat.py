"""Real chat messages (OpenAI format, with tool_calls and tool results) for a trajectory, with text
sized so that a given token counter counts exactly the trajectory's tokens per message."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.agent_replay.trajectories import MessageSpec, Trajectory, TrajectoryError

FIT_ROUNDS = 8


@dataclass(frozen=True)
class Filler:
    """Text made of `units`, each of which the target tokenizer counts as one token."""

    units: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.units:
            raise TrajectoryError("Filler.units must not be empty")

    def text(self, n: int, seed: int) -> str:
        rng = random.Random(seed)
        return "".join(rng.choice(self.units) for _ in range(n))

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, limit: int = 2000) -> Filler:
        """Space-prefixed lowercase words that the tokenizer encodes as one token each."""
        vocab = tokenizer.get_vocab()
        encode = _encoder(tokenizer)
        units = []
        for piece in sorted(vocab):
            word = piece[1:] if piece[:1] in ("Ġ", "▁") else None
            if word and word.isascii() and word.isalpha() and word.islower() and len(encode(" " + word)) == 1:
                units.append(" " + word)
                if len(units) >= limit:
                    break
        if not units:
            raise TrajectoryError("Filler.for_tokenizer: no single-token words in this tokenizer's vocabulary")
        return cls(tuple(units))

    @classmethod
    def for_approximate(cls, chars_per_token: float = 4.0) -> Filler:
        """Units of `chars_per_token` characters, for akv.agent.ApproximateTokenCounter."""
        width = int(chars_per_token)
        if width != chars_per_token or width < 2:
            raise TrajectoryError(f"Filler.for_approximate: chars_per_token must be an int >= 2, got {chars_per_token!r}")
        return cls(tuple(" " + w[:width - 1] for w in ("abcdefghijklmnop", "qrstuvwxyzabcdef", "ghijklmnopqrstuv")))


def _encoder(tokenizer: Any) -> Any:
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "get_vocab") and hasattr(tokenizer, "is_fast"):
        return lambda s: tokenizer.encode(s, add_special_tokens=False)
    return lambda s: tokenizer.encode(s, add_special_tokens=False).ids


def skeleton(trajectory: Trajectory) -> list[dict[str, Any]]:
    """The trajectory's structure as chat messages with empty texts (what akv.agent needs to decide)."""
    return _build(trajectory.specs, [0] * len(trajectory.specs), Filler((" x",)), reasoning_field=False)


def realize(trajectory: Trajectory, counter: Any, filler: Filler, *, reasoning_field: bool = False,
            tools: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Messages whose per-message token counts under `counter` equal the trajectory's. Assistant
    reasoning goes to `reasoning_content` when `reasoning_field` (templates that render it), else
    into `content`. Raises TrajectoryError when a message is smaller than its template scaffolding."""
    specs = trajectory.specs
    target = [s.tokens for s in specs]
    fill = list(target)
    for _ in range(FIT_ROUNDS):
        messages = _build(specs, fill, filler, reasoning_field)
        layout = counter.layout(messages, tools=tools)
        counts = [end - start for start, end in layout.spans]
        if counts == target:
            return messages
        for i, (want, got) in enumerate(zip(target, counts, strict=True)):
            if got != want:
                if fill[i] == 0 and got > want:
                    raise TrajectoryError(f"{trajectory.name}: message {i} ({specs[i].role}) needs {got} tokens "
                                          f"of scaffolding, more than its {want} tokens")
                fill[i] = max(0, fill[i] + want - got)
    wrong = [i for i, (a, b) in enumerate(zip(target, counts, strict=True)) if a != b]
    raise TrajectoryError(f"{trajectory.name}: token counts of messages {wrong[:10]} did not converge "
                          f"in {FIT_ROUNDS} rounds")


def filler_message(role: str, tokens: int, filler: Filler, seed: int, counter: Any, prefix: str = "") -> dict[str, Any]:
    """One `role` message of about `tokens` tokens (exact for a counter that counts units exactly
    and whose scaffolding is independent of the text), e.g. a summary or a trimmed-result placeholder."""
    probe = counter.layout([{"role": role, "content": prefix}]).message_tokens[0]
    return {"role": role, "content": prefix + filler.text(max(0, tokens - probe), seed)}


def _build(specs: Sequence[MessageSpec], fill: Sequence[int], filler: Filler, reasoning_field: bool) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    pending: list[str] = []
    for i, (spec, n) in enumerate(zip(specs, fill, strict=True)):
        if spec.role == "assistant":
            names = [s.name or "tool" for s in specs[i + 1:i + 1 + spec.calls]]
            calls = [{"id": f"call_{i}_{k}", "type": "function",
                      "function": {"name": name, "arguments": json.dumps({"input": f"m{i}c{k}"})}}
                     for k, name in enumerate(names)]
            message: dict[str, Any] = {"role": "assistant"}
            if reasoning_field and spec.reasoning:
                message["reasoning_content"] = filler.text(spec.reasoning, 2 * i + 1)
                n = max(0, n - spec.reasoning)
            message["content"] = filler.text(n, 2 * i)
            if calls:
                message["tool_calls"] = calls
                pending = [c["id"] for c in calls]
            messages.append(message)
        elif spec.role == "tool":
            messages.append({"role": "tool", "tool_call_id": pending.pop(0), "content": filler.text(n, 2 * i)})
        else:
            messages.append({"role": spec.role, "content": filler.text(n, 2 * i)})
    return messages
