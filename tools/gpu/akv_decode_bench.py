"""On the H200: decode step time of agent requests whose context is half dropped, patched server vs
stock SGLang 0.5.16 serving a prompt of only the live tokens, side by side in one run
(Qwen3-8B-shaped dummy weights, bf16, FlashInfer attention, decode CUDA graphs on).

For each live length L: a tool conversation of about 2L tokens whose every other tool result is
dropped at the last message (``drop_message``, no reposition) on the patched server; the same
conversation without those results on stock. One request warms each server's cache, then B
identical requests decode together (B = 1, 8, 16), streaming ``--tokens`` tokens each; the step time
is a request's time per output token after its first (median over the B requests). Also the
plain-request throughput of both servers on a burst of 16 distinct prompts, and the attention
floor at H200 bandwidth (about 30.7 us per 1K live tokens per request per step).

Run by ``tools/gpu/run.sh`` as an ``AKV_BENCH`` script; writes ``$AKV_BENCH_OUT/akv_decode_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
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
COMMON = ["--load-format", "dummy", "--dtype", "bfloat16", "--host", "127.0.0.1", "--attention-backend", "flashinfer",
          "--page-size", "1", "--chunked-prefill-size", "16384", "--cuda-graph-max-bs", "16",
          "--enable-cache-report", "--context-length", "262144", "--max-running-requests", "64"]


def stream(url: str, body: dict[str, Any], tokens: int) -> dict[str, float]:
    """Time to first token and time per output token after it, from one streamed request."""
    full = {"model": "default", "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "tools": TOOLS, **body}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(full).encode(),
                                     headers={"Content-Type": "application/json"})
    started, first, end, generated = time.perf_counter(), None, None, 0
    with urllib.request.urlopen(request, timeout=900) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                end, generated = time.perf_counter(), chunk["usage"]["completion_tokens"]
    if first is None or end is None or generated < 2:
        raise RuntimeError(f"stream gave no timing (first {first}, usage {generated})")
    return {"ttft_s": first - started, "tpot_ms": 1e3 * (end - first) / (generated - 1)}


def decode_runs(url: str, body: dict[str, Any], batches: list[int], tokens: int) -> dict[str, Any]:
    warm = stream(url, body, 4)
    out: dict[str, Any] = {"warm_ttft_s": warm["ttft_s"]}
    for b in batches:
        with ThreadPoolExecutor(b) as pool:
            runs = list(pool.map(lambda _: stream(url, body, tokens), range(b)))
        out[str(b)] = {"tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                       "tpot_ms_max": max(r["tpot_ms"] for r in runs)}
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
        list(pool.map(lambda body: stream(url, body, tokens), bodies))
    return n * tokens / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=os.environ.get("AKV_MODEL_8B"))
    parser.add_argument("--stock-site", type=Path, default=Path("/tmp/site-stock"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("AKV_BENCH_OUT", ".")) / "akv_decode_bench.json")
    parser.add_argument("--live", default=os.environ.get("AKV_DECODE_LIVE", "32768 131072"))
    parser.add_argument("--batches", default=os.environ.get("AKV_DECODE_BATCHES", "1 8 16"))
    parser.add_argument("--tokens", type=int, default=int(os.environ.get("AKV_DECODE_TOKENS", "128")))
    args = parser.parse_args()
    if not (args.stock_site / "sglang").is_dir():
        args.stock_site.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"xz -T0 -dc {ROOT / '.devkit' / 'site-py312.tar.xz'} | tar -x -C {args.stock_site}",
                       shell=True, check=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = args.out.parent
    patched = Server("patched", [sys.executable, "-m", "akv.system.launch_server", "--model-path", str(args.model),
                                 *COMMON, "--max-total-tokens", "300000", "--mem-fraction-static", "0.52"],
                     env, 30020, logs / "server-decode-patched.log")
    stock = Server("stock", [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model), *COMMON,
                             "--max-total-tokens", "150000", "--mem-fraction-static", "0.32"],
                   {**env, "PYTHONPATH": str(args.stock_site)}, 30021, logs / "server-decode-stock.log")
    batches = [int(b) for b in args.batches.split()]
    report: dict[str, Any] = {"command": " ".join(sys.argv), "server_args": COMMON, "goal_ratio": GOAL_RATIO,
                              "floor_us_per_1k_live_tokens": FLOOR_US_PER_1K, "cases": {}}
    started = time.time()
    try:
        patched.wait(480)
        stock.wait(480)
        report["startup_s"] = round(time.time() - started, 1)
        for i, live in enumerate(int(x) for x in args.live.split()):
            akv_body, stock_body, n_live = case(tokenizer, live, 500 + i)
            print(f"live {live}: {n_live} live prompt tokens", flush=True)
            print(" patched", flush=True)
            mine = decode_runs(patched.url, akv_body, batches, args.tokens)
            print(" stock", flush=True)
            base = decode_runs(stock.url, stock_body, batches, args.tokens)
            report["cases"][str(live)] = {
                "live_prompt_tokens": n_live, "patched": mine, "stock_live_only": base,
                "ratio": {b: mine[b]["tpot_ms"] / base[b]["tpot_ms"] for b in map(str, batches)},
                "attention_floor_ms": {b: int(b) * n_live / 1000 * FLOOR_US_PER_1K / 1000 for b in map(str, batches)},
            }
            print(json.dumps(report["cases"][str(live)]["ratio"]), flush=True)
        report["plain_burst_tokens_per_s"] = {"patched": burst(patched.url, tokenizer, 16, 256),
                                              "stock": burst(stock.url, tokenizer, 16, 256)}
        b = report["plain_burst_tokens_per_s"]
        b["ratio"] = b["patched"] / b["stock"]
        print("burst", json.dumps(b), flush=True)
    finally:
        patched.stop()
        stock.stop()
        report["total_s"] = round(time.time() - started, 1)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
