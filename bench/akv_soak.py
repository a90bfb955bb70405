"""On the H200: the memory-pressure soak of issue #10 over HTTP. A Qwen3-8B-shaped model with random
bf16 weights on the patched server (FlashInfer, decode CUDA graphs, ``--enable-metrics``, SGLang's
strict busy and idle memory checks) with a KV pool several times smaller than what the traffic
publishes, against the exact reference server (FP32 on the same GPU, the same weight files).

Traffic, in waves (wave t = turn t of every lane, all sent at once): 12 agent conversations of 10
tool turns (results of 300-1500 tokens) through ``/v1/chat/completions``, each dropping its oldest
kept tool result from turn 2 and repositioning every third turn; a branch of 4 of them forked after
turn 3 with the same messages ever after but other drops (the oldest kept call), i.e. the same
tokens with another event history; at the fork a retry of 2 agents' turn sent alongside it; from
wave 1 a client that disconnects mid-stream; streamed and non-streamed requests; two bad requests
(a misspelt ``drop_messages``, a drop of a later message) that must be 400s naming the field.
Each wave also carries a sampled pair, a context request and the same messages plain (greedy, 8
tokens, log-probs); the context request goes first, right after its lane's previous turn sent again,
and the rest of the wave follows at once while the server holds it, so what it reuses (cached and
re-rotated tokens, ``context_sample_reuse`` in the wave's row) is what the design promises under the
pressure that follows, not what the race of the wave left resident. Each pair is answered again by
the reference server after the wave and judged by
``bench.harness.oracle.verdict`` (context error within 1.5x the plain requests', tokens equal where the
reference's top-2 margin exceeds that, prompt and drop-skipped tokens equal: cached and re-rotated
counts depend on what the soak left resident); a sample that would overrun the deadline is skipped
and says so. After the flush, a copies wave: every lane's last request again at once (the pool
under pressure again), one context request among them three times.

Checks (``failures`` in the report): no 5xx, no dropped connection but the deliberate ones, the bad
requests 400 naming their field, the server alive at the end; evictions happened (AKV's
``sglang:akv_evicted_tokens_total`` at least the pool size; also reported: KV computed against the
pool, near-full samples, recovered tokens); after the traffic, idle, ``/flush_cache``, the pool back
to empty (``/metrics``: no evictable and every slot available, ``/v1/loads``: no used token; the
idle gauges refresh every 30 s) -- a leak is a failure; every sampled pair within the verdict.
``/metrics`` and ``/v1/loads`` are sampled every 0.5 s into the report and plotted
(``akv_soak_pool.svg``). The report ``$AKV_BENCH_OUT/akv_soak.json`` is written after every wave
(and copied to ``$OUT`` when set).

Device call (carry [".devkit"] after tools/gpu/prepare.sh; timeout_s 600). Estimate: run.sh's install,
import check and models ~80 s; here the 8B random weights ~60-90 s (16 GiB drawn on the GPU, written
in 4 GiB shards), the server ~60-90 s (FlashInfer, carried kernels) with the reference (~43 GB: FP32
weights and KV) loading beside it, the 10 waves (~15-25 s each, reference samples included) until at
most ~100 s before the deadline (AKV_SOAK_DEADLINE_S, default 470 s from this script's start; when run
after another bench, set it to what is left), then idle + flush + the idle gauges' refresh (~35 s) and
the copies wave; ~9 minutes in all. A wave whose replies do not come in 240 s ends the traffic::

    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH="bench/akv_soak.py" DEADLINE_S=560 bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt

CPU dry run (the same flow: tiny random Qwen3 in sharded files, the CPU patched server FP32, the
CPU reference server, a 768-token pool, 3 agents + 2 branches over 4 turns, no tools in the requests:
evictions from turn 2, the fork and its retries at turn 2, the reposition at turn 3; ~3 minutes on two
idle cores, twice that on a loaded machine)::

    python bench/akv_soak.py --dry-run [--work DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from bench.harness import client, oracle, results, servers  # noqa: E402
from bench.harness.client import read_load, read_metrics  # noqa: E402
from bench.harness.models import make_qwen3_8b_random  # noqa: E402

STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
GPU_FLAGS = ["--dtype", "bfloat16", "--attention-backend", "flashinfer", "--page-size", "1",
             "--cuda-graph-max-bs", "16", "--disable-prefill-cuda-graph", "--chunked-prefill-size", "8192",
             "--context-length", "40960", "--mem-fraction-static", "0.8", "--sampling-backend", "pytorch",
             "--enable-cache-report", "--enable-metrics"]
"""The decode bench's FlashInfer flags (its carried kernels fit). SGLang sizes its pool from the memory
free at its start less 20%, capped by --max-total-tokens, so the reference loading beside it fits."""
CPU_FLAGS = [*servers.CPU_BASE, "--chunked-prefill-size", "256", "--skip-server-warmup", "--enable-metrics"]
"""The pool size (``--max-total-tokens``) is the scale's."""
CPU_BOUND_FLOOR = 1e-3
"""Dry run only: in FP32 on the CPU plain and context errors are both noise (~1e-5)."""
FINAL_RESERVE_S = 100.0
"""Seconds kept after the traffic for idle, flush, the idle gauges' refresh (every 30 s) and the copies wave."""


