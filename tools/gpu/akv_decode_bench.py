"""On the H200: decode step time of agent requests whose context is half dropped, patched server vs
stock SGLang 0.5.16 serving a prompt of only the live tokens (Qwen3-8B-shaped dummy weights, bf16,
FlashInfer attention, decode CUDA graphs on; each server alone on the GPU, one after the other).

For each live length L: a tool conversation of about 2L tokens whose every other tool result is
dropped at the last message (``drop_message``, no reposition) on the patched server; the same
conversation without those results on stock. One request warms each server's cache, then B
identical requests decode together (B = 1, 8, 16), streaming ``--tokens`` x max(1, B / 4) tokens
each; the step time is B over the generation throughput SGLang logs for decode batches of exactly B
requests (median; the time over the window in which all B streams were decoding is kept beside it). Also
each server's plain-request output throughput on a burst of 16 distinct prompts, and the attention
floor at H200 bandwidth (about 30.7 us per 1K live tokens per request per step).

Run by ``tools/gpu/run.sh`` as an ``AKV_BENCH`` script; writes ``$AKV_BENCH_OUT/akv_decode_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from akv_8b_check import ROOT, TOOLS, Conversation, Server
from transformers import AutoTokenizer

FLOOR_US_PER_1K = 30.7
GOAL_RATIO = 1.10
COMMON = ["--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend", "flashinfer",
          "--page-size", "1", "--chunked-prefill-size", "16384", "--cuda-graph-max-bs", "16",
          "--disable-prefill-cuda-graph", "--enable-cache-report", "--context-length", "262144",
          "--max-running-requests", "64", "--max-total-tokens", "300000", "--mem-fraction-static", "0.85"]


def stream(url: str, body: dict[str, Any], tokens: int) -> list[float]:
    """Arrival times of one streamed request's output chunks (one per token at SGLang's default
    stream interval)."""
    full = {"model": "default", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "tools": TOOLS, **body}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(full).encode(),
                                     headers={"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(request, timeout=900) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"server error: {json.dumps(chunk)[:400]}")
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    if len(stamps) < tokens // 2:
        raise RuntimeError(f"stream gave {len(stamps)} chunks for {tokens} tokens")
    return stamps


def step_time_ms(runs: list[list[float]]) -> float | None:
    """Median time per decode step while all requests were decoding together: the window from the
    last request's first chunk to the first request's last one, divided by each request's chunks
    inside it (None when they never decoded together long enough)."""
    lo, hi = max(r[0] for r in runs), min(r[-1] for r in runs)
    per = [(hi - lo) / (sum(lo <= t <= hi for t in r) - 1) for r in runs if sum(lo <= t <= hi for t in r) > 8]
    return 1e3 * statistics.median(per) if per else None


_DECODE_LINE = re.compile(r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)")


def logged_step_ms(log: Path, offset: int, batch: int) -> float | None:
    """Median step time from the server's own decode log lines (one per 40 steps) written after
    ``offset`` with exactly ``batch`` requests running: ``batch`` / generation throughput."""
    steps = [1e3 * batch / float(m[2]) for m in _DECODE_LINE.finditer(log.read_text()[offset:])
             if int(m[1]) == batch and float(m[2]) > 0]
    return statistics.median(steps) if steps else None


def decode_runs(url: str, log: Path, body: dict[str, Any], batches: list[int], tokens: int) -> dict[str, Any]:
    started = time.perf_counter()
    stream(url, body, 4)
    out: dict[str, Any] = {"warm_s": time.perf_counter() - started}
    for b in batches:
        offset = len(log.read_text())
        n = tokens * max(1, b // 4)  # long enough for requests that arrive staggered to decode together
        with ThreadPoolExecutor(b) as pool:
            runs = list(pool.map(lambda _: stream(url, body, n), range(b)))
        out[str(b)] = {"step_ms": logged_step_ms(log, offset, b), "client_step_ms": step_time_ms(runs), "tokens": n}
        print(f"  B={b}: {out[str(b)]}", flush=True)
    return out


def case(tokenizer: Any, live: int, seed: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(patched body, stock body, live prompt tokens) for about ``2 * live`` tokens, every other tool
    result dropped."""
    conv = Conversation(tokenizer, seed, result_tokens=2000)
    conv.step()
    per_step = len(tokenizer(tokenizer.apply_chat_template(conv.messages, tokenize=False)).input_ids)
    for _ in range(2 * live // per_step - 1):
        conv.step()
    last = len(conv.messages) - 1
    results = [i for i, m in enumerate(conv.messages) if m["role"] == "tool" and i != last]
    dropped = results[::2]
    kept = [m for i, m in enumerate(conv.messages) if i not in set(dropped)]
    n_live = len(tokenizer(tokenizer.apply_chat_template(kept, tokenize=False)).input_ids)
    return {"messages": conv.messages, "drop_message": {str(last): dropped}}, {"messages": kept}, n_live


def burst(url: str, tokenizer: Any, n: int, tokens: int) -> float:
    """Output tokens per second over ``n`` distinct plain requests sent at once."""
    bodies = []
    for i in range(n):
        conv = Conversation(tokenizer, 900 + i, result_tokens=1500)
        conv.step()
        bodies.append({"messages": conv.messages})
    started = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda body: stream(url, body, tokens), bodies))
    return sum(map(len, runs)) / (time.perf_counter() - started)


