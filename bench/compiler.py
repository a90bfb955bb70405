"""Benchmark the context compiler and wire form on 200k-token agent-shaped prompts (CPU).

Run: ``python bench/compiler.py --out bench/results/compiler.json``. Scenarios, side by side:
``plain`` (no operations), ``agent`` (rolling drop of old tool results + periodic reposition),
``dense`` (every other message drops the one halfway back, then repositions: each Repos moves about
half the prompt, so its cost is the size of the transitions it must produce; fewer messages).
``provenance`` times the Qwen3 chat template on a 1000-call tool conversation: the plain render
(what SGLang does anyway) against the owned render (instrumented render + plain render check).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> None:
    parser = cli.parser(None, __doc__)
    parser.add_argument("--tokens", type=int, default=200_000)
    parser.add_argument("--messages", type=int, default=4_000)
    parser.add_argument("--dense-messages", type=int, default=200)
    parser.add_argument("--calls", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=cli.new_file)
    args = parser.parse_args()
    report = {
        **results.header("bench/compiler.py"),  # before the work: the load average at the start
        "numpy": np.__version__,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "statistic": "median ms (wall unless named cpu)",
        "scenarios": run(args.tokens, args.messages, args.dense_messages, args.repeats),
        "provenance": run_provenance(args.calls, args.repeats),
    }
    results.show(report, args.out)


if __name__ == "__main__":
    main()
