"""Context-management methods as sequences of requests over a trajectory.

A request lists the texts it sends (`Piece`s: an original message, a summary, a placeholder for a
trimmed result, a summarization instruction), the reply whose generation prompt it ends with, the
output length, and for AKV the `drop_message`/`reposition` fields decided by `akv.agent` itself.
Both the cost simulator (synthetic token ids per piece) and the serving replay (real text per
piece) consume the same requests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from akv.agent import (
    CachePolicy,
    CacheOperationHistory,
    ResultSelection,
    TokenLayout,
    TokenReposition,
    TurnReposition,
    live_budget_policy,
)
from bench.agent_replay.chat import skeleton
from bench.agent_replay.trajectories import Trajectory, TrajectoryError

SUMMARY_REPLY = "summary-reply"


@dataclass(frozen=True)
class Piece:
    """One message of a request: `key` names its text (("m", i) message i of the trajectory,
    ("s", k) the k-th summary as a user message, ("p", i) the placeholder of trimmed result i,
    ("i", k) the k-th summarization instruction, ("r", k) the k-th summary as generated)."""

    key: tuple[str, int]
    role: str
    tokens: int


@dataclass(frozen=True)
class Request:
    """One model call. `turn` is the trajectory call it serves (0-based); `kind` is "turn" or
    "summary". The prompt is `pieces` plus the first `generation_tokens` tokens of `reply`; the
    model generates the next `generated` tokens of `reply`."""

    turn: int
    kind: str
    pieces: tuple[Piece, ...]
    reply: Piece
    generated: int
    drop_message: Mapping[str, list[int]] | None = None
    reposition: Sequence[int] | None = None


class Method(Protocol):
    name: str

    def requests(self, trajectory: Trajectory) -> Iterator[Request]: ...


def _original(trajectory: Trajectory, i: int) -> Piece:
    spec = trajectory.specs[i]
    return Piece(("m", i), spec.role, spec.tokens)


def _head_end(trajectory: Trajectory) -> int:
    """Messages before this index (system prompt and the first user task) are never edited."""
    for i, spec in enumerate(trajectory.specs):
        if spec.role == "user":
            return i + 1
    raise TrajectoryError(f"{trajectory.name}: no user message (the task)")


@dataclass(frozen=True)
class FullContext:
    """Send every message every time."""

    name: str = "full"

    def requests(self, trajectory: Trajectory) -> Iterator[Request]:
        for turn, a in enumerate(trajectory.calls):
            yield Request(turn, "turn", tuple(_original(trajectory, i) for i in range(a)),
                          _original(trajectory, a), trajectory.specs[a].generated)


@dataclass(frozen=True)
class Summarize:
    """Threshold summarization: before a call whose prompt would exceed `threshold` tokens, one
    summarization call (the current prompt plus an `instruction_tokens` user instruction; the
    model writes `summary_tokens`), then the conversation restarts as the system prompt and task,
    the summary (a user message of `summary_tokens + summary_overhead` tokens), and the messages
    after the call point. Defaults: "Standard" at 96k; "Text Engineering" is the same at 48k."""

    threshold: int = 96_000
    summary_tokens: int = 2_000
    instruction_tokens: int = 60
    summary_overhead: int = 5
    name: str = "standard"

    def requests(self, trajectory: Trajectory) -> Iterator[Request]:
        g = trajectory.generation_tokens
        head = [_original(trajectory, i) for i in range(_head_end(trajectory))]
        view = list(head)
        since = len(head)
        summaries = 0
        for turn, a in enumerate(trajectory.calls):
            pieces = view + [_original(trajectory, i) for i in range(since, a)]
            if sum(p.tokens for p in pieces) + g > self.threshold and len(pieces) > len(head):
                instruction = Piece(("i", summaries), "user", self.instruction_tokens)
                reply = Piece(("r", summaries), "assistant", g + self.summary_tokens + 1)
                yield Request(turn, "summary", tuple(pieces) + (instruction,), reply, self.summary_tokens)
                view = head + [Piece(("s", summaries), "user", self.summary_tokens + self.summary_overhead)]
                summaries += 1
                since = a
                pieces = list(view)
            yield Request(turn, "turn", tuple(pieces), _original(trajectory, a), trajectory.specs[a].generated)


@dataclass(frozen=True)
class Trim:
    """Text trimming: every call replaces the tool results older than the `keep` newest with a
    placeholder of `placeholder_tokens` tokens (the server re-prefills from the first edit on)."""

    keep: int = 12
    placeholder_tokens: int = 12
    name: str = "trim"

    def requests(self, trajectory: Trajectory) -> Iterator[Request]:
        tools: list[int] = []
        previous = 0
        for turn, a in enumerate(trajectory.calls):
            tools.extend(i for i in range(previous, a) if trajectory.specs[i].role == "tool")
            previous = a
            trimmed = set(tools[:-self.keep]) if len(tools) > self.keep else set()
            pieces = tuple(Piece(("p", i), "tool", self.placeholder_tokens) if i in trimmed else _original(trajectory, i)
                           for i in range(a))
            yield Request(turn, "turn", pieces, _original(trajectory, a), trajectory.specs[a].generated)


class SpecCounter:
    """An akv.agent TokenCounter that reads a trajectory's per-message token counts (by position)."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        spans, start = [], 0
        for spec in trajectory.specs:
            spans.append((start, start + spec.tokens))
            start += spec.tokens
        self._spans = tuple(spans)

    def layout(self, messages: Sequence[Mapping[str, object]], *, tools: Sequence[Mapping[str, object]] | None = None,
               chat_template_kwargs: Mapping[str, object] | None = None, api_style: str = "sglang") -> TokenLayout:
        if len(messages) > len(self._spans):
            raise TrajectoryError(f"SpecCounter: {len(messages)} messages, the trajectory has {len(self._spans)}")
        return TokenLayout(self._spans[:len(messages)], self.trajectory.generation_tokens)


