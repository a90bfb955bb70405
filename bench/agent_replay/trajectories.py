"""Agent trajectories in token-count form: synthetic (seeded, statistics as parameters) or recorded
(JSONL of per-message token counts, or the demo's `runs/NAME/steps/NN/*.json`).

A trajectory is the final message list of one agent run: system prompt, user task, then assistant
messages (each one model call) answered by tool results, ending with a final assistant reply. Call
k sends every message before the k-th assistant message plus the generation prompt; the assistant
message is the reply. `tokens` counts a message as the chat template renders it (scaffolding
included); an assistant message's first `generation_tokens` tokens are the generation prompt and the
next `generated` tokens are what the model produced (its end token included)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


class TrajectoryError(ValueError):
    """A trajectory or its file is malformed; the message names the field and value."""


@dataclass(frozen=True)
class MessageSpec:
    """One message: `tokens` as rendered; for assistant messages `generated` output tokens, `calls`
    tool calls and `reasoning` of its tokens that are reasoning; for tool results the tool `name`."""

    role: str
    tokens: int
    generated: int = 0
    calls: int = 0
    reasoning: int = 0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TrajectoryError(f"MessageSpec.role must be one of {ROLES}, got {self.role!r}")
        for key in ("tokens", "generated", "calls", "reasoning"):
            value = getattr(self, key)
            if type(value) is not int or value < 0:
                raise TrajectoryError(f"MessageSpec.{key} must be a non-negative int, got {value!r}")
        if self.role != "assistant" and (self.generated or self.calls or self.reasoning):
            raise TrajectoryError(f"MessageSpec: only assistant messages have generated/calls/reasoning, "
                                  f"got role {self.role!r}")


@dataclass(frozen=True)
class Trajectory:
    """A named message list; `messages` optionally holds the real chat messages behind the specs."""

    name: str
    specs: tuple[MessageSpec, ...]
    generation_tokens: int = 3
    messages: tuple[Mapping[str, Any], ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if type(self.generation_tokens) is not int or self.generation_tokens < 0:
            raise TrajectoryError(f"Trajectory.generation_tokens must be a non-negative int, "
                                  f"got {self.generation_tokens!r}")
        check_structure(self.specs, self.name)
        for i in self.calls:
            spec = self.specs[i]
            if spec.tokens < self.generation_tokens + spec.generated:
                raise TrajectoryError(f"{self.name}: message {i} has {spec.tokens} tokens, fewer than the "
                                      f"generation prompt ({self.generation_tokens}) plus generated ({spec.generated})")
        if self.messages is not None and len(self.messages) != len(self.specs):
            raise TrajectoryError(f"{self.name}: {len(self.messages)} messages for {len(self.specs)} specs")

    @property
    def calls(self) -> tuple[int, ...]:
        """Message ids of the assistant messages: one model call each."""
        return tuple(i for i, s in enumerate(self.specs) if s.role == "assistant")

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.specs)

    def stats(self) -> dict[str, Any]:
        tools = [s.tokens for s in self.specs if s.role == "tool"]
        batches = [s.calls for s in self.specs if s.role == "assistant" and s.calls]
        return {"name": self.name, "messages": len(self.specs), "calls": len(self.calls),
                "tool_results": len(tools), "final_tokens": self.total_tokens,
                "mean_tool_result_tokens": round(sum(tools) / len(tools), 1) if tools else 0.0,
                "max_batch": max(batches, default=0),
                "generated_tokens": sum(s.generated for s in self.specs)}


def check_structure(specs: Sequence[MessageSpec], name: str = "trajectory") -> None:
    """Every assistant message with `calls` is followed by exactly that many tool results."""
    if not specs:
        raise TrajectoryError(f"{name}: no messages")
    pending = 0
    for i, spec in enumerate(specs):
        if spec.role == "tool":
            if pending == 0:
                raise TrajectoryError(f"{name}: message {i} is a tool result without a pending call")
            pending -= 1
            continue
        if pending:
            raise TrajectoryError(f"{name}: message {i} arrives while {pending} tool results are missing")
        if spec.role == "assistant":
            pending = spec.calls
    if pending:
        raise TrajectoryError(f"{name}: the last {pending} tool results are missing")


@dataclass(frozen=True)
class Range:
    """A log-normal length in tokens, clipped to [low, high]; `median` is the untruncated median."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return max(self.low, min(self.high, int(round(rng.lognormvariate(math.log(self.median), self.sigma)))))


@dataclass(frozen=True)
class TrajectoryStats:
    """Parameters of a synthetic trajectory family (token counts as rendered by a Qwen-style chat
    template: per-message overhead for role markers, per-call overhead for the call markup)."""

    turns: tuple[int, int]
    tool_result: Range
    reasoning: Range
    reply: Range
    call_arguments: Range
    batch_sizes: tuple[tuple[int, float], ...]
    system_tokens: int
    task_tokens: Range
    final_reply: Range
    message_overhead: int = 5
    call_overhead: int = 12
    generation_tokens: int = 3
    tools: tuple[str, ...] = ("bash",)


