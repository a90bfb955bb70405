"""On the H200, a Qwen3-8B-shaped model with dummy weights (bf16, triton backend unless
``--backend`` names another): the patched server (``python -m akv.system.launch_server``) and stock
SGLang 0.5.16 on the same backend side by side in one run.

1. plain requests are token-identical on the patched and the stock server;
2. a 10-turn tool conversation with drops (akv.agent's ResultSelection) and repositions is served,
   each turn reporting cached / re-rotated / skipped tokens;
3. an exactly equivalent case: dropping the final two messages at their own anchor and
   repositioning there equals the plain prompt without them (same tokens, log-probs compared with
   the same plain prompt served again, the noise of a cached prefix);
4. next-turn TTFT of a 32k-token agent conversation after half its tool results are dropped and one
   new tool result arrives: AKV vs (a) the live text re-prefilled on stock vs (b) the floor, stock
   prefilling only the new tokens over a resident prefix of the live length.

Run by ``tools/gpu/run.sh`` as an ``AKV_BENCH`` script (the model from ``$AKV_MODEL_8B``, results to
``$AKV_BENCH_OUT/akv_8b_check.json``); stock SGLang is the carried site archive unpacked without the
AKV overlay (``--stock-site``, made on first use).

5. with ``--against BACKEND`` (``$AKV_8B_AGAINST``), once the stock server is stopped: the patched
   server on ``--backend`` against the patched server on BACKEND, both serving bench.harness.oracle's
   record-chain requests and the 10-turn conversation's payloads, BACKEND's replies the reference of
   ``oracle.verdict``: context requests' log-probs within 1.5x the largest plain-request difference
   between the two backends in the same run (their bf16 kernels differ), greedy tokens equal wherever
   BACKEND's top-2 margin exceeds that bound, usage equal.

FA3 against FlashInfer, in one device call, after the FA3 kernel tests of
``tests/sglang_patch/test_fa3_lists.py`` (carry [".devkit"]; ``--backend fa3`` for both servers of
checks 1-4; FA3 needs compute capability 8.x or 9.x; not yet run, so its time is an estimate: three
server starts of about a minute each plus the checks, 6-8 minutes)::

    set -o pipefail; PYTEST_ARGS="-m gpu tests/sglang_patch/test_fa3_lists.py" SKIP_SERVER=1 AKV_8B_BACKEND=fa3 AKV_8B_AGAINST=flashinfer AKV_BENCH="bench/akv_8b_check.py" DEADLINE_S=570 bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli  # noqa: E402
from akv.agent import CachePolicy, CacheOperationHistory, ResultSelection, TurnReposition, TurnTrigger  # noqa: E402
from akv.system.adapter.serving import ATTENTION_BACKENDS  # noqa: E402
from bench.harness import client, oracle, results, servers  # noqa: E402
from bench.harness.client import TOOLS, logprobs, tokens  # noqa: E402
from bench.harness.conversations import Conversation  # noqa: E402
from bench.harness.servers import Server  # noqa: E402

COMMON = ["--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend", "triton",
          "--page-size", "1", "--chunked-prefill-size", "8192",
          "--max-total-tokens", "150000", "--mem-fraction-static", "0.42", "--cuda-graph-max-bs", "8",
          "--enable-cache-report", "--sampling-backend", "pytorch", "--context-length", "40960"]


def chat(server: Server, body: dict[str, Any], max_tokens: int = 8) -> dict[str, Any]:
    """A greedy request with the record tool (top log-prob only), timed."""
    return server.chat({"tools": TOOLS, **body}, max_tokens, top_logprobs=1)


def plain_replies(server: Server, tokenizer: Any) -> list[dict[str, Any]]:
    """Greedy replies (16 tokens) to three plain tool conversations of 1, 4 and 8 steps."""
    replies = []
    for seed, turns in ((101, 1), (102, 4), (103, 8)):
        conv = Conversation(tokenizer, seed, 300)
        for _ in range(turns):
            conv.step()
        replies.append(chat(server, {"messages": conv.messages}, 16))
    return replies


def compare_plain(patched: list[dict[str, Any]], stock: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`plain_replies` of the patched and the stock server: tokens identical, log-prob gap."""
    rows = [{"prompt_tokens": a["usage"]["prompt_tokens"], "identical": tokens(a) == tokens(b),
             "max_logprob_diff": max(abs(x - y) for x, y in zip(logprobs(a), logprobs(b)))}
            for a, b in zip(patched, stock)]
    return {"rows": rows, "ok": all(r["identical"] for r in rows)}