@dataclass(frozen=True)
class Scale:
    """How big the soak is: lanes, turns, tool-result sizes, the pool and the reference's KV."""

    agents: int
    turns: int
    result_tokens: tuple[int, int]
    pool: int
    max_tokens: int
    fork: int
    branches: int
    retries: int
    soak_s: float
    deadline_s: float
    reference_slots: int
    reference_chunk: int | None
    tools: bool
    wave_timeout_s: float


GPU = Scale(agents=12, turns=10, result_tokens=(300, 1500), pool=40000, max_tokens=16, fork=3, branches=4, retries=2,
            soak_s=300.0, deadline_s=470.0, reference_slots=32768, reference_chunk=2048, tools=True,
            wave_timeout_s=240.0)
CPU = Scale(agents=3, turns=4, result_tokens=(10, 30), pool=768, max_tokens=4, fork=2, branches=2, retries=2,
            soak_s=600.0, deadline_s=1200.0, reference_slots=8192, reference_chunk=None, tools=False,
            wave_timeout_s=240.0)
"""The dry run leaves the tools out of the requests (their ~350-token block would dominate the tiny
model's prompts and the CPU's time); the GPU run sends them."""
DRY_SHAPE = {"shard_bytes": 64 << 10}
"""The dry run's tiny model is written in shards too (the path the 8B maker takes)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny model, CPU servers of tests/sglang_cpu")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("AKV_BENCH_OUT", "soak-out")))
    p.add_argument("--work", type=Path, default=ROOT / "build" / "akv-soak", help="models (and CPU sites) are made here")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds from this script's start to its end (default AKV_SOAK_DEADLINE_S, else 470; dry 1200)")
    p.add_argument("--soak-s", type=float, default=None, help="traffic budget after the server is up (default 300)")
    p.add_argument("--ready-timeout", type=float, default=420.0)
    args = p.parse_args(argv)
    results.refuse_existing(p, args.out / "akv_soak.json")
    args.argv = sys.argv[1:] if argv is None else argv
    args.scale = CPU if args.dry_run else GPU
    if args.deadline_s is None:
        args.deadline_s = float(os.environ.get("AKV_SOAK_DEADLINE_S", args.scale.deadline_s))
    if args.soak_s is None:
        args.soak_s = args.scale.soak_s
    return args


def record_text(tokenizer: Any, seed: int, i: int, n_tokens: int) -> str:
    """A tool result of about ``n_tokens`` tokens, the same for the same (seed, i, n_tokens)."""
    rng = random.Random(seed * 7919 + i)
    words = " ".join(f"r{seed}x{i}w{j} v{rng.randrange(1000)}" for j in range(n_tokens))
    offsets = tokenizer(words, return_offsets_mapping=True)["offset_mapping"]
    return words[: offsets[min(n_tokens, len(offsets)) - 1][1]]


@dataclass
class Lane:
    """One conversation's messages and the cumulative cache operations sent with each of its turns:
    each turn adds a tool call and its result; from turn 2 it drops its oldest kept message of
    ``drop_role`` (anchored at the new result), and repositions there every third turn."""

    name: str
    tokenizer: Any
    seed: int
    drop_role: str
    tools: bool = True
    messages: list[dict[str, Any]] = field(default_factory=list)
    drops: dict[str, list[int]] = field(default_factory=dict)
    repositions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [
                {"role": "system", "content": f"Run {self.seed}: follow chains of records with read_record."},
                {"role": "user", "content": f"Start at record {self.seed}-0 and follow the chain."}]

    def advance(self, turn: int, n_tokens: int) -> None:
        i = len(self.messages) // 2
        call_id = f"call_{self.seed}_{i}"
        call = {"name": "read_record", "arguments": json.dumps({"id": f"{self.seed}-{i}"})}
        self.messages.append({"role": "assistant", "content": None,
                              "tool_calls": [{"id": call_id, "type": "function", "function": call}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": record_text(self.tokenizer, self.seed, i, n_tokens)})
        anchor = len(self.messages) - 1
        dropped = {m for ms in self.drops.values() for m in ms}
        kept = [i for i, m in enumerate(self.messages[:-2]) if m["role"] == self.drop_role and i not in dropped]
        if turn >= 2 and kept:
            self.drops[str(anchor)] = [kept[0]]
        if turn and turn % 3 == 0:
            self.repositions.append(anchor)

    def body(self, plain: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": list(self.messages), **({"tools": client.TOOLS} if self.tools else {})}
        if not plain and self.drops:
            out["drop_message"] = {k: list(v) for k, v in self.drops.items()}
        if not plain and self.repositions:
            out["reposition"] = list(self.repositions)
        return out

    def fork(self, name: str, drop_role: str) -> Lane:
        return Lane(name, self.tokenizer, self.seed, drop_role, self.tools, [dict(m) for m in self.messages],
                    {k: list(v) for k, v in self.drops.items()}, list(self.repositions))


@dataclass(frozen=True)
class Job:
    """One HTTP request of a wave: ``kind`` is traffic, retry, disconnect, bad (expects 400 naming
    ``param``) or sample (greedy with log-probs, compared with the reference)."""

    name: str
    body: dict[str, Any]
    kind: str = "traffic"
    stream: bool = False
    param: str | None = None


def send(url: str, job: Job, max_tokens: int, timeout: float) -> dict[str, Any]:
    """Send ``job`` (waiting at most ``timeout`` seconds for each read); its outcome: status, usage,
    seconds, and what went wrong (``error``)."""
    host, port = url.removeprefix("http://").split(":")
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0.0, **job.body}
    if job.kind == "sample":
        body.update(max_tokens=8, logprobs=True, top_logprobs=2)
    if job.stream or job.kind == "disconnect":
        body.update(stream=True, stream_options={"include_usage": True})
    if job.kind == "disconnect":
        body["max_tokens"] = 8 * max_tokens
    out: dict[str, Any] = {"name": job.name, "kind": job.kind, "stream": bool(body.get("stream"))}
    started = time.perf_counter()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        out["status"] = response.status
        if response.status != 200:
            out["error_body"] = json.loads(response.read() or b"{}")
        elif job.kind == "disconnect":
            out["first_line"] = response.readline().decode()[:80]
            conn.close()  # mid-stream: the server must abort the request and free its KV
            out["disconnected"] = True
        elif body.get("stream"):
            events, done = [], False
            for raw in response:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
            out["usage"] = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
            if not done:
                out["error"] = "stream ended without [DONE]"
        else:
            reply = json.loads(response.read())
            out["usage"] = reply.get("usage")
            if job.kind == "sample":
                out["reply"] = reply
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = repr(exc)[:300]
    finally:
        conn.close()
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out


def problems(outcome: dict[str, Any], job: Job) -> list[str]:
    """What is wrong with one outcome (empty when it is as expected)."""
    name, status = job.name, outcome.get("status")
    if outcome.get("error"):
        return [f"{name}: {outcome['error']}"]
    if job.kind == "bad":
        error = outcome.get("error_body") or {}
        if status != 400 or error.get("param") != job.param:
            return [f"{name}: expected a 400 naming {job.param!r}, got {status} {json.dumps(error)[:200]}"]
        return []
    if status != 200:
        return [f"{name}: HTTP {status} {json.dumps(outcome.get('error_body'))[:300]}"]
    if job.kind != "disconnect" and not (outcome.get("usage") or {}).get("prompt_tokens"):
        return [f"{name}: no usage in the reply"]
    return []


def held_by(url: str, requests: int, timeout: float) -> bool:
    """Wait until the server holds ``requests`` requests (running or waiting); whether it did in time."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            load = read_load(url, timeout=5)
            if load["num_running_reqs"] + load["num_waiting_reqs"] >= requests:
                return True
        except (OSError, ValueError, KeyError, IndexError):
            pass
        time.sleep(0.02)
    return False


