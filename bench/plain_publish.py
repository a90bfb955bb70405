"""CPU cost of the AKV radix backend's plain-request bookkeeping (``akv.system.cache.plain``) in a
16-request burst: each request (~1.9k distinct prompt tokens, 128 generated) is matched, published
after its prefill (insert, which returns the resident slots, and the lock swap) and published again when it
finishes, on a CacheCore whose tree already holds earlier bursts. The work the H200's plain burst spends on the scheduler's CPU
(``bench/results/akv-decode-bench-h200-burst2.json``), without SGLang or a model.

    python bench/plain_publish.py [--bursts 4] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli  # noqa: E402
from akv.system.cache import plain  # noqa: E402
from akv.system.cache.core import CacheCore  # noqa: E402
from akv.system.cache.pool import SlotPool  # noqa: E402
from bench.harness import results  # noqa: E402

N, PROMPT, OUTPUT = 16, 1925, 128


def burst(core: CacheCore, seed: int) -> dict[str, float]:
    """Seconds spent matching, publishing after prefill and publishing at the finish."""
    rng = np.random.default_rng(seed)
    prompts = [np.concatenate([np.arange(6), rng.integers(100, 150_000, PROMPT - 6)]).astype(np.int64)
               for _ in range(N)]
    spent = {"match": 0.0, "after_prefill": 0.0, "finish": 0.0}
    live = []
    for ids in prompts:
        t = time.perf_counter()
        prefix = plain.resident_prefix(core, ids, "")
        core.pool.incref(prefix)
        spent["match"] += time.perf_counter() - t
        live.append((ids, np.concatenate([prefix, core.pool._free_list.take(PROMPT - prefix.size)]), prefix))
    for i, (ids, row, prefix) in enumerate(live):
        t = time.perf_counter()
        slots = plain.publish(core, row, prefix.size, ids, "")
        core.pool.incref(slots)
        core.pool.decref(prefix)
        spent["after_prefill"] += time.perf_counter() - t
        live[i] = (ids, row, slots)
    for ids, row, slots in live:
        full = np.concatenate([ids, rng.integers(100, 150_000, OUTPUT)])
        grown = np.concatenate([row, core.pool._free_list.take(OUTPUT)])
        t = time.perf_counter()
        plain.publish(core, grown, slots.size, full, "")
        core.pool.decref(slots)
        spent["finish"] += time.perf_counter() - t
    return spent


def main() -> int:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=4, help="bursts per repeat (the first one, on an empty tree, untimed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=cli.new_file, default=None)
    args = p.parse_args()
    head = results.header("bench/plain_publish.py")  # before the work: the load average at the start
    per_burst = []
    for repeat in range(args.repeats):
        core = CacheCore(SlotPool(400_000))
        burst(core, 0)
        for b in range(1, args.bursts):
            per_burst.append(burst(core, 100 * repeat + b))
    report = {**head, "requests_per_burst": N, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
              "median_ms_per_burst": {k: round(1e3 * statistics.median(b[k] for b in per_burst), 2) for k in per_burst[0]},
              "median_total_ms_per_burst": round(1e3 * statistics.median(sum(b.values()) for b in per_burst), 2)}
    results.show(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
