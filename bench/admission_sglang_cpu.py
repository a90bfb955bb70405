"""Context admission as SGLang's scheduler measures it (``AkvRequest.admission_s``: match, plan, lock,
commit), on the CPU, for the next turn of bench/next_turn.py (issue #29).

The real scheduler (``tests/sglang_cpu/scheduler_driver.py``) on the tiny random Qwen3 with its
attention stubbed (``stub_attention``: the interpreted kernels would take hours over 30k tokens;
admission depends on the tokens and events, not the model). Per trial, with a fresh first token: a
plain turn of a system message, a user message and STEPS tool calls and results (60, 40, 60 and 940
tokens, bench/cache_core.py's next-turn sizes), then its next turn (one more call and result) dropping
the first half of the results and repositioning at the new message. Reported per next turn: the
admission milliseconds of the scheduler's prefill log, and the cache core's ``match`` / ``commit``
calls during its wave. ``--beside-chunked N`` sends each next turn together with an N-token plain
prompt of another conversation, first in the queue, which SGLang prefills in chunks of
``--chunk`` tokens while the context request waits.

``--agent TURNS`` serves instead one live-budget agent turn after turn (bench/cache_core.py's: each
turn adds a call and a ~2.3k-token tool result, and drops the oldest results and repositions once the
live length passes ``--live-budget``; each turn generates ``--reply-tokens`` that the next turn's text
does not repeat, as in a replay), its text growing to ~275k tokens at 116 turns, and reports per
turn the scheduler thread's CPU milliseconds by phase (receive and attach, schedule and admit, run,
result and publish; ``scheduler_driver.HostClock``). Every ``--floor-every`` turns, and at the last,
the floor is served beside it: a plain conversation of that turn's live tokens whose prefix (all but
the turn's call and result) was prefilled just before, so it computes the same new tokens over a
resident prefix of the live length, as text engineering's best case does. On the CPU the schedule and
run phases also hold the tensor work a GPU does asynchronously (and the interpreted Triton index
kernels of plain requests), so AKV is set against the floor on the host-only phases, receive and
result (``host_vs_floor``).

    python bench/admission_sglang_cpu.py --steps 29 --trials 6 --out bench/results/x.json
    python bench/admission_sglang_cpu.py --agent 116 --out bench/results/y.json
"""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from bench.harness import results, servers  # noqa: E402

SIZES = {"system": 60, "user": 40, "call": 60, "result": 940, "reply": 3}
VOCAB = 500


