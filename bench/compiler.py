"""Benchmark the context compiler and wire form on 200k-token agent-shaped prompts (CPU).

Run: ``python bench/compiler.py --out bench/results/compiler.json``. Scenarios, side by side:
``plain`` (no operations), ``agent`` (rolling drop of old tool results + periodic reposition),
``dense`` (every other message drops the one halfway back, then repositions: each Repos moves about
half the prompt, so its cost is the size of the transitions it must produce; fewer messages).
``provenance`` times the Qwen3 chat template on a 1000-call tool conversation: the plain render
(what SGLang does anyway) against the owned render (instrumented render + plain render check).

``--agent`` measures instead the live-budget agent of ``bench/cache_core.py --agent`` (tool results
dropped oldest first to keep the live length under ``--budget``, a Repos with every drop) at the
turns of ``--agent-turns``, and the work SGLang's scheduler thread does for one context request before
the cache core (:func:`akv.system.adapter.lengths.request_program`: wire decode, the check of its
tokens against the request's ``array("q")`` input ids, the length checks), the current tree against
the ``akv/`` of ``--baseline`` (a git revision), each in its own process, alternating for
``--rounds`` rounds. CPU ms per call (median of ``--repeats``, then of the rounds) and minor page
faults per call, also under :data:`HEAP_KEPT` (``*_heap_kept``); ``transitions_ms`` is what reading
every Repos's moved tokens (tokens, old and new positions) of a decoded program costs afterwards.
Run: ``python bench/compiler.py --agent --baseline 668cc05 --out bench/results/compiler-agent.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("AKV_BENCH_TREE"):  # --agent's measuring process: this tree's akv first
    sys.path.insert(0, os.environ["AKV_BENCH_TREE"])

from akv import cli  # noqa: E402
from akv.system.context.compiler import append_generated, compile_program  # noqa: E402
from akv.system.context.provenance import ChatTemplate  # noqa: E402
from akv.system.context.rules import parse_rules  # noqa: E402
from akv.system.context.wire import decode_program, encode_program  # noqa: E402
from bench.harness import results  # noqa: E402


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """Median wall and CPU time in ms over ``repeats`` runs, and the last result."""
    wall, cpu = [], []
    result = None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu), result


def _conversation(n_tokens: int, n_messages: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, n_tokens - 8), size=n_messages - 1, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [n_tokens - 8]]))
    owners = np.repeat(np.arange(n_messages), sizes)
    owners = np.concatenate([owners, np.full(8, n_messages)])
    return rng.integers(0, 151_000, n_tokens), owners


def _agent_fields(n_messages: int, keep: int, repos_every: int) -> tuple[dict[str, list[int]], list[int]]:
    """Tool results are the odd messages; each new one drops the result ``keep`` results back."""
    tools = list(range(1, n_messages, 2))
    drops = {str(tools[i + keep]): [tools[i]] for i in range(len(tools) - keep)}
    repos = [tools[i] for i in range(keep, len(tools), repos_every)]
    return drops, repos


def _dense_fields(n_messages: int) -> tuple[dict[str, list[int]], list[int]]:
    """Every anchor drops the message halfway back, then repositions: every repos moves half the prompt."""
    drops: dict[str, list[int]] = {}
    for anchor in range(2, n_messages, 2):
        drops[str(anchor)] = [anchor // 2]
    return drops, [int(k) for k in drops]


def _tool_conversation(calls: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(calls):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": {"path": f"/src/{i}.py"}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "def f(x):\n    return x\n" * 20})
    messages.append({"role": "user", "content": "Summarise."})
    return messages


def run_provenance(calls: int, repeats: int) -> dict[str, Any]:
    source = Path(__file__).resolve().parents[1] / "tests" / "context" / "templates" / "qwen3.jinja"
    template = ChatTemplate(source.read_text(encoding="utf-8"))
    messages = _tool_conversation(calls)
    plain_ms, plain_cpu_ms, text = _timed(lambda: template.render(messages), repeats)
    owned_ms, owned_cpu_ms, _ = _timed(lambda: template.render_owned(messages), repeats)
    return {
        "messages": len(messages),
        "characters": len(text),
        "render_plain_ms": round(plain_ms, 3),
        "render_owned_ms": round(owned_ms, 3),
        "render_plain_cpu_ms": round(plain_cpu_ms, 3),
        "render_owned_cpu_ms": round(owned_cpu_ms, 3),
        "owned_vs_plain_cpu": round(owned_cpu_ms / plain_cpu_ms, 2),
    }


def run(n_tokens: int, n_messages: int, dense_messages: int, repeats: int) -> dict[str, Any]:
    scenarios = {
        "plain": (n_messages, None, None),
        "agent": (n_messages, *_agent_fields(n_messages, keep=8, repos_every=10)),
        "dense": (dense_messages, *_dense_fields(dense_messages)),
    }
    results: dict[str, Any] = {}
    for name, (n_messages, drop_message, reposition) in scenarios.items():
        token_ids, owners = _conversation(n_tokens, n_messages, seed=0)
        parse_ms, _, rules = _timed(lambda: parse_rules(drop_message, reposition, n_messages), repeats)
        compile_ms, compile_cpu_ms, program = _timed(
            lambda: compile_program(token_ids, owners, rules, n_messages), repeats
        )
        encode_ms, _, data = _timed(lambda: encode_program(program), repeats)
        decode_ms, decode_cpu_ms, _ = _timed(lambda: decode_program(data), repeats)
        append_ms, _, _ = _timed(lambda: append_generated(program, [1]), repeats)
        results[name] = {
            "messages": n_messages,
            "events": len(program.events),
            "repositions": len(program.transitions),
            "moved_tokens": int(sum(t.tokens.size for t in program.transitions)),
            "parse_ms": round(parse_ms, 3),
            "compile_ms": round(compile_ms, 3),
            "compile_cpu_ms": round(compile_cpu_ms, 3),
            "encode_ms": round(encode_ms, 3),
            "decode_ms": round(decode_ms, 3),
            "decode_cpu_ms": round(decode_cpu_ms, 3),
            "append_1_token_ms": round(append_ms, 3),
            "wire_bytes": len(data),
        }
    base = results["plain"]["compile_ms"]
    for name in results:
        results[name]["compile_vs_plain"] = round(results[name]["compile_ms"] / base, 2)
    return results


def agent_inputs(turns: int, budget: int, seed: int) -> dict[str, Any]:
    """The live-budget agent's last request after ``turns`` turns (as ``bench/cache_core.py --agent``
    builds it): token ids, owners and the wire fields."""
    from bench.cache_core import agent_messages, agent_turns

    *_, last = agent_turns(agent_messages(np.random.default_rng(seed), turns), budget)
    return {"ids": last.ids, "owners": last.owners, "drops": last.drops, "repositions": last.repositions,
            "n_messages": last.last + 1}


def _cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Median CPU ms of ``fn`` and its minor page faults per call."""
    fn()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    per_call = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeats
    return round(statistics.median(times), 3), round(per_call, 1)


