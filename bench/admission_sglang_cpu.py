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

    python bench/admission_sglang_cpu.py --steps 29 --trials 6 --out bench/results/x.json
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


def main() -> None:
    p = cli.parser(None, __doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=29, help="tool calls of the turn (29: ~30k tokens)")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--pool", type=int, default=400_000, help="KV slots (small enough and later trials evict)")
    p.add_argument("--chunk", type=int, default=8192, help="SGLang's chunked prefill size")
    p.add_argument("--beside-chunked", type=int, default=0, metavar="N")
    p.add_argument("--overlap", action="store_true", help="SGLang's overlap schedule")
    p.add_argument("--work", type=Path, default=ROOT / "build" / "admission-sglang-cpu")
    p.add_argument("--out", type=cli.new_file, default=None)
    args = p.parse_args()
    head = results.header("bench/admission_sglang_cpu.py")
    from akv.system.models.tiny import make_tiny_model

    model = args.work / "tiny-qwen3"
    if not (model / "config.json").exists():
        make_tiny_model(model, seed=3, max_position_embeddings=262_144)
    site = servers.cpu_patched_site(args.work)
    waves = [w for seed in range(1, args.trials + 1) for w in trial_waves(seed, args.steps, args.beside_chunked)]
    job = {"model": str(model), "overlap": args.overlap, "chunk": args.chunk, "backend": "akv", "env": {},
           "parts": [waves], "max_total_tokens": args.pool, "server_args": {"context_length": 262_144},
           "timeout": 3000, "stub_attention": True, "count_calls": True}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TRITON_INTERPRET": "1"}
    started = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "sglang_cpu" / "scheduler_driver.py")],
                          input=json.dumps(job), capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(f"scheduler driver failed: {done.stderr[-4000:]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])[0]
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
