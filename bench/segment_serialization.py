"""Concurrent context turns with several segments vs one (CPU scheduler; issue 10).

Run: ``python bench/segment_serialization.py --out bench/results/segment_serialization.json``.

A context request whose plan has several segments runs them as chunked-prefill rounds; SGLang keeps
one chunked request at a time, and the others continue beside it (``akv.system.adapter.rounds``;
before that they waited for the slot, one request's rounds after another's). An agent turn
whose drop is anchored at its last message has two segments (the new messages, then the generation
prompt after the drop); with the drop anchored one message earlier the same turn has one. Both
kinds, ``K`` warm conversations at once (for each ``K`` given), through SGLang's real scheduler on
the CPU (tiny FP32 Qwen3, the driver of ``tests/sglang_cpu``): wall time of the wave, forwards it
took, the largest batch, and per request the wave's forward of its first round, the forward of its
last round (the one that samples its first token), and the tokens of each of its prefill rounds.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from akv import cli  # noqa: E402
from akv.system.cache.core import CacheCore  # noqa: E402
from akv.system.cache.pool import SlotPool  # noqa: E402
from akv.system.context.compiler import compile_program  # noqa: E402
from akv.system.context.rules import parse_rules  # noqa: E402
from akv.system.models.tiny import make_tiny_model  # noqa: E402
from bench.harness import results, servers  # noqa: E402
from tests.sglang_cpu import scenarios  # noqa: E402
from tests.sglang_cpu.conftest import serve  # noqa: E402
from tests.sglang_cpu.scenarios import Conversation, Request  # noqa: E402


def waves(k: int, last_anchor: bool, seed: int) -> list[list[Request]]:
    """A plain warm-up turn of ``k`` conversations, then one context turn of each."""
    convs = [Conversation(seed + i).add(7, 5, 4, 9, 4, 9) for i in range(k)]
    warm = [c.request(f"warm-{i}", plain=True) for i, c in enumerate(convs)]
    turns = []
    for i, conv in enumerate(convs):
        if last_anchor:
            conv.add(4, 9).drop(2)
        else:
            conv.drop(2).add(4, 9)
        turns.append(conv.request(f"turn-{i}", max_new=4))
    return [warm, turns]


def _segments(job: list[list[Request]]) -> list[int]:
    """Segments of each turn's plan once its warm-up turn is in the cache (the cache core's own plan)."""
    core = CacheCore(SlotPool(1 << 14))
    out = []
    for warm, turn in zip(*job):
        ids = np.array(warm.ids, dtype=np.int64)
        core.finish(core.admit(compile_program(ids, np.zeros(ids.size, np.int64), parse_rules(None, None, 1), 1)))
        out.append(len(core.match(turn.program).plan.plan.segments))
    return out


def measure(site: Path, model: Path, k: int, last_anchor: bool, seed: int) -> dict[str, Any]:
    job = waves(k, last_anchor, seed)
    report = serve(site, model, scenarios.job(job), chunk=64)
    rids = [r.rid for r in job[1]]
    segments = _segments(job)
    wave = [(b, t) for b, t in zip(report["batches"], report["tokens"]) if set(b) & set(rids)]
    rounds = {r: [(i, t[b.index(r)]) for i, (b, t) in enumerate(wave) if r in b][:n] for r, n in zip(rids, segments)}
    return {
        "drop_anchor": "last message" if last_anchor else "message before the new ones",
        "segments_per_turn": sorted(set(segments)),
        "wave_s": report["waves"][1]["seconds"],
        "forwards": len(wave),
        "max_batch": max(len(b) for b, _ in wave),
        "first_forward_per_request": [rs[0][0] for rs in rounds.values()],
        "first_token_forward_per_request": [rs[-1][0] for rs in rounds.values()],
        "round_tokens_per_request": [[tokens for _, tokens in rs] for rs in rounds.values()],
        "tokens_per_forward": [sum(t) for _, t in wave],
    }


def main() -> None:
    parser = cli.parser(None, __doc__.split("\n", 1)[0])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=cli.new_file)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="akv-segments-") as tmp:
        work = Path(tmp)
        site = servers.cpu_patched_site(work)
        model = make_tiny_model(work / "tiny-qwen3", seed=3)
        result = {
            **results.header("bench/segment_serialization.py"),  # before the work: the load average at the start
            "runs": [{"k": k, "two_segments": measure(site, model, k, True, 60),
                      "one_segment": measure(site, model, k, False, 60)} for k in args.k],
        }
    results.show(result, args.out)


if __name__ == "__main__":
    main()
