"""On the H200: decode step time of agent requests whose context is half dropped, patched server vs
stock SGLang 0.5.16 serving a prompt of only the live tokens (Qwen3-8B-shaped dummy weights, bf16,
FlashInfer attention unless ``--backend`` names another for both servers, decode CUDA graphs on), and
each server's plain-request throughput.

For each live length L: a tool conversation of about 2L tokens whose every other tool result is
dropped at the last message (``drop_message``, no reposition) goes to the patched server; the same
conversation without those results goes to stock. Both servers start together and stay up, but only
one of them is measured at a time. A plain request and one request per live length warm each
server, then B identical requests stream together (B = 1, 8, 16) until SGLang has logged
``--lines`` + 1 decode lines (20 steps each) with exactly B requests running, and all are then
aborted (``/abort_request``), so requests that reach the scheduler staggered (each context request's
provenance runs before it is sent on) cost no fixed token
budget. The step time is B over the generation throughput of those lines (median, the first line at
B skipped: it spans the ramp); the lines' ``cuda graph`` flag is kept beside it. The plain burst (after
the first live length) is 16 distinct prompts sent at once, an untimed one on each server, then
``--bursts`` rounds of fresh prompts, the server that goes first alternating; its ratio is the
median of the rounds' patched / stock output tokens/s (``AKV_DECODE_LIVE=""``: the burst only). The
attention floor at H200 bandwidth is about 30.7 us per 1K live tokens per request per step.

H200 (one device call, carry [".devkit"]):
    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH="bench/akv_decode_bench.py" DEADLINE_S=530 \\
        bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
FA3 (both servers on ``--attention-backend fa3``; compute capability 8.x or 9.x), the same call with
``AKV_DECODE_BACKEND=fa3`` (``AKV_DECODE_LIVE=32768`` keeps it to the 32k cases if time is short):
    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_DECODE_BACKEND=fa3 AKV_BENCH="bench/akv_decode_bench.py" \\
        DEADLINE_S=530 bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
Writes ``$AKV_BENCH_OUT/akv_decode_bench.json`` (and a copy in ``$OUT`` where that is set) after every
measurement.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli  # noqa: E402
from akv.system.adapter.serving import ATTENTION_BACKENDS  # noqa: E402
from bench.akv_8b_check import parser_8b, with_backend  # noqa: E402
from bench.harness import client, results, servers  # noqa: E402
from bench.harness.client import TOOLS  # noqa: E402
from bench.harness.conversations import Conversation  # noqa: E402
from bench.harness.servers import Server  # noqa: E402

FLOOR_US_PER_1K = 30.7
GOAL_RATIO = 1.10
BURST_GOAL = 0.98
CONTEXT = 262144
COMMON = ["--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend", "flashinfer",
          "--page-size", "1", "--chunked-prefill-size", "16384", "--cuda-graph-max-bs", "16",
          "--disable-prefill-cuda-graph", "--enable-cache-report", "--context-length", str(CONTEXT),
          "--max-running-requests", "64", "--decode-log-interval", "20"]
POOLS = {"patched": ["--max-total-tokens", "330000", "--mem-fraction-static", "0.8"],
         "stock": ["--max-total-tokens", "170000", "--mem-fraction-static", "0.8"]}
"""Pools for both live lengths' conversations at once (patched: 2L each, stock: L each); both servers
start together, and each fraction leaves its pool room whichever of them profiles the GPU first."""

_DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*(?:cuda|cpu) graph: (\w+), gen throughput \(token/s\): ([\d.]+)")


def stream(url: str, body: dict[str, Any], tokens: int, stop: threading.Event | None = None,
           first: list[float] | None = None) -> int:
    """Stream one chat request; the number of output chunks received. An error chunk raises unless
    ``stop`` is set (the request was aborted on purpose); ``first`` gets the time of the first chunk."""
    full = {"model": "default", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "tools": TOOLS, **body}
    chunks = 0
    with cli.open_request(f"{url}/v1/chat/completions", full, timeout=900) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                if stop is not None and stop.is_set():
                    break
                raise RuntimeError(f"server error: {json.dumps(chunk)[:400]}")
            if chunk.get("choices"):
                chunks += 1
                if chunks == 1 and first is not None:
                    first.append(time.perf_counter())
    return chunks


def decode_lines(log: Path, offset: int, batch: int) -> list[tuple[float, bool]]:
    """(step ms, CUDA graph used) of the decode log lines written after ``offset`` with exactly
    ``batch`` requests running."""
    return [(1e3 * batch / float(m[3]), m[2] == "True") for m in _DECODE_LINE.finditer(log.read_text()[offset:])
            if int(m[1]) == batch and float(m[3]) > 0]


def measure(server: Server, body: dict[str, Any], batch: int, max_tokens: int, lines: int,
            timeout: float) -> dict[str, Any]:
    """B identical streams until ``lines`` + 1 decode lines at exactly B are logged, then abort."""
    offset = len(server.log_path.read_text())
    stop = threading.Event()
    started = time.perf_counter()
    pool = ThreadPoolExecutor(batch)
    futures = [pool.submit(stream, server.url, body, max_tokens, stop) for _ in range(batch)]
    while time.perf_counter() - started < timeout and not all(f.done() for f in futures):
        if len(decode_lines(server.log_path, offset, batch)) > lines:
            break
        time.sleep(0.1)
    stop.set()
    cli.request_json(f"{server.url}/abort_request", {"abort_all": True}, timeout=60)
    try:
        chunks = [f.result(timeout=60) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    client.wait_idle(server.url)
    seen = decode_lines(server.log_path, offset, batch)[1:]
    return {"step_ms": statistics.median(ms for ms, _ in seen) if seen else None, "lines": len(seen),
            "cuda_graph": all(graph for _, graph in seen) if seen else None, "chunks": chunks,
            "seconds": round(time.perf_counter() - started, 2)}


def case(tokenizer: Any, live: int, seed: int) -> tuple[dict[str, Any], dict[str, Any], int, int]:
    """(patched body, stock body, live prompt tokens, all prompt tokens, the tool list included) for
    about ``2 * live`` tokens, every other tool result dropped."""
    conv = Conversation(tokenizer, seed, result_tokens=2000)
    conv.step()
    per_step = len(tokenizer(tokenizer.apply_chat_template(conv.messages, tokenize=False)).input_ids)
    for _ in range(2 * live // per_step - 1):
        conv.step()
    last = len(conv.messages) - 1
    results = [i for i, m in enumerate(conv.messages) if m["role"] == "tool" and i != last]
    dropped = set(results[::2])
    kept = [m for i, m in enumerate(conv.messages) if i not in dropped]
    n_live, n_all = (len(tokenizer(tokenizer.apply_chat_template(m, tools=TOOLS, tokenize=False)).input_ids)
                     for m in (kept, conv.messages))
    return ({"messages": conv.messages, "drop_message": {str(last): sorted(dropped)}}, {"messages": kept},
            n_live, n_all)


def burst_bodies(tokenizer: Any, n: int, seed: int) -> list[dict[str, Any]]:
    bodies = []
    for i in range(n):
        conv = Conversation(tokenizer, seed + i, result_tokens=1500)
        conv.step()
        bodies.append({"messages": conv.messages})
    return bodies


def burst(url: str, bodies: list[dict[str, Any]], tokens: int) -> dict[str, float]:
    """Output tokens per second over distinct plain requests sent at once, and when their first
    tokens came (median and last, seconds from the start)."""
    firsts: list[float] = []
    started = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        chunks = list(pool.map(lambda body: stream(url, body, tokens, first=firsts), bodies))
    wall = time.perf_counter() - started
    return {"tokens_per_s": sum(chunks) / wall, "wall_s": round(wall, 3),
            "ttft_median_s": round(statistics.median(firsts) - started, 3), "ttft_last_s": round(max(firsts) - started, 3)}


def burst_rounds(urls: dict[str, str], tokenizer: Any, rounds: int) -> dict[str, Any]:
    """A warm-up burst on each server, then ``rounds`` bursts of fresh prompts (the same prompts for
    both), the first server alternating; the ratio is the median of the rounds' patched / stock."""
    warm = burst_bodies(tokenizer, 16, 700)
    for url in urls.values():
        burst(url, warm, 128)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in urls}
    for r in range(rounds):
        bodies = burst_bodies(tokenizer, 16, 900 + 100 * r)
        for side in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
            runs[side].append(burst(urls[side], bodies, 128))
        print(f"burst round {r}: " + ", ".join(f"{side} {runs[side][-1]}" for side in urls), flush=True)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["patched"], runs["stock"])]
    return {"runs": runs, "round_ratios": ratios, "ratio": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> int:
    parser = parser_8b(__doc__, "akv_decode_bench.json")
    parser.add_argument("--live", default=os.environ.get("AKV_DECODE_LIVE", "32768 131072"),
                        help="live lengths (default: $AKV_DECODE_LIVE, else '32768 131072')")
    parser.add_argument("--batches", default=os.environ.get("AKV_DECODE_BATCHES", "1 8 16"),
                        help="batch sizes (default: $AKV_DECODE_BATCHES, else '1 8 16')")
    parser.add_argument("--lines", type=int, default=int(os.environ.get("AKV_DECODE_LINES", "4")),
                        help="decode log lines (20 steps each) at exactly B per measurement")
    parser.add_argument("--bursts", type=int, default=int(os.environ.get("AKV_DECODE_BURSTS", "6")),
                        help="plain-burst rounds after the first live length (with --live '': the only measurement)")
    parser.add_argument("--backend", choices=ATTENTION_BACKENDS, default=os.environ.get("AKV_DECODE_BACKEND", "flashinfer"),
                        help="both servers' attention backend (default: $AKV_DECODE_BACKEND, else flashinfer)")
    args = parser.parse_args(argv)
    flags = with_backend(COMMON, args.backend)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run.sh's deadline: still write what was measured
    from transformers import AutoTokenizer  # here: --help needs no transformers

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    batches = [int(b) for b in args.batches.split()]
    lives = [int(x) for x in args.live.split()]
    launchers = {"patched": ("akv.system.launch_server", dict(os.environ)),
                 "stock": ("sglang.launch_server", {**os.environ, "PYTHONPATH": str(args.stock_site)})}
    running: dict[str, Server] = {}
    report: dict[str, Any] = {**results.header("bench/akv_decode_bench.py", argv), "server_args": flags, "pools": POOLS,
                              "goal_ratio": GOAL_RATIO, "burst_goal": BURST_GOAL,
                              "floor_us_per_1k_live_tokens": FLOOR_US_PER_1K,
                              "startup_s": {}, "warm_s": {}, "runs": {}}
    cases: dict[int, tuple[dict[str, Any], dict[str, Any], int, int]] = {}
    started = time.time()

    def save() -> None:
        report["total_s"] = round(time.time() - started, 1)
        results.write(report, args.out, indent=2, copy_to_out=True)

    def start(side: str, port: int) -> Server:
        module, side_env = launchers[side]
        return servers.launch(side, module, args.model, [*flags, *POOLS[side]], side_env, port,
                              args.out.parent / f"server-decode-{side}.log")

    def warm(side: str) -> None:
        stream(running[side].url, burst_bodies(tokenizer, 1, 800)[0], 4)  # a server's first plain chat costs ~10 s once
        for live, (akv_body, stock_body, _, _) in cases.items():
            t0 = time.perf_counter()
            stream(running[side].url, akv_body if side == "patched" else stock_body, 4)
            report["warm_s"][f"{side}/{live}"] = round(time.perf_counter() - t0, 1)
            print(f"{side}: warm {live} in {report['warm_s'][f'{side}/{live}']} s", flush=True)

    try:
        running["patched"] = start("patched", 30020)
        servers.unpack_stock_site(args.stock_site)
        running["stock"] = start("stock", 30021)
        cases.update({live: case(tokenizer, live, 500 + i) for i, live in enumerate(lives)})
        report["cases"] = {str(live): {"live_prompt_tokens": c[2], "all_prompt_tokens": c[3]} for live, c in cases.items()}
        for side in running:
            running[side].wait(480)
            report["startup_s"][side] = round(time.time() - started, 1)
        with ThreadPoolExecutor(2) as pool:  # untimed prefills, both servers at once
            list(pool.map(warm, running))
        save()

        def decode(live: int) -> None:
            akv_body, stock_body, _, n_all = cases[live]
            for batch in batches:
                for side, body in (("patched", akv_body), ("stock", stock_body)):
                    key = f"{live}/{batch}/{side}"
                    try:
                        report["runs"][key] = measure(running[side], body, batch, CONTEXT - n_all - 256, args.lines,
                                                      timeout=120)
                    except Exception as exc:  # noqa: BLE001 - keep the other measurements
                        report["runs"][key] = {"error": f"{type(exc).__name__}: {exc}"}
                    print(key, report["runs"][key], flush=True)
                    save()

        if lives:
            decode(lives[0])
        report["plain_burst"] = burst_rounds({side: running[side].url for side in running}, tokenizer, args.bursts)
        save()
        for live in lives[1:]:
            decode(live)
    finally:
        for server in running.values():
            server.stop()
        ratios = {}
        for live, (_, _, n_live, _) in cases.items():
            for batch in batches:
                mine = report["runs"].get(f"{live}/{batch}/patched", {}).get("step_ms")
                base = report["runs"].get(f"{live}/{batch}/stock", {}).get("step_ms")
                ratios[f"{live}/{batch}"] = {"ratio": mine / base if mine and base else None,
                                             "patched_ms": mine, "stock_ms": base,
                                             "attention_floor_ms": batch * n_live / 1000 * FLOOR_US_PER_1K / 1000}
        report["ratios"] = ratios
        if "plain_burst" in report:
            report["plain_burst_ratio"] = report["plain_burst"]["ratio"]
        save()
        print(json.dumps({k: report.get(k) for k in ("ratios", "plain_burst_ratio")}), flush=True)
    ok = all(r["ratio"] is not None for r in ratios.values()) and "plain_burst_ratio" in report
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
