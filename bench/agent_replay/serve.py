"""Serving replay: N agent conversations replayed against an OpenAI-compatible server, at most
`concurrency` at a time, each sending its method's requests in order with a fixed output length
(`max_tokens` = the trajectory's, `ignore_eos`), and per-request timings and usage collected."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from akv.agent import BackendError, send_chat_request
from bench.agent_replay.chat import Filler
from bench.agent_replay.methods import AKV, Method, Request
from bench.agent_replay.trajectories import Trajectory

MESSAGE_OVERHEAD = 5
PLACEHOLDER = "[old tool result cleared]"
TAG_UNITS = 16
"""Filler units (one token each) in front of the system prompt that make a conversation unique."""


def tag(filler: Filler, key: str) -> str:
    """TAG_UNITS filler units drawn from `key`: distinct keys give distinct texts (with high probability)."""
    return filler.text(TAG_UNITS, int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


def tagged(trajectory: Trajectory) -> Trajectory:
    """The trajectory as its tagged conversations send it: the system prompt TAG_UNITS tokens longer."""
    first = trajectory.specs[0]
    specs = (dataclasses.replace(first, tokens=first.tokens + TAG_UNITS),) + trajectory.specs[1:]
    return Trajectory(trajectory.name, specs, trajectory.generation_tokens, trajectory.messages)


@dataclass(frozen=True)
class Conversation:
    """One replayed agent: a trajectory with its chat messages, tagged so that no two conversations
    share a cached prefix, and the method's requests. `trajectory` counts the tag."""

    index: int
    trajectory: Trajectory
    messages: tuple[Mapping[str, Any], ...]
    requests: tuple[Request, ...]


def prepare(trajectory: Trajectory, method: Method, copies: Sequence[int], filler: Filler, start_turn: int = 0,
            run: str = "") -> list[Conversation]:
    """Conversations `copies` (global indexes) of one trajectory under one method. A tag of
    TAG_UNITS `filler` units, drawn from (`run`, index), goes in front of the system prompt, so
    that no two conversations of any run share a cached prefix; the requests count it, and AKV
    decides on the tagged messages with akv.agent. With `start_turn`, requests of earlier turns are
    not sent: the first request prefills that turn's prompt cold (AKV's fields are cumulative, so
    they still hold every earlier decision)."""
    if trajectory.messages is None:
        raise ValueError(f"{trajectory.name}: no chat messages; realize them first (bench.agent_replay.chat.realize)")
    counted = tagged(trajectory)
    out = []
    for index in copies:
        messages = [dict(m) for m in trajectory.messages]
        messages[0]["content"] = tag(filler, f"{run}/{index}") + str(messages[0].get("content") or "")
        if isinstance(method, AKV):
            requests = tuple(method.requests(counted, messages))
        else:
            requests = tuple(method.requests(counted))
        requests = tuple(r for r in requests if r.turn >= start_turn)
        out.append(Conversation(index, counted, tuple(messages), requests))
    return out


def payload(conversation: Conversation, request: Request, model: str, filler: Filler, *,
            ignore_eos: bool = True) -> dict[str, Any]:
    """The chat completion body of one request: the pieces as chat messages, the fixed output
    length (`ignore_eos`, an SGLang field, keeps it fixed), and AKV's fields if any. Original
    messages are sent as realized (exact token counts); summaries and instructions get `filler`
    text of about their piece's tokens (the template's scaffolding estimated as MESSAGE_OVERHEAD),
    placeholders the fixed PLACEHOLDER text."""
    messages: list[dict[str, Any]] = []
    for piece in request.pieces:
        kind, k = piece.key
        if kind == "m":
            messages.append(dict(conversation.messages[k]))
        elif kind == "p":
            messages.append({"role": "tool", "tool_call_id": conversation.messages[k]["tool_call_id"],
                             "content": PLACEHOLDER})
        elif kind == "s":
            text = filler.text(max(0, piece.tokens - MESSAGE_OVERHEAD), 7919 * conversation.index + k)
            messages.append({"role": "user", "content": "Summary of the work so far:" + text})
        elif kind == "i":
            text = filler.text(max(0, piece.tokens - MESSAGE_OVERHEAD), 104729 + k)
            messages.append({"role": "user", "content": "Summarize the conversation so far." + text})
        else:
            raise ValueError(f"piece {piece.key}: unknown kind {kind!r}")
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": request.generated,
                            "temperature": 0.0, "stream": True}
    if ignore_eos:
        body["ignore_eos"] = True
    if request.drop_message:
        body["drop_message"] = dict(request.drop_message)
    if request.reposition:
        body["reposition"] = list(request.reposition)
    return body


@dataclass(frozen=True)
class Sample:
    """One request as served: seconds from the start of the run, TTFT and latency in seconds, and
    the server's usage (None where it reported none); `error` when the request failed."""

    conversation: int
    trajectory: str
    turn: int
    kind: str
    start_s: float
    ttft_s: float | None
    latency_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    repos_tokens: int | None
    drop_skipped_tokens: int | None
    error: str | None = None