def measure_agent(inputs: dict[str, Any], repeats: int, context_len: int) -> dict[str, Any]:
    """One process's timings of one program (public functions only, so any revision's akv runs it)."""
    import akv
    from akv.system.adapter import lengths
    from akv.system.context.compiler import compile_program
    from akv.system.context.rules import parse_rules
    from akv.system.context.wire import decode_program, encode_program

    ids, owners, n = inputs["ids"], inputs["owners"], inputs["n_messages"]
    rules = parse_rules(inputs["drops"] or None, inputs["repositions"] or None, n)
    program = compile_program(ids, owners, rules, n)
    data = encode_program(program)
    req = SimpleNamespace(origin_input_ids=array("q", ids.tolist()))  # what SGLang 0.5.16's Req holds
    attached = lengths.request_program(req, data, context_len)
    assert not isinstance(attached, str), attached

    def transitions() -> None:  # every Repos's moved tokens, read once from a freshly decoded program
        for t in decoded.pop().transitions:
            (t.tokens, t.old_positions, t.new_positions)

    decoded: list[Any] = []
    out: dict[str, Any] = {"akv": str(Path(akv.__file__).parent)}
    for name, fn in [("compile", lambda: compile_program(ids, owners, rules, n)),
                     ("encode", lambda: encode_program(program)),
                     ("decode", lambda: decode_program(data)),
                     ("scheduler_attach", lambda: lengths.request_program(req, data, context_len)),
                     ("transitions", transitions)]:
        if name == "transitions":
            times = []
            for _ in range(repeats):
                decoded.append(decode_program(data))
                start = time.process_time()
                transitions()
                times.append((time.process_time() - start) * 1e3)
            out["transitions_ms"] = round(statistics.median(times), 3)
            continue
        out[f"{name}_ms"], out[f"{name}_page_faults"] = _cpu(fn, repeats)
    out.update(text_tokens=program.n_tokens, events=len(program.events), live_length=int(program.next_position),
               moved_tokens=int(sum(t.tokens.size for t in program.transitions)), wire_bytes=len(data))
    return out