def check_plain_identity(patched: Server, stock: Server, tokenizer: Any) -> dict[str, Any]:
    return compare_plain(plain_replies(patched, tokenizer), plain_replies(stock, tokenizer))


def ten_turn_payloads(tokenizer: Any) -> list[dict[str, Any]]:
    """The 10-turn tool conversation's requests as akv.agent's policy sends them (drops from turn 4,
    repositions every 3 turns from turn 3)."""
    policy = CachePolicy(trigger=TurnTrigger(), selector=ResultSelection(3), reposition=TurnReposition(after=3, every=3))
    conv, history, payloads = Conversation(tokenizer, 201, 400), None, []
    for _ in range(10):
        conv.step()
        payload, history = policy.process({"model": "default", "messages": list(conv.messages), "tools": TOOLS},
                                          history)
        history = CacheOperationHistory.from_json(history.to_json())
        payloads.append({k: v for k, v in payload.items() if k != "tools"})
    return payloads


def check_ten_turns(patched: Server, tokenizer: Any) -> dict[str, Any]:
    rows = []
    for payload in ten_turn_payloads(tokenizer):
        reply = chat(patched, payload)
        rows.append({"prompt_tokens": reply["usage"]["prompt_tokens"], "details": reply["usage"]["prompt_tokens_details"],
                     "seconds": round(reply["seconds"], 3), "drops": payload.get("drop_message"),
                     "reposition": payload.get("reposition")})
    context = [r["details"] or {} for r in rows if r["drops"] or r["reposition"]]
    ok = (bool(context) and all(set(d) >= {"cached_tokens", "repos_tokens", "drop_skipped_tokens"} for d in context)
          and any(d["repos_tokens"] > 0 for d in context) and any(d["drop_skipped_tokens"] > 0 for d in context))
    return {"rows": rows, "ok": ok}


def check_equivalence(patched: Server, tokenizer: Any) -> dict[str, Any]:
    conv = Conversation(tokenizer, 301, 500)
    for _ in range(3):
        conv.step()
    plain = conv.messages + [{"role": "user", "content": "Continue with the next record."}]
    conv.messages = list(plain)
    conv.step()
    last = len(conv.messages) - 1
    cold, warm = chat(patched, {"messages": plain}), chat(patched, {"messages": plain})
    dropped = chat(patched, {"messages": conv.messages, "drop_message": {str(last): [last - 1, last]},
                            "reposition": [last]})
    noise = max(abs(x - y) for x, y in zip(logprobs(cold), logprobs(warm)))
    diff = max(abs(x - y) for x, y in zip(logprobs(warm), logprobs(dropped)))
    return {"plain_prompt_tokens": warm["usage"]["prompt_tokens"], "dropped_usage": dropped["usage"],
            "tokens_equal": tokens(warm) == tokens(dropped), "logprob_diff_vs_warm_plain": diff,
            "noise_cold_vs_warm_plain": noise, "ok": tokens(warm) == tokens(dropped) and diff <= max(2 * noise, 1e-3)}


