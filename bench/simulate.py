"""Offline policy cost simulator: replay trajectories through each method over the cache core and
report per call and in total the tokens prefilled, read from cache, re-rotated, skipped by drops and
generated, and their cost under a price table.

    python bench/simulate.py [--trajectories FILE.jsonl | --demo-run runs/NAME ... | --count 4 --seed 0]
        [--standard-threshold 96000] [--te-threshold 48000] [--summary-tokens 2000] [--trim-keep 12]
        [--akv-keep 12] [--akv-reposition-tokens 96000] [--price-input 1.25 --price-cached 0.125 --price-output 10]
        --out bench/results/simulate.json

Writes the JSON (with the exact command; totals overall and per trajectory), the per-call counts as
column arrays (.calls.json), a markdown table (.md), and two SVG plots (.calls.svg: live tokens and cumulative cost per call of the first
trajectory; .totals.svg: cost per method, split into prefill, cache reads and output).

With ``--concurrency C ...`` it plays instead the serving replay's load on one server's pool
(:func:`bench.agent_replay.simulator.simulate_shared`): C conversations of the ``--preset``
trajectories from ``--start-turn``, C requests in flight on ``--pool-slots`` slots, AKV re-rotating
in place as the patched server does (``--copies``: every re-rotation a copy, as before in-place
re-rotation; ``--protect-live``: an admission that waits rather than evict KV a conversation still
reads, which the server does not have); per method and C, the tokens prefilled, read and
re-rotated, the waits for room, the conversations refused and the pool's peak; the live KV each reply
attends to (mean and max: what a decode step reads beside the weights), in the JSON and the markdown
table (per call)::

    python bench/simulate.py --preset browse --count 8 --start-turn 12 --pool-slots 600000 \
        --concurrency 4 8 16 --out bench/results/simulate-shared-browse.json"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from akv import cli  # noqa: E402
from akv.agent import ApproximateTokenCounter  # noqa: E402
from akv.agent import live_budget_policy  # noqa: E402
from bench.agent_replay.methods import AKV, FullContext, Summarize, Trim, reference_policy  # noqa: E402
from bench.agent_replay.plots import line_panels, stacked_bars  # noqa: E402
from bench.agent_replay.simulator import (  # noqa: E402
    COUNTS, DEFAULT_POOL_SLOTS, CallRow, PriceTable, run_all, simulate_shared, totals)
from bench.agent_replay.trajectories import (  # noqa: E402
    PRESETS, Trajectory, default_set, generate, load_demo_run, load_jsonl)
from bench.harness import results  # noqa: E402

BASELINE = "standard"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--trajectories", type=Path, help="JSONL of per-message token counts")
    p.add_argument("--demo-run", type=Path, action="append", help="a demo run folder (runs/NAME); repeatable")
    p.add_argument("--tokenizer", type=Path, help="model folder whose chat template counts demo-run messages "
                                                  "(default: akv.agent.ApproximateTokenCounter)")
    p.add_argument("--count", type=int, default=4, help="synthetic trajectories per preset (swe, browse)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--standard-threshold", type=int, default=96_000)
    p.add_argument("--te-threshold", type=int, default=48_000)
    p.add_argument("--summary-tokens", type=int, default=2_000)
    p.add_argument("--trim-keep", type=int, default=12)
    p.add_argument("--akv-keep", type=int, default=12)
    p.add_argument("--akv-reposition-tokens", type=int, default=96_000,
                   help="akv_keepK compacts positions once the next free position exceeds this")
    p.add_argument("--price-input", type=float, default=PriceTable.input)
    p.add_argument("--price-cached", type=float, default=PriceTable.cached_input)
    p.add_argument("--price-output", type=float, default=PriceTable.output)
    p.add_argument("--pool-slots", type=int, default=DEFAULT_POOL_SLOTS)
    p.add_argument("--preset", choices=sorted(PRESETS), help="only this preset's synthetic trajectories")
    p.add_argument("--concurrency", type=int, nargs="+", help="play the serving replay's load (module docstring)")
    p.add_argument("--start-turn", type=int, default=0, help="with --concurrency: the turn each conversation starts at")
    p.add_argument("--copies", action="store_true", help="with --concurrency: AKV copies every re-rotated key")
    p.add_argument("--protect-live", action="store_true",
                   help="with --concurrency: a request waits rather than evict KV a conversation still reads")
    p.add_argument("--methods", nargs="+", help="only these methods (by name; default: all)")
    p.add_argument("--live-budget", type=int, default=96_000,
                   help="with --concurrency: the live-token budget of akv_live_budget (a method of that mode only)")
    p.add_argument("--out", type=cli.new_file, required=True)
    args = p.parse_args(argv)
    for flag, value, least in (("--concurrency", min(args.concurrency or [1]), 1), ("--pool-slots", args.pool_slots, 1),
                               ("--start-turn", args.start_turn, 0), ("--count", args.count, 1)):
        if value < least:
            p.error(f"{flag}: {value} is less than {least}")
    names = [m.name for m in methods(args)] + (["akv_live_budget"] if args.concurrency else [])
    unknown = sorted(set(args.methods or ()) - set(names))
    if unknown:
        p.error(f"--methods: {unknown[0]!r} is not one of {', '.join(names)}")
    return args


def load(args: argparse.Namespace) -> list[Trajectory]:
    if args.trajectories:
        return load_jsonl(args.trajectories)
    if args.demo_run:
        if args.tokenizer:
            from akv.agent.tokens import ChatTemplateTokenCounter

            counter: Any = ChatTemplateTokenCounter.from_pretrained(str(args.tokenizer))
        else:
            counter = ApproximateTokenCounter()
        return [load_demo_run(run, counter) for run in args.demo_run]
    if args.preset:
        return [generate(PRESETS[args.preset], args.seed * 1000 + k, f"{args.preset}-{args.seed * 1000 + k}")
                for k in range(args.count)]
    return default_set(args.count, args.seed)


def methods(args: argparse.Namespace) -> list[Any]:
    s = args.summary_tokens
    return [FullContext(), Summarize(args.standard_threshold, s, name="standard"),
            Summarize(args.te_threshold, s, name="text_engineering"), Trim(args.trim_keep, name="trim"),
            AKV(reference_policy(args.akv_keep, args.akv_reposition_tokens), name=f"akv_keep{args.akv_keep}"),
            AKV(reference_policy(args.akv_keep), name=f"akv_keep{args.akv_keep}_every_turn")]


def shared(args: argparse.Namespace, head: dict[str, Any], trajectories: list[Trajectory], chosen: list[Any],
           prices: PriceTable) -> int:
    """``--concurrency``: the serving replay's load on one pool, per method and concurrency."""
    rows = []
    for level in args.concurrency:
        for method in chosen:
            started = time.monotonic()
            run = simulate_shared(trajectories, method, level, args.pool_slots, args.start_turn,
                                  in_place=not args.copies, prices=prices, protect_live=args.protect_live)
            total = totals(run.rows, prices)
            row = {"method": method.name, "concurrency": level, "calls": total["calls"],
                   **{k: total[k] for k in ("prompt", "prefilled", "cached", "repos", "generated", "max_live")},
                   "mean_live": round(sum(r.live for r in run.rows) / max(1, len(run.rows))),
                   "waits": run.waits, "refused": run.refused, "peak_pool_used": run.peak_pool_used,
                   "seconds": round(time.monotonic() - started, 1)}
            rows.append(row)
            print(f"c={level:<3d} {method.name:>22}: {row['calls']:4d} calls, {row['prefilled']:>11,} prefilled, "
                  f"{row['cached'] + row['repos']:>12,} read, {row['waits']} waits, {len(row['refused'])} refused",
                  flush=True)
    head_cells = ("method", "conc.", "calls", "prefilled per call", "read per call", "mean live", "max live",
                  "waits", "refused", "pool peak")
    table = results.markdown_table(head_cells, (
        [r["method"], str(r["concurrency"]), str(r["calls"]), f"{r['prefilled'] // max(1, r['calls']):,}",
         f"{(r['cached'] + r['repos']) // max(1, r['calls']):,}", f"{r['mean_live']:,}", f"{r['max_live']:,}",
         str(r["waits"]), str(len(r["refused"])), f"{r['peak_pool_used']:,}"] for r in rows))
    results.write({**head, "mode": "shared", "pool_slots": args.pool_slots, "start_turn": args.start_turn,
                   "in_place": not args.copies, "protect_live": args.protect_live,
                   "trajectories": [t.stats() for t in trajectories], "rows": rows},
                  args.out)
    args.out.with_suffix(".md").write_text(f"`{head['command']}`\n\n{table}", encoding="utf-8")
    print(table)
    return 0


