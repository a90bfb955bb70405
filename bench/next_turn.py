"""Next-turn time to first token of an agent conversation: AKV vs its floor vs the trimmed text.

For each size (tool-result steps of about ``--result-tokens`` tokens: 29 steps is the 33k-token
conversation of issue #29, 113 steps about 128k) and each trial (a fresh system message, so nothing
is shared across trials): the patched server prefills the conversation's turn; its next turn (one
more tool call and result) then drops the first half of the tool results and repositions at the
new message (``drop_message`` + ``reposition``), timed with one output token. On stock SGLang the
same next turn without the dropped results is served twice: the *floor* (its prefix without the new
tool call and result resident first, so only the new tokens are prefilled over a resident prefix of
the live length), then, after ``/flush_cache``, the *trimmed text* re-prefilled cold. The server's
counters, read before and after each AKV request (``bench.harness.client.prefill_breakdown``), say
where its server time went: admission (match, plan, lock, commit), queue wait, prefill forwards
(``forwards``, their device time ``forward_ms`` and the re-rotation copies' ``copy_ms`` inside it),
the host time building their metadata (``host_ms``), the span between its first and last prefill
round (``rounds_ms``, 0 in one pass), and the kernel specializations first launched during it (0 when
the warm-up compiled everything); ``other_ms`` is the request's time outside its wait (which holds
admission's match and plan), host and forward time: HTTP, template render and compile, tokenization,
commit, scheduling steps, publication (before SGLang answers a one-token request), result processing.
The first trial of the first size is the server's first context request; the report has it beside
the median of the trials after it.

H200 (one device call, carry [".devkit"]; Qwen3-8B shape, dummy weights, FlashInfer, CUDA graphs):
    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH="bench/next_turn.py" DEADLINE_S=540 \\
        bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
writes ``$AKV_BENCH_OUT/next_turn.json`` (and a copy in ``$OUT``) after every trial.

CPU smoke (``--dry-run``): the tiny random Qwen3 on the patched CPU server, which also serves the
floor and the trimmed text (its plain path); one small size, two trials, no tools in the requests and
tool results cut to 40 characters.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from bench.akv_8b_check import chat  # noqa: E402
from bench.akv_decode_bench import COMMON, POOLS  # noqa: E402
from bench.harness import client, results, servers  # noqa: E402
from bench.harness.conversations import Conversation  # noqa: E402
from bench.harness.servers import Server  # noqa: E402

OUTSIDE = ("wait_ms", "host_ms", "forward_ms")
"""The breakdown fields ``other_ms`` subtracts from the request's time (they do not overlap; admission's
match and plan run while the request waits, so inside ``wait_ms``, its lock and commit after it)."""
GOAL_VS_FLOOR = 1.5
GOAL_FIRST_VS_MEDIAN = 1.5
CPU_FLAGS = [*servers.cpu_flags(8192, warmup=True), "--enable-metrics"]
"""SGLang's warm-up kept: it is what launches AKV's kernels before the server reports ready."""


def trial(patched: Server, stock: Server, base: list[dict[str, Any]], new: list[dict[str, Any]],
          seed: int, fields: dict[str, Any]) -> dict[str, Any]:
    """One next turn: ``base`` (the turn, system message first) followed by ``new`` (the tool call
    and result that make the next turn), with a fresh system message; ``fields`` go in every request."""
    turn = [{"role": "system", "content": f"Trial {seed}: follow chains of records with read_record."}, *base[1:]]
    nxt = turn + new
    anchor = len(nxt) - 1
    results = [i for i, m in enumerate(turn) if m["role"] == "tool"]
    dropped = results[: len(results) // 2]
    chat(patched, {"messages": turn, **fields}, 1)
    before = client.akv_counters(patched.url)
    akv = chat(patched, {"messages": nxt, **fields, "drop_message": {str(anchor): dropped}, "reposition": [anchor]}, 1)
    breakdown = client.prefill_breakdown(before, client.akv_counters_after(patched.url, before))
    live = [m for i, m in enumerate(nxt) if i not in dropped]
    chat(stock, {"messages": live[: -len(new)], **fields}, 1)
    floor = chat(stock, {"messages": live, **fields}, 1)
    if client.flush_cache(stock.url) != 200:
        raise RuntimeError(f"{stock.url}/flush_cache refused: the trimmed text would not be prefilled cold")
    trimmed = chat(stock, {"messages": live, **fields}, 1)
    return {"prompt_tokens": akv["usage"]["prompt_tokens"], "live_tokens": trimmed["usage"]["prompt_tokens"],
            "akv_s": akv["seconds"], "floor_s": floor["seconds"], "trimmed_text_s": trimmed["seconds"], **breakdown,
            "other_ms": round(1e3 * akv["seconds"] - sum(breakdown[k] for k in OUTSIDE), 3),
            "akv_usage": akv["usage"].get("prompt_tokens_details"),
            "floor_cached_tokens": (floor["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")}


def summary(trials: list[dict[str, Any]], first_is_servers_first: bool) -> dict[str, Any]:
    """Medians over the trials after the first, their ratios, and the first trial beside them."""
    rest = trials[1:] or trials
    med = {k: statistics.median(t[k] for t in rest) for k in ("akv_s", "floor_s", "trimmed_text_s", "forwards",
                                                               *client.BREAKDOWN_MS, "other_ms")}
    out = {"trials": len(trials), "median_after_first": med, "akv_vs_floor": med["akv_s"] / med["floor_s"],
           "trimmed_vs_akv": med["trimmed_text_s"] / med["akv_s"], "first": trials[0],
           "first_vs_median": trials[0]["akv_s"] / med["akv_s"],
           "kernel_first_launches": sum(t["kernel_first_launches"] for t in trials)}
    out["ok"] = out["akv_vs_floor"] <= GOAL_VS_FLOOR and (
        not first_is_servers_first or out["first_vs_median"] <= GOAL_FIRST_VS_MEDIAN)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(None, __doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny model, small sizes, one patched server")
    p.add_argument("--model", type=Path, default=os.environ.get("AKV_MODEL_8B"),
                   help="the 8B-shaped model folder (default: $AKV_MODEL_8B; --dry-run makes a tiny one)")
    p.add_argument("--steps", default=os.environ.get("AKV_NEXT_TURN_STEPS", "29 113"),
                   help="tool-result steps per size (29: ~33k tokens, 113: ~128k; default: $AKV_NEXT_TURN_STEPS "
                        "or '29 113')")
    p.add_argument("--result-tokens", type=int, default=800, help="tokens of each tool result")
    p.add_argument("--trials", type=int, default=int(os.environ.get("AKV_NEXT_TURN_TRIALS", "10")),
                   help="trials per size after its first (default: $AKV_NEXT_TURN_TRIALS or 10)")
    p.add_argument("--deadline-s", type=float, default=420.0,
                   help="no new trial starts this many seconds after the start (run.sh stops a bench at 540 s in all)")
    p.add_argument("--stock-site", type=Path, default=servers.stock_site_default(),
                   help="where the stock SGLang site is unpacked on the GPU node (default: $AKV_STOCK_SITE, which "
                        "tools/gpu/run.sh sets, else build/stock-site)")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "akv-next-turn", help="models and CPU sites are made here")
    p.add_argument("--out", type=cli.new_file, default=str(Path(os.environ.get("AKV_BENCH_OUT", ".")) / "next_turn.json"),
                   help="a new JSON file, rewritten after every trial (default: $AKV_BENCH_OUT/next_turn.json)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.steps, args.result_tokens, args.trials, args.deadline_s = "2", 8, 1, 3600.0
    return args


def start_servers(args: argparse.Namespace) -> tuple[Server, Server]:
    """The patched server (and stock; the same server in a dry run), started together."""
    logs = args.out.parent
    if args.dry_run:
        from akv.system.models.tiny import make_tiny_model

        args.model = make_tiny_model(args.work / "tiny-qwen3", seed=3)
        site = servers.cpu_pythonpath(servers.cpu_patched_site(args.work))
        patched = servers.launch("patched", "akv.system.launch_server", args.model, CPU_FLAGS,
                                 {**os.environ, "PYTHONPATH": site}, servers.free_port(),
                                 logs / "server-next-turn-patched.log")
        return patched, patched
    servers.unpack_stock_site(args.stock_site)
    patched = servers.launch("patched", "akv.system.launch_server", args.model,
                             [*COMMON, *POOLS["patched"], "--enable-metrics"], dict(os.environ), 30020,
                             logs / "server-next-turn-patched.log")
    stock = servers.launch("stock", "sglang.launch_server", args.model, [*COMMON, *POOLS["stock"]],
                           {**os.environ, "PYTHONPATH": str(args.stock_site)}, 30021, logs / "server-next-turn-stock.log")
    return patched, stock


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run.sh's timeout: stop the servers, keep the report
    args = parse_args(argv)
    started = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    patched, stock = start_servers(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    report: dict[str, Any] = {**results.header("bench/next_turn.py", argv),
                              "server_args": CPU_FLAGS if args.dry_run else COMMON, "sizes": {}}
    ok = True
    try:
        patched.wait(600)
        if stock is not patched:
            stock.wait(600)
        report["startup_s"] = round(time.time() - started, 1)
        ready = client.akv_counters(patched.url)
        report["kernel_first_launches_at_ready"] = ready.get("kernel_first_launches", 0.0)
        fields = {"tools": None} if args.dry_run else {}  # the tiny model's CPU prefill: no tools block
        for index, steps in enumerate(int(s) for s in args.steps.split()):
            conv = Conversation(tokenizer, 0, args.result_tokens)
            for _ in range(steps + 1):
                conv.step()
            if args.dry_run:  # the tiny model's CPU prefill: tool results of a few words
                conv.messages = [dict(m, content=m["content"][:40]) if m["role"] == "tool" else m for m in conv.messages]
            base, new = conv.messages[:-2], conv.messages[-2:]
            rows: list[dict[str, Any]] = []
            for seed in range(args.trials + 1):
                if rows and time.time() - started > args.deadline_s:
                    report["sizes"][str(steps)]["cut_by_deadline"] = True
                    break
                rows.append(trial(patched, stock, base, new, 1000 * (index + 1) + seed, fields))
                print(f"steps {steps} trial {seed}", json.dumps(rows[-1]), flush=True)
                report["sizes"][str(steps)] = {"rows": rows, **summary(rows, index == 0)}
                results.write(report, args.out, indent=2, copy_to_out=True)
            ok = ok and report["sizes"][str(steps)]["ok"]
    except Exception as exc:  # noqa: BLE001 - the report says what stopped the run
        report["error"] = repr(exc)[-2000:]  # a failed request's message holds the server's answer
        print(f"next_turn: stopped: {report['error']}", file=sys.stderr, flush=True)
        ok = False
    finally:
        patched.stop()
        if stock is not patched:
            stock.stop()
        report["total_s"] = round(time.time() - started, 1)
        report["ok"] = ok
        results.write(report, args.out, indent=2, copy_to_out=True)
    print(json.dumps({k: {m: v.get(m) for m in ("akv_vs_floor", "first_vs_median", "ok")}
                      for k, v in report["sizes"].items()}), flush=True)
    return 0 if ok or args.dry_run and "error" not in report else 1


if __name__ == "__main__":
    sys.exit(main())
