"""Time `CachePolicy.process()` on generated tool conversations of 50, 500 and 5,000 messages.

    python bench/agent_process.py [--repeats N] [--result-chars C] [--out bench/results/agent_process.json]

For each size and rule family (turn, token, model) it reports the min, median and p90 of:
  cold         process(payload) with no history: every turn is decided
  incremental  process(payload, history of the payload one tool batch shorter): the usual agent call
  unchanged    process(payload, history of the same payload): no new decision
and, side by side, `copy` (the deep copy of the payload that every call returns), `json`
(json.dumps of the payload, what sending it costs) and `digest` (the prefix digest of all messages,
which a history computes on its first `to_json()` or comparison, not inside `process()`) as reference
points. The load average is recorded because the cold medians follow it on a shared machine.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from akv import cli  # noqa: E402
from akv.agent import (  # noqa: E402
    ApproximateTokenCounter,
    CachePolicy,
    ModelReposition,
    ModelSelection,
    ModelTrigger,
    TokenReposition,
    TokenSelection,
    TokenTrigger,
    TurnReposition,
    TurnSelection,
    TurnTrigger,
)
from akv.agent.history import EMPTY_PREFIX, extend_digest  # noqa: E402
from akv.agent.payload import copy_json  # noqa: E402
from bench.harness import results  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for n in ("read_record", "search", "drop_context")]


def conversation(n_messages: int, result_chars: int, seed: int = 0) -> list[dict]:
    """System prompt, task, then tool batches (1-3 calls); every 10th batch is a drop_context call
    whose receipt drops the two oldest results still visible."""
    rng = random.Random(seed)
    messages: list[dict] = [{"role": "system", "content": "You are a research agent."},
                            {"role": "user", "content": "Find the answer."}]
    results: list[int] = []
    k = 0
    while len(messages) < n_messages:
        k += 1
        if k % 10 == 0 and len(results) >= 2:
            ids, results = results[:2], results[2:]
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": f"d{k}", "type": "function",
                 "function": {"name": "drop_context", "arguments": json.dumps({"message_ids": ids})}}]})
            messages.append({"role": "tool", "tool_call_id": f"d{k}",
                             "content": json.dumps({"status": "scheduled", "message_ids": ids})})
            continue
        width = rng.randint(1, 3)
        calls = [{"id": f"c{k}_{j}", "type": "function",
                  "function": {"name": rng.choice(["read_record", "search"]), "arguments": '{"q": "x"}'}}
                 for j in range(width)]
        messages.append({"role": "assistant", "content": "Looking it up.", "tool_calls": calls})
        for c in calls:
            results.append(len(messages))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "r" * result_chars})
    while messages[-1]["role"] != "tool":
        messages.pop()
    return messages


def policies(result_chars: int) -> dict[str, CachePolicy]:
    counter = ApproximateTokenCounter()
    per_result = result_chars // 4
    return {
        "turn": CachePolicy(trigger=TurnTrigger(), selector=TurnSelection(3, "both"),
                            reposition=TurnReposition(after=4, every=4)),
        "token": CachePolicy(trigger=TokenTrigger(40 * per_result, counter),
                             selector=TokenSelection(20 * per_result, counter),
                             reposition=TokenReposition(60 * per_result, counter)),
        "model": CachePolicy(trigger=ModelTrigger(), selector=ModelSelection(), reposition=ModelReposition()),
    }


def timed(fn, repeats: int) -> dict[str, float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return {"min_ms": round(samples[0], 4), "median_ms": round(statistics.median(samples), 4),
            "p90_ms": round(samples[min(len(samples) - 1, int(0.9 * len(samples)))], 4)}


def main() -> None:
    parser = cli.parser(None, __doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 500, 5000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--result-chars", type=int, default=1000)
    parser.add_argument("--out", type=cli.new_file, default=None,
                        help="also write the result to this new file (e.g. bench/results/agent_process-DATE.json)")
    args = parser.parse_args()
    head = results.header("bench/agent_process.py")  # before the work: the load average at the start
    rows = []
    for size in args.sizes:
        messages = conversation(size, args.result_chars)
        payload = {"model": "qwen3-8b", "messages": messages, "tools": TOOLS, "temperature": 0.6}
        last_batch = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        shorter = {**payload, "messages": messages[:last_batch]}
        repeats = max(3, args.repeats // 10) if size >= 5000 else args.repeats
        copy_t = timed(lambda: copy_json(payload), repeats)
        json_t = timed(lambda: json.dumps(payload), repeats)
        digest_t = timed(lambda: extend_digest(EMPTY_PREFIX, messages), repeats)
        for name, policy in policies(args.result_chars).items():
            new, full_history = policy.process(payload)
            _, prior = policy.process(shorter)
            row = {
                "messages": len(messages), "rules": name, "repeats": repeats,
                "drops": sum(len(v) for v in new.get("drop_message", {}).values()),
                "repositions": len(new.get("reposition", [])),
                "cold": timed(lambda: policy.process(payload), repeats),
                "incremental": timed(lambda: policy.process(payload, prior), repeats),
                "unchanged": timed(lambda: policy.process(payload, full_history), repeats),
                "copy": copy_t, "json": json_t, "digest": digest_t,
            }
            row["incremental_over_json"] = round(row["incremental"]["median_ms"] / json_t["median_ms"], 2)
            rows.append(row)
    columns = [("messages", lambda r: f"{r['messages']}"), ("rules", lambda r: r["rules"])]
    columns += [(f"{k} ms", lambda r, k=k: f"{r[k]['median_ms']:.3f}")
                for k in ("cold", "incremental", "unchanged", "copy", "json", "digest")]
    columns += [("incr/json", lambda r: f"{r['incremental_over_json']:.2f}"), ("drops", lambda r: f"{r['drops']}"),
                ("repos", lambda r: f"{r['repositions']}")]
    print(" ".join(f"{name:>14}" for name, _ in columns))
    for r in rows:
        print(" ".join(f"{cell(r):>14}" for _, cell in columns))
    out = {
        **head, "load_average_1m_after": round(os.getloadavg()[0], 2),
        "result_chars": args.result_chars, "goal": "process() well under 5 ms at 500 messages; cold at most 2.5 ms (min) there",
        "rows": rows,
    }
    if args.out is not None:
        results.write(out, args.out, indent=2)


if __name__ == "__main__":
    main()