HEAP_KEPT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc settings under which freed arrays stay in the heap: the ``*_heap_kept`` variants show what
the same work costs without the first-touch page faults of fresh arrays."""


def run_agent(args: Any) -> dict[str, Any]:
    """Both trees, alternating, each size in its own processes (module docstring)."""
    baseline = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.baseline], capture_output=True, text=True,
                              check=True).stdout.strip()
    sizes = []
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", baseline, "akv"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        for turns in args.agent_turns:
            inputs = agent_inputs(turns, args.budget, seed=0)
            path = Path(tmp) / f"agent-{turns}.json"
            path.write_text(json.dumps({**inputs, "ids": inputs["ids"].tolist(), "owners": inputs["owners"].tolist()}))
            variants = {"before": (before, {}), "after": (ROOT, {}), "before_heap_kept": (before, HEAP_KEPT),
                        "after_heap_kept": (ROOT, HEAP_KEPT)}
            rounds: dict[str, list[dict[str, Any]]] = {label: [] for label in variants}
            for _ in range(args.rounds):
                for label, (tree, env) in variants.items():
                    child = subprocess.run(
                        [sys.executable, __file__, "--measure", str(path), "--repeats", str(args.repeats),
                         "--context-len", str(args.context_len)],
                        env={**os.environ, **env, "AKV_BENCH_TREE": str(tree)}, capture_output=True, text=True,
                        check=True)
                    rounds[label].append(json.loads(child.stdout))
            row: dict[str, Any] = {"turns": turns}
            for label, runs in rounds.items():
                assert all(r["akv"] == str(variants[label][0] / "akv") for r in runs), runs
                merged = {k: v for k, v in runs[0].items() if not k.endswith(("_ms", "_page_faults")) and k != "akv"}
                row.update(merged)
                row[label] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]
                              if k.endswith(("_ms", "_page_faults"))}
            for suffix in ("", "_heap_kept"):
                row[f"after_vs_before{suffix}"] = {
                    k: round(row[f"before{suffix}"][k] / max(row[f"after{suffix}"][k], 1e-3), 1)
                    for k in row["after"] if k.endswith("_ms") and k != "transitions_ms"}
            sizes.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"baseline": baseline, "sizes": sizes}


def main() -> None:
    parser = cli.parser(None, __doc__)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--messages", type=int, default=4_000)
    parser.add_argument("--dense-messages", type=int, default=200)
    parser.add_argument("--calls", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--agent", action="store_true", help="the live-budget agent, current tree vs --baseline")
    parser.add_argument("--agent-turns", type=lambda t: [int(x) for x in t.split(",")], default=[21, 49, 116],
                        help="turns of the agent's measured requests (text about 50k, 116k, 275k tokens)")
    parser.add_argument("--budget", type=int, default=20_000, help="the agent's live-length budget")
    parser.add_argument("--baseline", default="668cc05", help="git revision whose akv/ is measured as before")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--context-len", type=int, default=131_072)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=cli.new_file)
    args = parser.parse_args()
    if args.measure is not None:
        inputs = json.loads(args.measure.read_text())
        inputs["ids"], inputs["owners"] = np.asarray(inputs["ids"]), np.asarray(inputs["owners"])
        print(json.dumps(measure_agent(inputs, args.repeats, args.context_len)))
        return
    report = {
        **results.header("bench/compiler.py"),  # before the work: the load average at the start
        "numpy": np.__version__,
        "repeats": args.repeats,
    }
    if args.agent:
        report.update(statistic="CPU ms per call: median of --repeats in a process, then of --rounds processes",
                      rounds=args.rounds, budget=args.budget, context_len=args.context_len, **run_agent(args))
    else:
        report.update(tokens=args.tokens, statistic="median ms (wall unless named cpu)",
                      scenarios=run(args.tokens, args.messages, args.dense_messages, args.repeats),
                      provenance=run_provenance(args.calls, args.repeats))
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    results.show(report, args.out)


if __name__ == "__main__":
    main()