class Sampler(threading.Thread):
    """``/metrics`` and ``/v1/loads`` every ``period`` seconds until stopped."""

    GAUGES = ("kv_available_tokens", "kv_evictable_tokens", "kv_used_tokens", "token_usage", "num_running_reqs",
              "num_queue_reqs", "akv_evicted_tokens_total", "akv_recovered_tokens_total",
              "akv_context_requests_total", "akv_rerotated_tokens_total", "num_retracted_reqs")

    def __init__(self, url: str, t0: float, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.t0, self.period = url, t0, period
        self.samples: list[dict[str, Any]] = []
        self.errors = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.samples.append(self.read())
            except (OSError, ValueError, KeyError, IndexError):
                self.errors += 1
            self.halt.wait(self.period)

    def read(self) -> dict[str, Any]:
        metrics = read_metrics(self.url)
        load = read_load(self.url)
        row = {"t": round(time.time() - self.t0, 2), "used": load["num_used_tokens"],
               "pool": load["max_total_num_tokens"], "running": load["num_running_reqs"],
               "waiting": load["num_waiting_reqs"]}
        row.update({k: metrics[k] for k in self.GAUGES if k in metrics})
        return row


def pool_svg(samples: list[dict[str, Any]], pool: int, marks: list[tuple[float, str]]) -> str:
    """Pool occupancy over time: tokens held by requests, held by the tree (evictable), free; and
    AKV's evicted-token counter; wave starts as ticks."""
    width, height, left, right, top, bottom = 760, 560, 70, 170, 30, 40
    panel = (height - top) // 2
    t_max = max((s["t"] for s in samples), default=1.0) or 1.0
    plot_w = width - left - right
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
             '<rect width="100%" height="100%" fill="white"/>']
    panels = [("KV pool (tokens)", pool, {"held by requests": "used",
                                          "held by the tree (evictable)": "kv_evictable_tokens",
                                          "free": "kv_available_tokens"}),
              ("AKV evicted tokens (cumulative)", None, {"evicted": "akv_evicted_tokens_total",
                                                       "recovered by prefill": "akv_recovered_tokens_total"})]
    colours = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
    for p, (title, y_cap, series) in enumerate(panels):
        y0 = p * panel
        plot_h = panel - top - bottom
        y_max = y_cap or max((s.get(k, 0) for s in samples for k in series.values()), default=1) or 1
        parts.append(f'<text x="{left}" y="{y0 + 18}" font-size="13">{escape(title)}</text>')
        parts.append(f'<rect x="{left}" y="{y0 + top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>')
        for k in range(5):
            parts.append(f'<text x="{left - 6}" y="{y0 + top + plot_h - plot_h * k / 4 + 4}" font-size="10" '
                         f'text-anchor="end">{y_max * k / 4:.0f}</text>')
            parts.append(f'<text x="{left + plot_w * k / 4}" y="{y0 + top + plot_h + 14}" font-size="10" '
                         f'text-anchor="middle">{t_max * k / 4:.0f} s</text>')
        for t, label in marks:
            x = left + plot_w * t / t_max
            parts.append(f'<line x1="{x:.1f}" y1="{y0 + top}" x2="{x:.1f}" y2="{y0 + top + plot_h}" stroke="#ccc"/>')
            if p == 0:
                parts.append(f'<text x="{x + 2:.1f}" y="{y0 + top + 10}" font-size="9" fill="#888">'
                             f'{escape(label)}</text>')
        for k, (name, key) in enumerate(series.items()):
            points = " ".join(f"{left + plot_w * s['t'] / t_max:.1f},"
                              f"{y0 + top + plot_h - plot_h * min(s[key], y_max) / y_max:.1f}"
                              for s in samples if key in s)
            parts.append(f'<polyline fill="none" stroke="{colours[k]}" stroke-width="1.5" points="{points}"/>')
            ly = y0 + top + 14 * k + 8
            parts.append(f'<line x1="{width - right + 8}" y1="{ly}" x2="{width - right + 26}" y2="{ly}" '
                         f'stroke="{colours[k]}" stroke-width="2"/><text x="{width - right + 30}" y="{ly + 4}" '
                         f'font-size="11">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


class Soak:
    """The report, the clock, the lanes and the servers of one soak run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.scale, self.started = args, args.scale, time.time()
        self.report: dict[str, Any] = {**results.header("bench/akv_soak.py", args.argv),
                                       "dry_run": args.dry_run, "deadline_s": args.deadline_s,
                                       "scale": self.scale.__dict__, "waves": [], "failures": []}
        self.outcomes: list[dict[str, Any]] = []
        self.rows: dict[str, dict[str, Any]] = {}
        self.sampler: Sampler | None = None
        self.marks: list[tuple[float, str]] = []
        self.last_lanes: list[Lane] = []

    def left(self) -> float:
        return self.args.deadline_s - (time.time() - self.started)

    def log(self, message: str) -> None:
        print(f"[akv_soak {time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - self.started:.0f}s] {message}",
              flush=True)

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.started, 1)
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        if self.sampler is not None:
            self.report["timeline"] = list(self.sampler.samples)
            pool = int(self.report.get("pool_tokens") or self.scale.pool)
            (out / "akv_soak_pool.svg").write_text(pool_svg(self.sampler.samples, pool, self.marks))
            copy_to = os.environ.get("OUT")
            if copy_to and Path(copy_to).resolve() != out.resolve():
                shutil.copy(out / "akv_soak_pool.svg", Path(copy_to) / "akv_soak_pool.svg")
        results.write(self.report, out / "akv_soak.json", copy_to_out=True)

    def waves(self, url: str, reference_url: str, tokenizer: Any) -> None:
        """Turn after turn of every lane, one wave at a time, until the turns or the time run out."""
        s = self.scale
        agents = [Lane(f"agent{i}", tokenizer, 600 + i, "tool", s.tools) for i in range(s.agents)]
        branches: list[tuple[int, Lane]] = []
        rng = random.Random(10)
        traffic_end = min(time.time() + self.args.soak_s, self.started + self.args.deadline_s - FINAL_RESERVE_S)
        sample_cost = 0.0
        for turn in range(s.turns):
            if time.time() >= traffic_end:
                self.report["traffic_cut"] = f"stopped before wave {turn}: the soak budget or the deadline"
                break
            if turn == s.fork:  # the same messages from here on, other drops: the same tokens, another history
                branches = [(i, agents[i].fork(f"branch{i}", "assistant")) for i in range(s.branches)]
            lanes = agents + [branch for _, branch in branches]
            previous = {lane.name: lane.body() for lane in lanes}
            sizes = [rng.randint(*s.result_tokens) for _ in agents]
            for agent, size in zip(agents, sizes):
                agent.advance(turn, size)
            for i, branch in branches:
                branch.advance(turn, sizes[i])
            jobs = [Job(f"{lane.name}-t{turn}", lane.body(), stream=(k + turn) % 2 == 1)
                    for k, lane in enumerate(lanes)]
            if turn == s.fork:
                jobs += [Job(f"{lane.name}-t{turn}-retry", lane.body(), "retry") for lane in agents[: s.retries]]
            retried = agents[: s.retries] if turn == s.fork else []
            context = [lane for lane in lanes if lane.drops and lane not in retried]
            sample_lane = (context or lanes)[turn % len(context or lanes)]
            if turn >= 1:  # a copy of another lane's request: no lane has more than two copies in flight
                cut = next(lane for lane in lanes[turn % len(lanes):] + lanes
                           if lane is not sample_lane and lane not in retried)
                jobs.append(Job(f"{cut.name}-t{turn}-disconnect", cut.body(), "disconnect"))
            if turn == 1:
                jobs.append(Job("bad-misspelt-field", {**agents[0].body(), "drop_messages": {"1": [0]}}, "bad",
                                param="drop_messages"))
            if turn == 2:
                last = len(agents[1].messages) - 1
                jobs.append(Job("bad-drop-of-a-later-message", {**agents[1].body(), "drop_message": {"1": [last]}},
                                "bad", param="drop_message"))
            jobs.append(Job(f"plain-w{turn}", sample_lane.body(plain=True), "sample"))
            first = None
            if context:
                first = (Job(f"{sample_lane.name}-t{turn - 1}-again", previous[sample_lane.name], "retry"),
                         Job(f"context-w{turn}", sample_lane.body(), "sample"))
            self.last_lanes = lanes
            sample_cost, stuck = self.wave(turn, jobs, url, reference_url, sample_cost, first)
            if stuck:
                self.report["traffic_cut"] = f"stopped after wave {turn}: {stuck}"
                break

    def wave(self, turn: int, jobs: list[Job], url: str, reference_url: str, sample_cost: float,
             first: tuple[Job, Job] | None = None) -> tuple[float, str | None]:
        """Send ``first`` (the sampled lane's previous turn again, alone; then its context request)
        ahead of ``jobs``, which go at once as soon as the server holds that request; check every
        outcome, then the samples against the reference (those that fit before the deadline); returns
        the running estimate of one sample's reference time, and why the traffic cannot go on (requests
        timed out or the server unreachable) or None."""
        started = time.time()
        self.marks.append((started - self.sampler.t0, f"w{turn}"))
        timeout = max(5.0, min(self.scale.wave_timeout_s, self.left() - FINAL_RESERVE_S))
        outcomes = []
        with ThreadPoolExecutor(max_workers=len(jobs) + 1) as pool:
            if first is not None:
                again, context = first
                outcomes.append(send(url, again, self.scale.max_tokens, timeout))
                ahead = pool.submit(send, url, context, self.scale.max_tokens, timeout)
                held_by(url, 1, timeout=10.0)
            rest = list(pool.map(lambda job: send(url, job, self.scale.max_tokens, timeout), jobs))
            if first is not None:
                outcomes.append(ahead.result())
            outcomes += rest
        jobs = [*(first or ()), *jobs]
        failures = [p for job, outcome in zip(jobs, outcomes) for p in problems(outcome, job)]
        samples: dict[str, Any] = {}
        for job, outcome in zip(jobs, outcomes):
            if job.kind != "sample" or "reply" not in outcome:
                continue
            if self.left() < FINAL_RESERVE_S + 2 * sample_cost + 5:
                samples[job.name] = "skipped: would overrun the deadline"
                continue
            t = time.time()
            try:
                want = client.chat(reference_url, job.body)
            except OSError as exc:
                failures.append(f"{job.name}: the reference server failed: {exc!r}"[:300])
                continue
            sample_cost = max(sample_cost, time.time() - t)
            self.rows[job.name] = oracle.compare(outcome["reply"], want)
            samples[job.name] = {k: self.rows[job.name][k] for k in ("error", "agree", "n", "margin_at_split")}
        for outcome in outcomes:
            outcome.pop("reply", None)
        self.outcomes += outcomes
        statuses: dict[str, int] = {}
        for outcome in outcomes:
            key = "disconnected" if outcome.get("disconnected") else str(outcome.get("status", "no reply"))
            statuses[key] = statuses.get(key, 0) + 1
        latest = self.sampler.samples[-1] if self.sampler.samples else {}
        row = {"wave": turn, "requests": len(jobs), "seconds": round(time.time() - started, 1), "statuses": statuses,
               "max_prompt_tokens": max(((o.get("usage") or {}).get("prompt_tokens") or 0) for o in outcomes),
               "failures": failures, "samples": samples, "akv_evicted_tokens": latest.get("akv_evicted_tokens_total"),
               "context_sample_reuse": next((((o.get("usage") or {}).get("prompt_tokens_details") or {})
                                             for job, o in zip(jobs, outcomes) if job.name == f"context-w{turn}"), None)}
        self.report["waves"].append(row)
        self.report["failures"] += failures
        self.summarise()
        self.write()
        self.log(f"wave {turn}: {len(jobs)} requests in {row['seconds']} s {statuses}, longest prompt "
                 f"{row['max_prompt_tokens']}, evicted so far {latest.get('akv_evicted_tokens_total')}, "
                 f"samples {json.dumps(samples)[:200]}, failures {failures[:3]}")
        stuck = [o["name"] for o in outcomes
                 if any(k in o.get("error", "") for k in ("Timeout", "timed out", "Refused"))]
        return sample_cost, (f"no reply in {timeout:.0f} s or no connection: {stuck}" if stuck else None)

    def summarise(self) -> None:
        """Traffic totals, eviction evidence and the oracle verdict so far."""
        done = [o for o in self.outcomes if o.get("usage")]
        details = [(o["usage"], o["usage"].get("prompt_tokens_details") or {}) for o in done]
        computed = sum(u["prompt_tokens"] - (d.get("cached_tokens") or 0) - (d.get("repos_tokens") or 0)
                       + (u.get("completion_tokens") or 0) for u, d in details)
        samples = self.sampler.samples if self.sampler else []
        pool = int(self.report.get("pool_tokens") or self.scale.pool)
        last = samples[-1] if samples else {}
        self.report["traffic"] = {
            "requests": len(self.outcomes), "completed_with_usage": len(done),
            "deliberate_disconnects": sum(bool(o.get("disconnected")) for o in self.outcomes),
            "bad_requests": sum(o["kind"] == "bad" for o in self.outcomes),
            "five_xx": sum((o.get("status") or 0) >= 500 for o in self.outcomes),
            "dropped_connections": sum(bool(o.get("error")) for o in self.outcomes),
            "streamed": sum(o["stream"] for o in self.outcomes),
            "prompt_tokens": sum(u["prompt_tokens"] for u, _ in details),
            "cached_tokens": sum(d.get("cached_tokens") or 0 for _, d in details),
            "repos_tokens": sum(d.get("repos_tokens") or 0 for _, d in details),
            "drop_skipped_tokens": sum(d.get("drop_skipped_tokens") or 0 for _, d in details)}
        self.report["evictions"] = {
            "pool_tokens": pool, "kv_computed_tokens": computed, "computed_vs_pool": round(computed / pool, 2),
            "akv_evicted_tokens": last.get("akv_evicted_tokens_total"),
            "akv_recovered_tokens": last.get("akv_recovered_tokens_total"),
            "near_full_samples": sum(s.get("kv_available_tokens", pool) < 0.1 * pool for s in samples),
            "samples": len(samples), "sampler_errors": self.sampler.errors if self.sampler else None}
        if any(n.startswith("plain") for n in self.rows):
            verdict = oracle.verdict(self.rows, CPU_BOUND_FLOOR if self.args.dry_run else 0.0, same_cache=False)
            self.report["oracle"] = {**verdict, "pairs": len(self.rows), "rows": self.rows}

    def finish(self, server: servers.Server) -> None:
        """Idle, flush, the pool back to empty, then every end-of-run check into ``failures``."""
        failures = self.report["failures"]
        try:
            self.report["after"] = self.flush(server)
        except OSError as exc:
            self.report["after"] = {"error": repr(exc)[:300]}
        after = self.report["after"]
        if not after.get("pool_empty"):
            failures.append(f"the pool is not back to empty after the traffic and /flush_cache: {after}"[:600])
        elif self.left() > 30:
            self.report["copies"] = self.copies(server.url)
        else:
            self.report["copies"] = {"skipped": f"{self.left():.0f} s left before the deadline"}
        self.summarise()
        evicted = self.report["evictions"]["akv_evicted_tokens"] or 0
        if evicted < self.report["evictions"]["pool_tokens"]:
            failures.append(f"evictions: {evicted} tokens evicted, fewer than the pool's "
                            f"{self.report['evictions']['pool_tokens']}")
        oracle = self.report.get("oracle")
        if oracle is None:
            failures.append("oracle: no sampled pair was compared")
        else:
            failures += [f"oracle: {f}" for f in oracle["failures"]]
        alive, health = server.process.poll() is None, None
        for _ in range(3):
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=20) as r:
                    health = r.status
                break
            except OSError as exc:
                health = repr(exc)[:200]
        if health != 200:
            alive = False
            failures.append(f"the server does not answer /health at the end: {health}")
        if server.process.poll() is not None:
            failures.append(f"the server exited with {server.process.returncode}")
        self.report["server_alive_at_end"] = alive

    def copies(self, url: str) -> dict[str, Any]:
        """After the flush, under pressure again: every lane's last request at once, one context request
        among them three times (the same tokens and events in flight thrice); every reply must come."""
        lanes = self.last_lanes
        target = next((lane for lane in lanes if lane.drops), lanes[0])
        jobs = [Job(f"copies-{lane.name}", lane.body(), stream=k % 2 == 1) for k, lane in enumerate(lanes)]
        jobs += [Job(f"copies-{target.name}-copy{k}", target.body()) for k in (1, 2)]
        timeout = max(5.0, min(self.scale.wave_timeout_s, self.left() - 15))
        started = time.time()
        self.marks.append((started - self.sampler.t0, "copies"))
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            outcomes = list(pool.map(lambda job: send(url, job, self.scale.max_tokens, timeout), jobs))
        self.outcomes += outcomes
        failures = [f"copies: {p}" for job, outcome in zip(jobs, outcomes) for p in problems(outcome, job)]
        self.report["failures"] += failures
        self.log(f"copies: {len(jobs)} requests ({target.name} thrice) in {time.time() - started:.1f} s, "
                 f"failures {failures[:3]}")
        return {"requests": len(jobs), "tripled": target.name, "seconds": round(time.time() - started, 1),
                "failures": failures}

    def flush(self, server: servers.Server) -> dict[str, Any]:
        """Wait (bounded) for the server to go idle, flush its cache, wait for the idle gauges to show an
        empty pool: what was seen."""
        after: dict[str, Any] = {"pool_empty": False}
        idle_by = time.time() + min(self.scale.wave_timeout_s / 3, max(5.0, self.left() - 50))
        load = self.sampler.read()
        while time.time() < idle_by and (load["running"] or load["waiting"]):
            time.sleep(0.5)
            load = self.sampler.read()
        if load["running"] or load["waiting"]:
            return {**after, "not_idle": load}
        time.sleep(1.0)
        idle = read_metrics(server.url)
        after["idle_metrics"] = {k: idle[k] for k in Sampler.GAUGES if k in idle}
        after["flush_status"] = client.flush_cache(server.url)
        flushed = time.time()
        while time.time() - flushed < 45 and self.left() > 5:
            m, load = read_metrics(server.url), self.sampler.read()
            after["final"] = {"used": load["used"], "pool": load["pool"],
                              "kv_available_tokens": m.get("kv_available_tokens"),
                              "kv_evictable_tokens": m.get("kv_evictable_tokens")}
            if load["used"] == 0 and m.get("kv_evictable_tokens") == 0 and m.get("kv_available_tokens") == load["pool"]:
                after.update(pool_empty=True, seconds_to_empty=round(time.time() - flushed, 1))
                break
            time.sleep(1.0)
        return after


def make_model(args: argparse.Namespace, log: Any) -> Path:
    """The dry run's tiny random Qwen3 (sharded), or the 8B shape with random weights (reused if whole)."""
    from akv.system.models.tiny import make_tiny_model

    if args.dry_run:
        return make_tiny_model(args.work / "tiny-qwen3-sharded", seed=3, dtype="bfloat16", log=log, **DRY_SHAPE)
    folder = args.work / "qwen3-8b-random"
    index = folder / "model.safetensors.index.json"
    if index.exists() and all((folder / f).exists() for f in set(json.loads(index.read_text())["weight_map"].values())):
        log(f"{folder}: reusing the weights written before")
        return folder
    import torch

    made = make_qwen3_8b_random(folder, seed=0, log=log)
    torch.cuda.empty_cache()  # the drawing buffers: free before the server sizes its pool
    return made


def load_reference(model: Path, scale: Scale, device: str, into: dict[str, Any]) -> None:
    """The reference server on ``model`` (FP32 on ``device``), serving from a daemon thread."""
    import torch

    from akv.system.reference_server import Engine, ReferenceServer

    started = time.time()
    try:
        torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's contract is FP32 arithmetic
        engine = Engine(model, name="default", kv_slots=scale.reference_slots, device=device,
                        prefill_chunk=scale.reference_chunk)
        server = ReferenceServer(engine)
        server.start_in_background()
        into.update(server=server, load_s=round(time.time() - started, 1))
    except Exception as exc:  # noqa: BLE001 - reported by the main thread
        into["error"] = repr(exc)[-2000:]


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run.sh's timeout: stop the server, keep the report
    args = parse_args(argv)
    soak = Soak(args)
    base = {**os.environ, **STRICT}
    if args.dry_run:
        site = servers.cpu_pythonpath(servers.cpu_patched_site(args.work))
        env, flags, port, device = {**base, "PYTHONPATH": site}, CPU_FLAGS, servers.free_port(), "cpu"
    else:
        env, flags, port, device = base, GPU_FLAGS, 30040, "cuda"
    model = make_model(args, soak.log)
    soak.report["model"] = {"path": str(model), "config": json.loads((model / "config.json").read_text())}
    launched = time.time()
    server = servers.launch("patched", "akv.system.launch_server", model,
                            [*flags, "--max-total-tokens", str(args.scale.pool)], env, port, args.out / "server-soak.log")
    soak.report["server"] = {"command": server.command, "env": STRICT}
    reference: dict[str, Any] = {}
    loader = threading.Thread(target=load_reference, args=(model, args.scale, device, reference))
    loader.start()
    soak.log("patched server starting; reference loading beside it")
    try:
        server.wait(max(10.0, min(args.ready_timeout, soak.left() - FINAL_RESERVE_S)))
        soak.report["server"]["startup_s"] = round(time.time() - launched, 1)
        loader.join()
        if "error" in reference:
            raise RuntimeError(f"the reference server did not load: {reference['error']}")
        soak.report["reference"] = {"device": device, "load_s": reference["load_s"],
                                    "kv_slots": args.scale.reference_slots, "prefill_chunk": args.scale.reference_chunk}
        soak.log(f"server ready after {soak.report['server']['startup_s']} s, "
                 f"reference loaded in {reference['load_s']} s")
        soak.sampler = Sampler(server.url, time.time())
        soak.sampler.start()
        soak.report["pool_tokens"] = soak.sampler.read()["pool"]
        from transformers import AutoTokenizer

        soak.waves(server.url, reference["server"].url, AutoTokenizer.from_pretrained(model))
        soak.finish(server)
    except Exception as exc:  # noqa: BLE001 - the report says what stopped the run
        soak.report["failures"].append(f"the soak stopped: {exc!r}"[-3000:])
    finally:
        if soak.sampler is not None:
            soak.sampler.halt.set()
        server.stop()
        loader.join()
        if "server" in reference:
            reference["server"].shutdown()
            reference["server"].server_close()
        soak.report["ok"] = not soak.report["failures"]
        soak.write()
    soak.log("summary " + json.dumps({"ok": soak.report["ok"], "failures": soak.report["failures"][:5],
                                      "evictions": soak.report.get("evictions"), "after": soak.report.get("after")}))
    return 0 if soak.report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