def trial_waves(seed: int, steps: int, beside: int) -> list[dict[str, Any]]:
    """The plain turn's wave and the next turn's (with the other conversation's prompt when ``beside``)."""
    from akv.system.context.compiler import compile_program
    from akv.system.context.rules import parse_rules
    from akv.system.context.wire import encode_program

    rng = np.random.default_rng(seed)
    sizes = [SIZES["system"], SIZES["user"]] + [SIZES["call"], SIZES["result"]] * (steps + 1) + [SIZES["reply"]]
    ids = rng.integers(0, VOCAB, size=sum(sizes))
    ids[0] = 2 * seed % VOCAB  # no two trials (nor the other conversation) share a path
    owners = np.repeat(np.arange(len(sizes)), sizes)
    anchor = len(sizes) - 2
    tool_results = list(range(3, anchor - 1, 2))
    rules = parse_rules({str(anchor): tool_results[: len(tool_results) // 2]}, [anchor], anchor + 1)
    program = compile_program(ids, owners, rules, anchor + 1)
    turn = ids[: -sum(sizes[-3:])]
    nxt = {"rid": f"next-{seed}", "ids": ids.tolist(), "program": base64.b64encode(encode_program(program)).decode(),
           "max_new": 1}
    wave = [nxt]
    if beside:
        other = rng.integers(0, VOCAB, size=beside)
        other[0] = (2 * seed + 1) % VOCAB
        wave = [{"rid": f"other-{seed}", "ids": other.tolist(), "program": None, "max_new": 1}, nxt]
    return [{"requests": [{"rid": f"turn-{seed}", "ids": turn.tolist(), "program": None, "max_new": 1}]},
            {"requests": wave}]


HOST_PHASES = ("receive", "result")
"""The phases with no tensor work on the CPU device: set against the floor's (module docstring)."""


def agent_waves(turns: int, budget: int, floor_every: int,
                reply: int = 1) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The agent's waves (module docstring) and, per turn, its sizes and which waves measure it."""
    from akv.system.context.compiler import compile_program
    from akv.system.context.rules import parse_rules
    from akv.system.context.wire import encode_program
    from bench.cache_core import agent_messages, agent_turns

    messages = [m % VOCAB for m in agent_messages(np.random.default_rng(0), turns)]
    sizes = [m.size for m in messages]
    waves, turn_rows = [], []
    for turn, step in enumerate(agent_turns(messages, budget)):
        last = step.last
        program = compile_program(step.ids, step.owners,
                                  parse_rules(step.drops or None, step.repositions or None, last + 1), last + 1)
        row = {"turn": turn, "text_tokens": int(step.ids.size), "live_tokens": step.live,
               "events": len(step.drops) + len(step.repositions), "akv_wave": len(waves)}
        waves.append({"requests": [{"rid": f"akv-{turn}", "ids": step.ids.tolist(), "max_new": reply,
                                    "program": base64.b64encode(encode_program(program)).decode()}]})
        if turn % floor_every == floor_every - 1 or turn == turns - 1:
            plain = np.concatenate([messages[m] for m in range(last + 1) if m not in step.dropped])
            plain[0] = (plain[0] + 1) % VOCAB  # its own path in the tree
            prefix = plain[: plain.size - sizes[last - 1] - sizes[last]]
            waves.append({"requests": [{"rid": f"prime-{turn}", "ids": prefix.tolist(), "program": None, "max_new": 1}]})
            row["floor_wave"] = len(waves)
            waves.append({"requests": [{"rid": f"floor-{turn}", "ids": plain.tolist(), "program": None,
                                        "max_new": reply}]})
        turn_rows.append(row)
    return waves, turn_rows


def agent_report(report: dict[str, Any], turn_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per turn the AKV wave's and the floor's host CPU ms; medians by text."""
    lines = {line["rid"]: line for line in report["prefills"]}
    rows = []
    for row in turn_rows:
        akv = report["waves"][row.pop("akv_wave")]["host_cpu_ms"]
        line = lines.get(f"akv-{row['turn']}", {})
        row.update(akv_host_cpu_ms=akv, akv_total_ms=round(sum(akv.values()), 3),
                   **{k: line.get(k) for k in ("admission_ms", "forwards", "new", "cached", "repositioned", "copy_slots",
                                                "in_place")})
        if "floor_wave" in row:
            floor = report["waves"][row.pop("floor_wave")]["host_cpu_ms"]
            host = [sum(ms[p] for p in HOST_PHASES) for ms in (akv, floor)]
            row.update(floor_host_cpu_ms=floor, host_vs_floor=round(host[0] / max(host[1], 1e-9), 2))
        rows.append(row)
    buckets: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        lo = row["text_tokens"] // 50_000 * 50
        buckets.setdefault(f"{lo}-{lo + 50}k", []).append(row)
    summary = {}
    for name, group in buckets.items():
        floors = [r["host_vs_floor"] for r in group if "host_vs_floor" in r]
        summary[name] = {"turns": len(group), "akv_total_ms_median": round(statistics.median(r["akv_total_ms"] for r in group), 3),
                         **{f"akv_{phase}_ms_median": round(statistics.median(r["akv_host_cpu_ms"][phase] for r in group), 3)
                            for phase in group[0]["akv_host_cpu_ms"]},
                         "host_vs_floor": floors}
    return {"by_text": summary, "turns": rows}


def main() -> None:
    p = cli.parser(None, __doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=29, help="tool calls of the turn (29: ~30k tokens)")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--pool", type=int, default=400_000, help="KV slots (small enough and later trials evict)")
    p.add_argument("--chunk", type=int, default=8192, help="SGLang's chunked prefill size")
    p.add_argument("--beside-chunked", type=int, default=0, metavar="N")
    p.add_argument("--overlap", action="store_true", help="SGLang's overlap schedule")
    p.add_argument("--agent", type=int, default=0, metavar="TURNS", help="serve the live-budget agent instead")
    p.add_argument("--live-budget", type=int, default=20_000, help="the agent's live tokens (--agent)")
    p.add_argument("--floor-every", type=int, default=10, help="the floor beside every this many turns (--agent)")
    p.add_argument("--reply-tokens", type=int, default=1,
                   help="tokens each turn generates (--agent; the next turn's text does not repeat them)")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "admission-sglang-cpu")
    p.add_argument("--out", type=cli.new_file, default=None)
    args = p.parse_args()
    head = results.header("bench/admission_sglang_cpu.py")
    from akv.system.models.tiny import make_tiny_model

    model = args.work / "tiny-qwen3"
    if not (model / "config.json").exists():
        make_tiny_model(model, seed=3, max_position_embeddings=262_144)
    site = servers.cpu_patched_site(args.work)
    if args.agent:
        waves, turn_rows = agent_waves(args.agent, args.live_budget, args.floor_every, args.reply_tokens)
    else:
        waves = [w for seed in range(1, args.trials + 1) for w in trial_waves(seed, args.steps, args.beside_chunked)]
    job = {"model": str(model), "overlap": args.overlap, "chunk": args.chunk, "backend": "akv", "env": {},
           "parts": [waves], "max_total_tokens": args.pool, "server_args": {"context_length": 262_144},
           "timeout": 3000, "stub_attention": True, "count_calls": True,
           "host_clock": bool(args.agent)}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TRITON_INTERPRET": "1"}
    started = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_cpu" / "scheduler_driver.py")],
                          input=json.dumps(job), capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"scheduler driver failed: {done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])[0]
    if args.agent:
        results.show({**head, "clock": "CPU time of the scheduler thread", "turns": args.agent,
                      "live_budget": args.live_budget, "reply_tokens": args.reply_tokens, "pool": args.pool, "chunk": args.chunk, "overlap": args.overlap,
                      **agent_report(report, turn_rows), "run_s": round(time.time() - started, 1)}, args.out)
        return
    lines = {line["rid"]: line for line in report["prefills"]}
    rows = []
    for seed, wave in zip(range(1, args.trials + 1), report["waves"][1::2]):
        line = lines[f"next-{seed}"]
        rows.append({"admission_ms": line["admission_ms"], "core_match_calls": wave["calls"]["match"],
                     "core_commit_calls": wave["calls"]["commit"], "cached": line["cached"],
                     "repositioned": line["repositioned"], "new": line["new"]})
    ms = [r["admission_ms"] for r in rows]
    results.show({**head, "clock": "wall (the scheduler's perf_counter)", "steps": args.steps,
                  "prompt_tokens": len(waves[1]["requests"][-1]["ids"]), "pool": args.pool,
                  "beside_chunked": args.beside_chunked, "chunk": args.chunk, "overlap": args.overlap,
                  "admission_ms_median": round(statistics.median(ms), 3),
                  "admission_ms_median_after_first": round(statistics.median(ms[1:] or ms), 3),
                  "rows": rows, "run_s": round(time.time() - started, 1)}, args.out)


if __name__ == "__main__":
    main()