# Long SWE-bench Verified runs (SWE-agent / OpenHands style): one command per turn, rarely two;
# file views, test logs and greps of a few hundred to several thousand tokens; 60-200 turns.
SWE = TrajectoryStats(
    turns=(60, 200),
    tool_result=Range(median=700, sigma=0.9, low=40, high=8000),
    reasoning=Range(median=180, sigma=0.7, low=20, high=1500),
    reply=Range(median=30, sigma=0.8, low=0, high=400),
    call_arguments=Range(median=45, sigma=0.8, low=8, high=1200),
    batch_sizes=((1, 0.85), (2, 0.12), (3, 0.03)),
    system_tokens=2200,
    task_tokens=Range(median=600, sigma=0.5, low=150, high=3000),
    final_reply=Range(median=250, sigma=0.5, low=50, high=1000),
    tools=("bash", "str_replace_editor"),
)

# BrowseComp-Plus deep-research runs: parallel search/get_document calls, long document snippets;
# 30-120 turns.
BROWSE = TrajectoryStats(
    turns=(30, 120),
    tool_result=Range(median=1800, sigma=0.6, low=200, high=6000),
    reasoning=Range(median=300, sigma=0.7, low=30, high=2000),
    reply=Range(median=10, sigma=1.0, low=0, high=200),
    call_arguments=Range(median=25, sigma=0.5, low=8, high=120),
    batch_sizes=((1, 0.45), (2, 0.30), (3, 0.15), (4, 0.10)),
    system_tokens=1500,
    task_tokens=Range(median=200, sigma=0.4, low=60, high=800),
    final_reply=Range(median=400, sigma=0.5, low=80, high=1500),
    tools=("search", "get_document"),
)

# A few hundred tokens in all, for CPU dry runs of the serving replay with a tiny model.
TINY = TrajectoryStats(
    turns=(5, 7),
    tool_result=Range(median=40, sigma=0.4, low=15, high=90),
    reasoning=Range(median=12, sigma=0.3, low=4, high=30),
    reply=Range(median=4, sigma=0.3, low=0, high=10),
    call_arguments=Range(median=40, sigma=0.2, low=30, high=60),
    batch_sizes=((1, 0.4), (2, 0.6)),
    system_tokens=30,
    task_tokens=Range(median=15, sigma=0.2, low=8, high=30),
    final_reply=Range(median=10, sigma=0.2, low=5, high=20),
    tools=("search", "read"),
)

PRESETS: dict[str, TrajectoryStats] = {"swe": SWE, "browse": BROWSE, "tiny": TINY}


def generate(stats: TrajectoryStats, seed: int, name: str | None = None, turns: int | None = None) -> Trajectory:
    """One synthetic trajectory; the same (stats, seed, turns) always gives the same trajectory."""
    rng = random.Random(seed)
    n_turns = turns if turns is not None else rng.randint(*stats.turns)
    if type(n_turns) is not int or n_turns < 0:
        raise TrajectoryError(f"turns must be a non-negative int, got {n_turns!r}")
    sizes, weights = zip(*stats.batch_sizes)
    o, g = stats.message_overhead, stats.generation_tokens
    specs = [MessageSpec("system", stats.system_tokens), MessageSpec("user", o + stats.task_tokens.draw(rng))]
    for _ in range(n_turns):
        width = rng.choices(sizes, weights)[0]
        reasoning, reply = stats.reasoning.draw(rng), stats.reply.draw(rng)
        call_tokens = sum(stats.call_overhead + stats.call_arguments.draw(rng) for _ in range(width))
        generated = reasoning + reply + call_tokens + 1
        specs.append(MessageSpec("assistant", g + generated + 1, generated, width, reasoning))
        for _ in range(width):
            specs.append(MessageSpec("tool", o + stats.tool_result.draw(rng), name=rng.choice(stats.tools)))
    reasoning, reply = stats.reasoning.draw(rng), stats.final_reply.draw(rng)
    specs.append(MessageSpec("assistant", g + reasoning + reply + 2, reasoning + reply + 1, 0, reasoning))
    return Trajectory(name or f"synthetic-{seed}", tuple(specs), g)


def default_set(count: int = 4, seed: int = 0) -> list[Trajectory]:
    """The default benchmark set: `count` SWE-like and `count` BrowseComp-Plus-like trajectories."""
    out = []
    for preset in ("swe", "browse"):
        for k in range(count):
            out.append(generate(PRESETS[preset], seed * 1000 + k, f"{preset}-{seed * 1000 + k}"))
    return out