Send = Callable[[str, dict[str, Any], float], Any]


def replay(url: str, conversations: Sequence[Conversation], concurrency: int, model: str, filler: Filler,
           timeout_s: float = 600.0, send: Send | None = None, run_seconds: float | None = None,
           progress: Callable[[str], None] | None = None, ignore_eos: bool = True,
           prime: bool = False) -> tuple[list[Sample], float]:
    """Run every conversation, at most `concurrency` at a time; a conversation stops at its first
    failed request (as an agent would). With `run_seconds`, no request starts after that many
    seconds (those in flight finish). With `prime`, every conversation first sends its first
    request unmeasured, and the run (its clock, `run_seconds`, the samples) starts once all of
    them are back: a steady state, each agent's context resident as it would be mid-trajectory
    (needs no more conversations than `concurrency`). Returns the samples and the wall time in
    seconds."""
    if prime and len(conversations) > concurrency:
        raise ValueError(f"prime: {len(conversations)} conversations, more than the concurrency {concurrency}")
    send = send or (lambda u, body, t: send_chat_request(u, body, timeout=t))
    queue = list(reversed(conversations))
    lock = threading.Lock()
    samples: list[Sample] = []
    clock = {"started": time.monotonic()}
    n_threads = min(concurrency, len(conversations))
    primed = threading.Barrier(n_threads, action=lambda: clock.update(started=time.monotonic())) if prime else None

    def run(conversation: Conversation, request: Request) -> Sample:
        body = payload(conversation, request, model, filler, ignore_eos=ignore_eos)
        t0 = time.monotonic()
        started = clock["started"]
        try:
            result = send(url, body, timeout_s)
        except BackendError as exc:
            return Sample(conversation.index, conversation.trajectory.name, request.turn, request.kind,
                          t0 - started, None, time.monotonic() - t0, None, None, None, None, None,
                          f"{str(exc)[:1000]}; request body: {json.dumps(body)[:500]}")
        usage = result.usage
        return Sample(conversation.index, conversation.trajectory.name, request.turn, request.kind, t0 - started,
                      result.timings.ttft_s, result.timings.total_s,
                      *(getattr(usage, k) if usage is not None else None for k in (
                          "prompt_tokens", "completion_tokens", "cached_tokens", "repos_tokens",
                          "drop_skipped_tokens")))

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                conversation = queue.pop()
            requests = conversation.requests
            if primed is not None:
                first = None
                try:
                    first = run(conversation, requests[0]) if requests else None
                finally:
                    primed.wait()  # also when the request raised: the others must not wait forever
                if first is not None and first.error is not None:
                    with lock:
                        samples.append(first)  # a failed priming request ends its conversation, counted
                requests = requests[1:] if first is not None and first.error is None else ()
            for request in requests:
                if run_seconds is not None and time.monotonic() - clock["started"] >= run_seconds:
                    return
                sample = run(conversation, request)
                with lock:
                    samples.append(sample)
                if sample.error is not None:
                    break
            if progress is not None:
                progress(f"conversation {conversation.index} ({conversation.trajectory.name}) done")

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.monotonic() - clock["started"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile `q` in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(samples: Sequence[Sample], wall_s: float) -> dict[str, Any]:
    """Throughput over the run's wall time and request-level percentiles (failed requests excluded)."""
    ok = [s for s in samples if s.error is None]
    output = sum(s.completion_tokens or 0 for s in ok)
    prompt = sum(s.prompt_tokens or 0 for s in ok)
    cached = sum(s.cached_tokens or 0 for s in ok)
    repos = sum(s.repos_tokens or 0 for s in ok)
    skipped = sum(s.drop_skipped_tokens or 0 for s in ok)
    latencies = [s.latency_s for s in ok]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    akv_reported = any(s.drop_skipped_tokens is not None for s in ok)
    return {
        "requests": len(ok), "failed": len(samples) - len(ok), "wall_s": wall_s,
        "output_tokens": output, "prompt_tokens": prompt, "cached_tokens": cached, "repos_tokens": repos,
        "drop_skipped_tokens": skipped, "longest_prompt_tokens": max((s.prompt_tokens or 0 for s in ok), default=0),
        "output_tok_per_s": output / wall_s if wall_s else None,
        "input_tok_per_s": prompt / wall_s if wall_s else None,
        "cached_fraction": cached / prompt if prompt else None,
        "read_fraction": (cached + repos) / prompt if prompt else None,
        "latency_p50_s": percentile(latencies, 50), "latency_p95_s": percentile(latencies, 95),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95),
        "server_reported_akv_usage": akv_reported,
        "first_errors": sorted({s.error for s in samples if s.error is not None})[:3],
    }


def sample_dicts(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in samples]