def ratio(mine: dict[str, Any], base: dict[str, Any], live: int, batch: int) -> float | None:
    """Patched over stock step time (server-logged), None where either is missing."""
    a = mine.get(str(live), {}).get(str(batch), {}).get("step_ms")
    b = base.get(str(live), {}).get(str(batch), {}).get("step_ms")
    return a / b if a and b else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=os.environ.get("AKV_MODEL_8B"))
    parser.add_argument("--stock-site", type=Path, default=Path("/tmp/site-stock"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("AKV_BENCH_OUT", ".")) / "akv_decode_bench.json")
    parser.add_argument("--live", default=os.environ.get("AKV_DECODE_LIVE", "32768 131072"))
    parser.add_argument("--batches", default=os.environ.get("AKV_DECODE_BATCHES", "1 8 16"))
    parser.add_argument("--tokens", type=int, default=int(os.environ.get("AKV_DECODE_TOKENS", "256")))
    args = parser.parse_args()
    if not (args.stock_site / "sglang").is_dir():
        args.stock_site.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"xz -T0 -dc {ROOT / '.devkit' / 'site-py312.tar.xz'} | tar -x -C {args.stock_site}",
                       shell=True, check=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run.sh's deadline: still write what was measured
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    batches = [int(b) for b in args.batches.split()]
    lives = [int(x) for x in args.live.split()]
    cases = [case(tokenizer, live, 500 + i) for i, live in enumerate(lives)]
    sides = {
        "patched": ([sys.executable, "-m", "akv.system.launch_server"], {}),
        "stock": ([sys.executable, "-m", "sglang.launch_server"], {"PYTHONPATH": str(args.stock_site)}),
    }
    report: dict[str, Any] = {"command": " ".join(sys.argv), "server_args": COMMON, "goal_ratio": GOAL_RATIO,
                              "floor_us_per_1k_live_tokens": FLOOR_US_PER_1K, "sides": {}}
    started = time.time()
    try:
        for side, (launcher, extra_env) in sides.items():  # one at a time: each gets the whole GPU
            log = args.out.parent / f"server-decode-{side}.log"
            server = Server(side, [*launcher, "--model-path", str(args.model), *COMMON],
                            {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}, 30020, log)
            result: dict[str, Any] = {}
            try:
                server.wait(300)
                result["startup_s"] = round(time.time() - started, 1)
                for live, (akv_body, stock_body, n_live) in zip(lives, cases):
                    print(f"{side}: live {live} ({n_live} live prompt tokens)", flush=True)
                    result[str(live)] = decode_runs(server.url, log, akv_body if side == "patched" else stock_body,
                                                    batches, args.tokens)
                result["plain_burst_tokens_per_s"] = burst(server.url, tokenizer, 16, 128)
            except Exception as exc:  # noqa: BLE001 - keep what was measured
                result["error"] = f"{type(exc).__name__}: {exc}"
                print(side, result["error"], flush=True)
            finally:
                server.stop()
            report["sides"][side] = result
            args.out.write_text(json.dumps(report, indent=2))
        mine, base = report["sides"]["patched"], report["sides"]["stock"]
        report["cases"] = {
            str(live): {"live_prompt_tokens": n_live,
                        "ratio": {str(b): ratio(mine, base, live, b) for b in batches},
                        "attention_floor_ms": {str(b): b * n_live / 1000 * FLOOR_US_PER_1K / 1000 for b in batches}}
            for live, (_, _, n_live) in zip(lives, cases)}
        if "plain_burst_tokens_per_s" in mine and "plain_burst_tokens_per_s" in base:
            report["plain_burst_ratio"] = mine["plain_burst_tokens_per_s"] / base["plain_burst_tokens_per_s"]
        print(json.dumps({k: report.get(k) for k in ("cases", "plain_burst_ratio")}), flush=True)
    finally:
        report["total_s"] = round(time.time() - started, 1)
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if all("error" not in r for r in report["sides"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