def to_jsonl(trajectories: Iterable[Trajectory], path: Path) -> None:
    """One line per message: `trajectory`, `generation_tokens` and the MessageSpec fields."""
    with path.open("w", encoding="utf-8") as f:
        for t in trajectories:
            for spec in t.specs:
                row = {"trajectory": t.name, "generation_tokens": t.generation_tokens, **asdict(spec)}
                f.write(json.dumps(row) + "\n")


def load_jsonl(path: Path) -> list[Trajectory]:
    """Trajectories from per-message lines (`to_jsonl`'s format; `trajectory` groups lines in file
    order, `generation_tokens` defaults to 3, MessageSpec fields other than role/tokens are optional)."""
    groups: dict[str, list[MessageSpec]] = {}
    generation: dict[str, int] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TrajectoryError(f"{path}:{n}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise TrajectoryError(f"{path}:{n}: expected an object, got {type(row).__name__}")
        name = str(row.pop("trajectory", path.stem))
        generation.setdefault(name, row.pop("generation_tokens", 3))
        row.pop("generation_tokens", None)
        unknown = set(row) - {"role", "tokens", "generated", "calls", "reasoning", "name"}
        if unknown:
            raise TrajectoryError(f"{path}:{n}: unknown fields {sorted(unknown)}")
        try:
            groups.setdefault(name, []).append(MessageSpec(**row))
        except TypeError as exc:
            raise TrajectoryError(f"{path}:{n}: {exc}") from None
    return [Trajectory(name, tuple(specs), generation[name]) for name, specs in groups.items()]


def from_messages(name: str, messages: Sequence[Mapping[str, Any]], counter: Any,
                  generated: Mapping[int, int] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                  ) -> Trajectory:
    """Specs of real chat messages as `counter` (an akv.agent TokenCounter) counts them. `generated`
    maps assistant message ids to output tokens (default: the message's tokens after the generation
    prompt, less one for the template's trailing newline)."""
    layout = counter.layout(list(messages), tools=tools)
    g = layout.generation_tokens
    specs = []
    for i, (message, (start, end)) in enumerate(zip(messages, layout.spans, strict=True)):
        role = message.get("role")
        role = "system" if role == "developer" else role
        tokens = end - start
        if role == "assistant":
            out = (generated or {}).get(i, max(tokens - g - 1, 1))
            specs.append(MessageSpec("assistant", tokens, min(out, tokens - g), len(message.get("tool_calls") or ())))
        else:
            specs.append(MessageSpec(role, tokens, name=message.get("name") if role == "tool" else None))
    return Trajectory(name, tuple(specs), g, tuple(messages))


def load_demo_run(run_dir: Path, counter: Any) -> Trajectory:
    """A demo run (`runs/NAME`, written by examples/akv_demo): the last step's payload plus its
    reply, with each reply's completion tokens from that step's usage.json."""
    steps = sorted(p for p in (run_dir / "steps").iterdir() if p.is_dir())
    if not steps:
        raise TrajectoryError(f"{run_dir}: no steps/NN folders")
    generated: dict[int, int] = {}
    payload: dict[str, Any] = {}
    reply: dict[str, Any] = {}
    for step in steps:
        payload = json.loads((step / "payload_before.json").read_text(encoding="utf-8"))
        reply = json.loads((step / "reply.json").read_text(encoding="utf-8"))["message"]
        usage_path = step / "usage.json"
        usage = json.loads(usage_path.read_text(encoding="utf-8")) if usage_path.exists() else None
        if isinstance(usage, dict) and type(usage.get("completion_tokens")) is int:
            generated[len(payload["messages"])] = usage["completion_tokens"]
    messages = list(payload["messages"]) + [reply]
    return from_messages(run_dir.name, messages, counter, generated, payload.get("tools"))


def truncate(trajectory: Trajectory, turns: int) -> Trajectory:
    """The first `turns` calls: messages up to the `turns`-th assistant message, which becomes the
    final reply (its tool calls and results are cut; its token counts are kept)."""
    calls = trajectory.calls
    if type(turns) is not int or turns < 1:
        raise TrajectoryError(f"turns must be a positive int, got {turns!r}")
    if turns >= len(calls):
        return trajectory
    last = calls[turns - 1]
    spec = trajectory.specs[last]
    specs = trajectory.specs[:last] + (MessageSpec("assistant", spec.tokens, spec.generated, 0, spec.reasoning),)
    messages = None
    if trajectory.messages is not None:
        final = {k: v for k, v in trajectory.messages[last].items() if k != "tool_calls"}
        messages = tuple(trajectory.messages[:last]) + (final,)
    return Trajectory(trajectory.name, specs, trajectory.generation_tokens, messages)