def report(rows: list[CallRow], trajectories: list[Trajectory], names: list[str], prices: PriceTable) -> dict[str, Any]:
    overall = {m: totals([r for r in rows if r.method == m], prices) for m in names}
    base = overall.get(BASELINE)
    for m, total in overall.items():
        total["saving_vs_standard"] = 1 - total["cost"] / base["cost"] if base and base["cost"] else None
    per_trajectory = {}
    per_call = {}
    for t in trajectories:
        per_trajectory[t.name] = {}
        per_call[t.name] = {}
        for m in names:
            mine = [r for r in rows if r.trajectory == t.name and r.method == m]
            per_trajectory[t.name][m] = totals(mine, prices)
            per_call[t.name][m] = {k: [getattr(r, k) for r in mine] for k in ("turn", "kind", *COUNTS, "live", "pool_used")}
    return {"totals": overall, "per_trajectory": per_trajectory, "per_call": per_call}


def _versus(saving: float | None) -> str:
    if saving is None:
        return "-"
    if saving == 0:
        return "0"
    return f"{abs(saving):.1%} " + ("cheaper" if saving > 0 else "dearer")


def markdown(overall: dict[str, dict[str, Any]]) -> str:
    head = ("method", "calls", "prefilled", "cached", "re-rotated", "skipped", "generated", "max live", "max KV slots",
            "cost $", "vs standard", "cache-read share", "prefill share", "output share")
    return results.markdown_table(head, (
        [m, str(t["calls"]), *(f"{t[k]:,}" for k in ("prefilled", "cached", "repos", "skipped", "generated",
                                                     "max_live", "max_pool_used")),
         f"{t['cost']:.3f}", _versus(t["saving_vs_standard"]),
         f"{t['cache_read_share']:.1%}", f"{t['prefill_share']:.1%}", f"{t['output_share']:.1%}"]
        for m, t in overall.items()))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    head = results.header("bench/simulate.py", argv)
    command = head["command"]
    prices = PriceTable(args.price_input, args.price_cached, args.price_output)
    trajectories = load(args)
    chosen = methods(args)
    if args.concurrency:
        chosen.append(AKV(lambda counter: live_budget_policy(args.live_budget, counter), name="akv_live_budget"))
    if args.methods:
        chosen = [m for m in chosen if m.name in args.methods]
    if args.concurrency:
        return shared(args, head, trajectories, chosen, prices)
    names = [m.name for m in chosen]
    print(f"{len(trajectories)} trajectories x {len(chosen)} methods", flush=True)
    started = time.monotonic()
    rows = run_all(trajectories, chosen, prices, args.pool_slots, progress=lambda s: print(s, flush=True))
    result = {**head, "prices_per_million": dataclasses.asdict(prices), "seconds": round(time.monotonic() - started, 1),
              "methods": names, "trajectories": [t.stats() for t in trajectories],
              **report(rows, trajectories, names, prices)}
    per_call = result.pop("per_call")
    results.write(result, args.out)
    args.out.with_suffix(".calls.json").write_text(json.dumps({"command": command, "per_call": per_call},
                                                              separators=(",", ":")) + "\n", encoding="utf-8")
    table = markdown(result["totals"])
    args.out.with_suffix(".md").write_text(f"`{command}`\n\n{table}", encoding="utf-8")
    first = trajectories[0].name
    calls = per_call[first]
    cumulative = {}
    for m in names:
        rows_m = [r for r in rows if r.trajectory == first and r.method == m]
        running, out = 0.0, []
        for r in rows_m:
            running += r.cost
            out.append(running)
        cumulative[m] = out
    args.out.with_suffix(".calls.svg").write_text(line_panels(
        [(f"{first}: KV entries the reply attends to, per call", {m: calls[m]["live"] for m in names}),
         (f"{first}: tokens prefilled per call", {m: calls[m]["prefilled"] for m in names}),
         (f"{first}: cumulative cost ($)", cumulative)], "request (summarization calls included)"), encoding="utf-8")
    bars = {m: {"prefill": t["cost"] * t["prefill_share"], "cache read": t["cost"] * t["cache_read_share"],
                "output": t["cost"] * t["output_share"]} for m, t in result["totals"].items()}
    args.out.with_suffix(".totals.svg").write_text(stacked_bars("Cost of the trajectory set by method", bars, "$"),
                                                   encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
