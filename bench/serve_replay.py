"""Replay agent trajectories against an OpenAI-compatible server over a concurrency sweep.

Each method (full, standard, text_engineering, trim: real re-prefills after text edits;
akv_keep12, akv_keep12_every_turn: drop_message/reposition from akv.agent, meaningful only on the
patched server; each row records whether the server reported AKV usage) replays `--conversations`
conversations (default: as many as the concurrency level) at each concurrency, every request with
`max_tokens` = the trajectory's output length and `ignore_eos`; the client appends the
trajectory's own assistant message, not the server's output. Every conversation of every run
starts with its own tag (a few filler tokens, counted), so no run reads another's KV even where
`POST /flush_cache` (sent before each run) is refused. Reports output and input throughput over
the run's wall time, P50/P95 request latency and TTFT, the served cached / re-rotated / skipped
tokens, KV pool usage sampled from `GET /metrics` (servers started with `--enable-metrics`) and, from
the patched server's counters, where its time per context request went (`akv_per_request`);
writes JSON (with the exact command) and a markdown table next to it (.md) after every run. A
request the server refuses (e.g. a full-context prompt past the window) ends its conversation and
counts as `failed`.

Every method on the H200 in one device call, stock SGLang for the text methods and the patched
server for AKV: `tools/gpu/replay_suite.sh` (it drives this module; `--dry-run` on CPU). By hand
against one server (stock SGLang 0.5.16, Qwen3-8B-shaped dummy weights, 131,072-token window;
`--start-turn 40 --max-turns 60` puts the default SWE-like set's full-context prompts at 56k-116k
tokens, where Standard (96k) summarizes and Text Engineering (48k) already has; each (method,
concurrency) run lasts about `--run-seconds` plus its longest request):

    python -m sglang.launch_server --model-path build/qwen3-8b --load-format dummy --attention-backend flashinfer \\
        --context-length 131072 --mem-fraction-static 0.85 --enable-cache-report --enable-metrics --port 30000 &
    python bench/serve_replay.py --url http://127.0.0.1:30000 --model-path build/qwen3-8b --preset swe --count 8 \\
        --start-turn 40 --max-turns 60 --run-seconds 90 --methods full,standard,text_engineering,trim \\
        --concurrency 1,4,8,16,32 --label "stock sglang 0.5.16, flashinfer" \\
        --out bench/results/serve_replay_stock_flashinfer.json

(the model folder: `tools/gpu/make_models.py --qwen3-8b` with `max_position_embeddings` set to
131072, as replay_suite.py writes it). Dry run on CPU against the loopback stand-in:

    python bench/serve_replay.py --loopback --count 1 --max-turns 6 --concurrency 1,2 --out build/replay-loopback.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from akv import cli  # noqa: E402
from akv.agent import ApproximateTokenCounter  # noqa: E402
from bench.agent_replay import loopback  # noqa: E402
from bench.agent_replay.chat import Filler, realize  # noqa: E402
from bench.agent_replay.methods import Method, default_methods  # noqa: E402
from bench.agent_replay.pool import PoolMonitor  # noqa: E402
from bench.agent_replay.serve import Sample, prepare, replay, sample_dicts, summarize  # noqa: E402
from bench.agent_replay.trajectories import PRESETS, Trajectory, generate, load_jsonl, truncate  # noqa: E402
from bench.harness import client, results  # noqa: E402

COLUMNS = (("method", "method"), ("concurrency", "conc."), ("requests", "requests"), ("failed", "failed"),
           ("output_tok_per_s", "output tok/s"), ("input_tok_per_s", "input tok/s"), ("cached_fraction", "cached"),
           ("latency_p50_s", "P50 latency s"), ("latency_p95_s", "P95 latency s"), ("ttft_p50_s", "P50 TTFT s"),
           ("ttft_p95_s", "P95 TTFT s"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--url", help="server base URL (http://host:port)")
    p.add_argument("--loopback", action="store_true", help="start the CPU loopback stand-in and replay against it")
    p.add_argument("--model", default="default", help="model name sent in each request")
    p.add_argument("--model-path", type=Path, help="folder with the served tokenizer and chat template (exact "
                                                   "token counts); default: akv.agent.ApproximateTokenCounter")
    p.add_argument("--reasoning-field", action="store_true", help="send reasoning as reasoning_content (templates "
                                                                  "that render it, e.g. Qwen3's)")
    p.add_argument("--trajectories", type=Path, help="JSONL of per-message token counts (default: synthetic)")
    p.add_argument("--preset", choices=sorted(PRESETS), action="append",
                   help="synthetic presets (default: swe and browse)")
    p.add_argument("--count", type=int, default=4, help="synthetic trajectories per preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-turns", type=int, help="cut each trajectory to its first N calls")
    p.add_argument("--turns", type=int, help="synthetic trajectories of exactly N tool-call turns (default: the "
                                             "preset's range); long ones carry the text past the context length")
    p.add_argument("--live-budget", type=int, default=96_000, help="akv_live_budget keeps the live length under "
                                                                   "this many tokens")
    p.add_argument("--start-turn", type=int, default=0, help="send only the requests from this turn on (the first "
                                                             "one prefills cold): measures deep in the trajectories")
    p.add_argument("--run-seconds", type=float, help="per (method, concurrency): start no request after this long")
    p.add_argument("--methods", default="full,standard,text_engineering,trim")
    p.add_argument("--concurrency", default="1,4,8,16,32")
    p.add_argument("--conversations", type=int, help="conversations per run (default: the concurrency level)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per socket operation")
    p.add_argument("--label", default="", help="what the server is (recorded in the results)")
    p.add_argument("--samples", action="store_true", help="also write every request's sample")
    p.add_argument("--standard-threshold", type=int, default=96_000, help="Standard summarizes past this many tokens")
    p.add_argument("--text-threshold", type=int, default=48_000, help="Text Engineering summarizes past this many")
    p.add_argument("--keep", type=int, default=12, help="tool results kept by trim and AKV (rows keep their "
                                                        "default names)")
    p.add_argument("--max-output-tokens", type=int, help="cap each request's fixed output length (quick runs)")
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send SGLang's ignore_eos (servers that "
                                                                 "refuse it, e.g. akv.system.reference_server)")
    p.add_argument("--run-tag", default=f"{time.time_ns()}", help="drawn into every conversation's tag (default: "
                                                                 "the start time), so that no run reuses another's KV")
    p.add_argument("--prime", action="store_true", help="send each conversation's first request unmeasured and "
                                                        "start the run once all are back (steady state)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each finished conversation")
    p.add_argument("--out", type=cli.new_file, required=True)
    args = p.parse_args(argv)
    if bool(args.url) == args.loopback:
        p.error("give exactly one of --url and --loopback")
    return args


def load_trajectories(args: argparse.Namespace) -> list[Trajectory]:
    if args.trajectories:
        found = load_jsonl(args.trajectories)
    else:
        found = [generate(PRESETS[name], args.seed * 1000 + k, f"{name}-{args.seed * 1000 + k}", args.turns)
                 for name in (args.preset or ["swe", "browse"]) for k in range(args.count)]
    return [truncate(t, args.max_turns) if args.max_turns else t for t in found]


def with_messages(trajectories: list[Trajectory], args: argparse.Namespace) -> tuple[list[Trajectory], Filler]:
    if args.model_path:
        from akv.agent.tokens import ChatTemplateTokenCounter

        counter: Any = ChatTemplateTokenCounter.from_pretrained(str(args.model_path))
        filler = Filler.for_tokenizer(counter.tokenizer)
    else:
        counter, filler = ApproximateTokenCounter(), Filler.for_approximate()
    out = []
    for t in trajectories:
        messages = realize(t, counter, filler, reasoning_field=args.reasoning_field)
        out.append(Trajectory(t.name, t.specs, t.generation_tokens, tuple(messages)))
    return out, filler


def flush(url: str) -> bool:
    """Whether the server flushed its cache (a stand-in without ``/flush_cache`` did not)."""
    try:
        return client.flush_cache(url.rstrip("/")) == 200
    except OSError:
        return False


def markdown(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    return results.markdown_table([h for _, h in COLUMNS], ([cell(row.get(key)) for key, _ in COLUMNS] for row in rows))


def run_one(url: str, trajectories: list[Trajectory], filler: Filler, method: Method, level: int,
            args: argparse.Namespace, run_tag: str, run_seconds: float | None,
            workers: Sequence[str] = ()) -> tuple[dict[str, Any], list[Sample]]:
    """One (method, concurrency) run on a flushed server: `args.conversations` (default `level`)
    conversations tagged with `run_tag`, KV pool usage sampled from /metrics while it runs;
    `total_s` includes the priming requests (`--prime`). With `workers` (the URLs of the servers
    behind a router at `url`), each worker is flushed, sampled and read for counters instead, and
    `worker_requests` gives the requests each one served during the run (its own counter)."""
    n = args.conversations or level
    conversations = [c for k in range(n) for c in prepare(trajectories[k % len(trajectories)], method, [k], filler,
                                                          args.start_turn, run_tag)]
    if args.max_output_tokens:
        conversations = [dataclasses.replace(c, requests=tuple(
            dataclasses.replace(r, generated=min(r.generated, args.max_output_tokens)) for r in c.requests))
            for c in conversations]
    servers = list(workers) or [url]
    flushed = all([flush(s) for s in servers])
    counters = [akv_counters(s) for s in servers]
    served = [served_requests(s) for s in workers]
    monitors = [PoolMonitor(s).start() for s in servers]
    progress = (lambda line: print(f"    {method.name} c={level}: {line}", flush=True)) if args.verbose else None
    began = time.monotonic()
    try:
        got, wall = replay(url, conversations, level, args.model, filler, args.timeout, run_seconds=run_seconds,
                           progress=progress, ignore_eos=not args.no_ignore_eos, prime=args.prime)
    finally:
        for monitor in monitors:
            monitor.stop()
    row = {"method": method.name, "concurrency": level, "conversations": n, "flushed": flushed, "primed": args.prime,
           "run_seconds": run_seconds, "total_s": time.monotonic() - began, **summarize(got, wall),
           **pool_summary([m.summary() for m in monitors])}
    if workers:
        row["worker_requests"] = [None if before is None or now is None else int(now - before)
                                  for before, now in zip(served, map(served_requests, workers))]
    after = summed([akv_counters(s) for s in servers]) if any(counters) else {}
    counters = summed(counters)
    requests = after.get("context_requests", 0.0) - counters.get("context_requests", 0.0)
    if requests > 0:  # the patched server's breakdown, per context request of the run (they overlap)
        row["akv_context_requests"] = int(requests)
        row["akv_per_request"] = client.prefill_breakdown(counters, after, requests)
    return row, got


def served_requests(url: str) -> float | None:
    """The requests a server has finished (SGLang's ``num_requests_total``; None without ``/metrics``)."""
    try:
        return client.read_metrics(url.rstrip("/")).get("num_requests_total")
    except OSError:
        return None


def summed(counters: list[dict[str, float]]) -> dict[str, float]:
    """Counters of several servers added up."""
    out: dict[str, float] = {}
    for one in counters:
        for name, value in one.items():
            out[name] = out.get(name, 0.0) + value
    return out


def pool_summary(summaries: list[dict[str, Any] | None]) -> dict[str, Any]:
    """One server's :meth:`PoolMonitor.summary`, or several servers' joined: the highest peak and the
    mean of the means of each gauge (each server's own pool)."""
    got = [s for s in summaries if s]
    if len(got) <= 1:
        return got[0] if got else {}
    out: dict[str, Any] = {"kv_samples": sum(s["kv_samples"] for s in got)}
    for key in {k for s in got for k in s if k != "kv_samples"}:
        values = [s[key] for s in got if key in s]
        out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
    return out


def akv_counters(url: str) -> dict[str, float]:
    """The patched server's AKV counters (none from a server without them, or without ``/metrics``)."""
    try:
        return client.akv_counters(url.rstrip("/"))
    except OSError:
        return {}


def progress_line(row: dict[str, Any]) -> str:
    return (f"{row['method']:>22} c={row['concurrency']:<3} {row['requests']:5d} requests ({row['failed']} failed) "
            f"in {row['wall_s']:8.1f} s: {row['output_tok_per_s'] or 0:9.1f} out tok/s, "
            f"{row['input_tok_per_s'] or 0:10.1f} in tok/s, P95 {row['latency_p95_s'] or 0:.2f} s, longest text "
            f"{row['longest_prompt_tokens']} tokens")


def choose_methods(names: str, args: argparse.Namespace) -> list[Method]:
    """The methods named in a comma-separated list (``none``: no method)."""
    methods = {m.name: m for m in default_methods(args.standard_threshold, args.text_threshold, args.keep,
                                                  args.live_budget)}
    chosen = [s.strip() for s in names.split(",") if s.strip() and s.strip() != "none"]
    unknown = [m for m in chosen if m not in methods]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {sorted(methods)}")
    return [methods[m] for m in chosen]


def write_results(out: Path, result: dict[str, Any]) -> None:
    results.write(result, out)
    out.with_suffix(".md").write_text(f"`{result['command']}`\n\n{result['label']}\n\n{markdown(result['rows'])}",
                                      encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = choose_methods(args.methods, args)
    levels = [int(c) for c in args.concurrency.split(",")]
    trajectories, filler = with_messages(load_trajectories(args), args)
    print(f"{len(trajectories)} trajectories ready; methods {[m.name for m in chosen]}; concurrency {levels}",
          flush=True)
    result: dict[str, Any] = {**results.header("bench/serve_replay.py", argv), "label": args.label,
                              "url": "loopback" if args.loopback else args.url, "run_tag": args.run_tag,
                              "trajectories": [t.stats() for t in trajectories], "rows": []}
    samples: dict[str, Any] = {}
    with ExitStack() as stack:
        state = loopback.Loopback() if args.loopback else None
        url = stack.enter_context(loopback.serve(state)) if state is not None else args.url
        for method in chosen:
            for level in levels:
                row, got = run_one(url, trajectories, filler, method, level, args,
                                   f"{args.run_tag}/{method.name}/{level}", args.run_seconds)
                result["rows"].append(row)
                if args.samples:
                    samples[f"{method.name}@{level}"] = sample_dicts(got)
                    result["samples"] = samples
                write_results(args.out, result)
                print(progress_line(row), flush=True)
    print(markdown(result["rows"]))
    failed = [row for row in result["rows"] if row["failed"]]
    for row in failed:
        print(f"{row['method']} c={row['concurrency']}: {row['failed']} requests failed; first: "
              f"{row['first_errors'][0]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