def check_against(patched: Server, other: Server, tokenizer: Any) -> dict[str, Any]:
    """The patched server on one backend against the patched server on another as the reference
    (bench.harness.oracle's verdict): the record-chain requests, then the 10-turn conversation, both
    caches flushed first (the same traffic then leaves the same KV resident on both)."""
    for server in (patched, other):
        status = client.flush_cache(server.url)
        if status != 200:
            raise RuntimeError(f"flush_cache on {server.url}: HTTP {status}")
    bodies = oracle.requests()
    for turn, payload in enumerate(ten_turn_payloads(tokenizer)):
        kind = "context" if payload.get("drop_message") or payload.get("reposition") else "plain"
        bodies.append((f"{kind}-ten-turns-{turn}", {**payload, "tools": TOOLS}))
    rows = oracle.serve_pairs(patched.url, other.url, bodies)
    verdict = oracle.verdict(rows)
    n_context = sum(name.startswith("context") for name in rows)
    return {"rows": rows, **verdict, "context_requests": n_context, "ok": not verdict["failures"] and n_context > 0}


def ttft_trial(patched: Server, stock: Server, tokenizer: Any, seed: int) -> dict[str, float]:
    conv = Conversation(tokenizer, seed, 800)
    for _ in range(29):
        conv.step()
    turn = list(conv.messages)
    results = [i for i, m in enumerate(turn) if m["role"] == "tool"]
    dropped = results[: len(results) // 2]
    conv.step()
    nxt = list(conv.messages)
    anchor = len(nxt) - 1
    chat(patched, {"messages": turn}, 1)
    akv = chat(patched, {"messages": nxt, "drop_message": {str(anchor): dropped}, "reposition": [anchor]}, 1)
    live = [m for i, m in enumerate(nxt) if i not in dropped]
    trimmed = chat(stock, {"messages": live}, 1)
    chat(stock, {"messages": live[:-2]}, 1)
    floor = chat(stock, {"messages": live}, 1)
    return {"prompt_tokens_full": akv["usage"]["prompt_tokens"], "live_prompt_tokens": trimmed["usage"]["prompt_tokens"],
            "akv_s": akv["seconds"], "trimmed_text_s": trimmed["seconds"], "floor_s": floor["seconds"],
            "akv_usage": akv["usage"]["prompt_tokens_details"], "floor_cached": floor["usage"]["prompt_tokens_details"]}


def with_backend(flags: list[str], backend: str) -> list[str]:
    """``flags`` with ``--attention-backend`` set to ``backend``."""
    at = flags.index("--attention-backend")
    return [*flags[: at + 1], backend, *flags[at + 2:]]


def parser_8b(doc: str, result: str) -> Any:
    """The command line shared by the 8B-shaped H200 scripts: model, stock site, result file."""
    parser = cli.parser(None, doc.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=os.environ.get("AKV_MODEL_8B"),
                        required=os.environ.get("AKV_MODEL_8B") is None,
                        help="the 8B-shaped model folder (default: $AKV_MODEL_8B)")
    parser.add_argument("--stock-site", type=Path, default=servers.stock_site_default(),
                        help="where the stock SGLang site is unpacked (default: $AKV_STOCK_SITE, which "
                             "tools/gpu/run.sh sets, else build/stock-site)")
    parser.add_argument("--out", type=cli.new_file, default=str(Path(os.environ.get("AKV_BENCH_OUT", ".")) / result),
                        help=f"a new JSON file (default: $AKV_BENCH_OUT/{result})")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = parser_8b(__doc__, "akv_8b_check.json")
    parser.add_argument("--trials", type=int, default=int(os.environ.get("AKV_TTFT_TRIALS", "3")),
                        help="TTFT trials (default: $AKV_TTFT_TRIALS, else 3)")
    parser.add_argument("--only-ttft", action="store_true", default=os.environ.get("AKV_ONLY_TTFT") == "1",
                        help="skip the checks (default: $AKV_ONLY_TTFT == 1)")
    parser.add_argument("--py-spy", default=os.environ.get("AKV_PY_SPY"),
                        help="py-spy binary: record the patched server's processes during the TTFT trials")
    parser.add_argument("--backend", choices=ATTENTION_BACKENDS, default=os.environ.get("AKV_8B_BACKEND", "triton"),
                        help="both servers' attention backend (default: $AKV_8B_BACKEND, else triton)")
    parser.add_argument("--against", choices=ATTENTION_BACKENDS, default=os.environ.get("AKV_8B_AGAINST") or None,
                        help="then check against the patched server on this backend (default: $AKV_8B_AGAINST)")
    args = parser.parse_args(argv)
    if args.against == args.backend:
        parser.error(f"--against {args.against} is --backend itself")
    servers.unpack_stock_site(args.stock_site)
    from transformers import AutoTokenizer  # here: --help needs no transformers

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    logs = args.out.parent
    flags = with_backend(COMMON, args.backend)
    patched = servers.launch("patched", "akv.system.launch_server", args.model, flags, dict(os.environ), 30010,
                             logs / "server-8b-patched.log")
    stock = servers.launch("stock", "sglang.launch_server", args.model, flags,
                           {**os.environ, "PYTHONPATH": str(args.stock_site)}, 30011, logs / "server-8b-stock.log")
    report: dict[str, Any] = {**results.header("bench/akv_8b_check.py", argv), "server_args": flags,
                              "backend": args.backend}
    started = time.time()
    try:
        patched.wait(420)
        stock.wait(420)
        report["startup_s"] = round(time.time() - started, 1)
        checks = () if args.only_ttft else (
            ("plain_identity", lambda: check_plain_identity(patched, stock, tokenizer)),
            ("ten_turns", lambda: check_ten_turns(patched, tokenizer)),
            ("equivalence", lambda: check_equivalence(patched, tokenizer)))
        for name, check in checks:
            try:
                report[name] = check()
            except Exception as exc:  # noqa: BLE001 - record and go on to the next check
                report[name] = {"ok": False, "error": repr(exc)}
            print(name, json.dumps(report[name])[:600], flush=True)
        trials = []
        spy = None
        if args.py_spy:
            spy = subprocess.Popen([args.py_spy, "record", "--pid", str(patched.process.pid), "--subprocesses",
                                    "--rate", "250", "--format", "raw", "--duration", str(12 * args.trials),
                                    "-o", str(args.out.parent / "ttft-py-spy.txt")])
        for seed in range(args.trials):
            trials.append(ttft_trial(patched, stock, tokenizer, 400 + seed))  # fresh text: nothing shared across trials
            print("ttft", json.dumps(trials[-1]), flush=True)
        if spy is not None:
            spy.wait(timeout=60)
        med = {k: statistics.median(t[k] for t in trials) for k in ("akv_s", "trimmed_text_s", "floor_s")}
        report["ttft"] = {"trials": trials, "median_s": med, "akv_vs_floor": med["akv_s"] / med["floor_s"],
                          "trimmed_vs_akv": med["trimmed_text_s"] / med["akv_s"], "goal_akv_vs_floor": 1.5}
        if args.against is not None:
            stock.stop()
            stock = servers.launch(f"patched-{args.against}", "akv.system.launch_server", args.model,
                                   with_backend(COMMON, args.against), dict(os.environ), 30011,
                                   logs / f"server-8b-patched-{args.against}.log")
            stock.wait(420)
            report["against"] = {"backend": args.against, **check_against(patched, stock, tokenizer)}
            print("against", json.dumps({k: v for k, v in report["against"].items() if k != "rows"}), flush=True)
    finally:
        patched.stop()
        stock.stop()
        report["total_s"] = round(time.time() - started, 1)
        results.write(report, args.out, indent=2)
    checked = ("plain_identity", "ten_turns", "equivalence") + (("against",) if args.against else ())
    ok = (args.only_ttft or all(report.get(k, {}).get("ok") for k in checked[:3])) and (
        args.against is None or report.get("against", {}).get("ok"))
    print(json.dumps({k: report[k].get("ok") for k in checked if k in report}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