PolicyFactory = Callable[[SpecCounter], CachePolicy]


@dataclass(frozen=True)
class AKV:
    """Send every message with the `drop_message`/`reposition` fields that `policy` (an
    akv.agent.CachePolicy, built per trajectory from a counter of its exact token counts) decides."""

    policy: PolicyFactory
    name: str = "akv"

    def requests(self, trajectory: Trajectory, messages: Sequence[Mapping[str, Any]] | None = None) -> Iterator[Request]:
        """`messages`: the chat messages to decide on (default: the trajectory's skeleton)."""
        policy = self.policy(SpecCounter(trajectory))
        chat = list(messages) if messages is not None else skeleton(trajectory)
        history: CacheOperationHistory | None = None
        for turn, a in enumerate(trajectory.calls):
            sent, history = policy.process({"model": "replay", "messages": chat[:a]}, history)
            yield Request(turn, "turn", tuple(_original(trajectory, i) for i in range(a)), _original(trajectory, a),
                          trajectory.specs[a].generated, sent.get("drop_message"), sent.get("reposition"))


def reference_policy(keep: int = 12, reposition_tokens: int | None = None) -> PolicyFactory:
    """The reference's headline policy: keep the `keep` newest tool results (ResultSelection), keep
    all reasoning; compact positions at every drop, or with `reposition_tokens` only once the next
    free position would exceed that many tokens (TokenReposition)."""
    if reposition_tokens is None:
        return lambda counter: CachePolicy(selector=ResultSelection(keep), reposition=TurnReposition())
    return lambda counter: CachePolicy(selector=ResultSelection(keep),
                                       reposition=TokenReposition(reposition_tokens, counter))


def default_methods(standard: int = 96_000, text_engineering: int = 48_000, keep: int = 12,
                    live_budget: int = 96_000) -> list[Method]:
    """Full context, Standard (summarize past `standard` tokens), Text Engineering (past
    `text_engineering`), trimming (`keep` results), AKV keeping `keep` results with positions
    compacted past `standard` tokens (`akv_keep12`) or at every drop (`akv_keep12_every_turn`) (the
    names stay those of the default `keep`), and AKV keeping the live length under `live_budget`
    tokens (`akv_live_budget`: akv.agent.live_budget_policy)."""
    return [FullContext(), Summarize(standard, name="standard"), Summarize(text_engineering, name="text_engineering"),
            Trim(keep), AKV(reference_policy(keep, standard), name="akv_keep12"),
            AKV(reference_policy(keep), name="akv_keep12_every_turn"),
            AKV(lambda counter: live_budget_policy(live_budget, counter), name="akv_live_budget")]
