"""Scheduler CPU time of a plain 16-request burst in stock SGLang's ``RadixCache`` and in the AKV
radix backend (``AkvRadixCache``), side by side in one process, through SGLang's own interface on
CPU tensors.

Each backend has its own ``ReqToTokenPool`` + ``TokenToKVPoolAllocator`` (page size 1) and gets the
calls the scheduler makes for a burst of distinct ~1.9k-token prompts sharing their first 6 tokens,
128 generated tokens each: ``match_prefix`` and ``inc_lock_ref``; one extend batch (request slots,
``alloc_token_slots``, the ``req_to_token`` writes and, for AKV, the ``host_rows.record`` of
``batch_metadata.for_extend``); ``cache_unfinished_req`` after the prefill; 128 decode steps (one
slot per request, the ``req_to_token`` write and, for AKV, ``for_decode``'s ``host_rows.record``);
``cache_finished_req`` and the request slot freed. The bursts alternate between the backends (which
goes first alternates too), each on a tree that holds its earlier bursts; the first burst of each
repeat is untimed, and the prefixes both match are checked equal.

    python -m akv.system._build --out build/akv-dist
    python -m pip install --no-deps --target build/akv-site build/akv-dist/sglang-0.5.16+akv-*.whl
    PYTHONPATH=build/akv-site python bench/plain_backend.py [--bursts 4] [--repeats 5] [--out NEW_FILE]

(``build/`` of the checkout, which git ignores; ``--help`` works without SGLang.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "sglang_patch"))

from akv import cli  # noqa: E402
from bench.harness import results  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=4, help="bursts per repeat (the first one, on empty trees, untimed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=cli.new_file, default=None, help="also write the result to this new file")
    return p


if __name__ == "__main__":
    ARGS = build_parser().parse_args()  # before SGLang is imported: --help needs none of it

import cpu_shim  # noqa: E402

cpu_shim.install()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from akv.system.adapter import host_rows  # noqa: E402
from akv.system.adapter.radix_backend import AkvRadixCache  # noqa: E402
from akv.system.models.tiny import make_tiny_model  # noqa: E402
from sglang.srt.mem_cache.allocation import alloc_token_slots  # noqa: E402
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

N, PROMPT, OUTPUT, SHARED = 16, 1925, 128, 6
POOL_TOKENS, CONTEXT = 400_000, 4096
PHASES = ("match", "extend", "after_prefill", "decode", "finish")


class Req:
    """The attributes of SGLang's ``Req`` that the two caches and this driver read and write."""

    def __init__(self, rid: str, ids: array) -> None:
        self.rid = rid
        self.origin_input_ids = ids
        self.output_ids = array("q")
        self.extra_key = None
        self.priority = None
        self.req_pool_idx: int | None = None
        self.cache_protected_len = 0
        self.prefix_indices: torch.Tensor | None = None
        self.last_node: Any = None
        self.fill_len = len(ids)

    def get_fill_ids(self) -> array:
        return (self.origin_input_ids + self.output_ids)[: self.fill_len]


def make_cache(kind: str) -> Any:
    req_to_token = ReqToTokenPool(size=N, max_context_len=CONTEXT, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(POOL_TOKENS, torch.bfloat16, "cpu", None, need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator,
                             page_size=1)
    return RadixCache(params) if kind == "stock" else AkvRadixCache(params)


def burst(cache: Any, prompts: list[array], outputs: np.ndarray) -> tuple[dict[str, float], list[int]]:
    """Seconds per phase of one burst through ``cache``, and the prefix length each request matched."""
    akv = isinstance(cache, AkvRadixCache)
    pool = cache.req_to_token_pool
    spent = dict.fromkeys(PHASES, 0.0)
    reqs = [Req(f"r{i}", ids) for i, ids in enumerate(prompts)]

    t = time.perf_counter()
    for req in reqs:
        key = RadixKey(token_ids=req.origin_input_ids, extra_key=req.extra_key, limit=PROMPT - 1)
        match = cache.match_prefix(MatchPrefixParams(key=key, req=req))
        req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
        req.cache_protected_len = len(req.prefix_indices)
        cache.inc_lock_ref(req.last_node)
    spent["match"] += time.perf_counter() - t

    t = time.perf_counter()
    pool.alloc(reqs)
    prefix_lens = [len(req.prefix_indices) for req in reqs]
    extend_lens = [PROMPT - n for n in prefix_lens]
    out_cache_loc = alloc_token_slots(cache, sum(extend_lens))
    offset = 0
    for req, lo, n in zip(reqs, prefix_lens, extend_lens):
        pool.write((req.req_pool_idx, slice(0, lo)), req.prefix_indices)
        pool.write((req.req_pool_idx, slice(lo, PROMPT)), out_cache_loc[offset : offset + n])
        offset += n
    if akv:
        host_rows.record(reqs, prefix_lens, extend_lens, out_cache_loc)
    spent["extend"] += time.perf_counter() - t

    t = time.perf_counter()
    for i, req in enumerate(reqs):
        req.output_ids.append(int(outputs[i, 0]))
        cache.cache_unfinished_req(req)
    spent["after_prefill"] += time.perf_counter() - t

    t = time.perf_counter()
    indices = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)
    for step in range(OUTPUT):
        column = PROMPT + step
        loc = alloc_token_slots(cache, N)
        pool.write((indices, torch.full((N,), column, dtype=torch.int64)), loc.to(torch.int32))
        if akv:
            host_rows.record(reqs, [column] * N, [1] * N, loc)
        for i, req in enumerate(reqs):
            req.output_ids.append(int(outputs[i, step + 1]))
    spent["decode"] += time.perf_counter() - t

    t = time.perf_counter()
    for req in reqs:
        cache.cache_finished_req(req, kv_len_to_handle=PROMPT + OUTPUT)
        pool.free(req)
    spent["finish"] += time.perf_counter() - t
    return spent, prefix_lens


def _prompts(rng: np.random.Generator) -> tuple[list[array], np.ndarray]:
    prompts = [array("q", np.concatenate([np.arange(SHARED), rng.integers(100, 150_000, PROMPT - SHARED)]).tolist())
               for _ in range(N)]
    return prompts, rng.integers(100, 150_000, (N, OUTPUT + 1))


def _server_args() -> ServerArgs:
    """The process-wide ``ServerArgs`` the way SGLang's scheduler publishes them (``AkvRadixCache``
    reads its metrics flags there); a tiny model gives ``ServerArgs`` a config to read."""
    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="plain-backend-")) / "tiny-qwen3", seed=3)
    args = ServerArgs(model_path=str(model), device="cpu", attention_backend="triton", page_size=1,
                      radix_cache_backend="akv", disable_cuda_graph=True)
    set_global_server_args_for_scheduler(args)
    return args


def main(args: argparse.Namespace) -> int:
    head = results.header("bench/plain_backend.py")  # before the work: the load average at the start
    _server_args()
    timed: dict[str, list[dict[str, float]]] = {"stock": [], "akv": []}
    for repeat in range(args.repeats):
        caches = {kind: make_cache(kind) for kind in timed}
        for b in range(args.bursts):
            prompts, outputs = _prompts(np.random.default_rng(1000 * repeat + b))
            order = list(timed) if (repeat + b) % 2 == 0 else list(reversed(timed))
            matched = {}
            for kind in order:
                spent, matched[kind] = burst(caches[kind], prompts, outputs)
                if b:
                    timed[kind].append(spent)
            if matched["stock"] != matched["akv"]:
                raise AssertionError(f"matched prefixes differ: stock {matched['stock']}, akv {matched['akv']}")
            print(f"repeat {repeat} burst {b}: " + ", ".join(
                f"{kind} {1e3 * sum(timed[kind][-1].values()):.1f} ms" for kind in timed) if b else
                f"repeat {repeat} burst {b}: untimed", file=sys.stderr, flush=True)
    medians = {kind: {"median_ms_per_burst": round(1e3 * statistics.median(sum(s.values()) for s in runs), 2),
                      "median_ms_per_phase": {ph: round(1e3 * statistics.median(s[ph] for s in runs), 2)
                                              for ph in PHASES}}
               for kind, runs in timed.items()}
    report = {
        **head, "requests_per_burst": N, "prompt_tokens": PROMPT, "shared_prefix_tokens": SHARED, "output_tokens": OUTPUT,
        "timed_bursts": len(timed["stock"]),
        **medians,
        "akv_over_stock": round(medians["akv"]["median_ms_per_burst"] / medians["stock"]["median_ms_per_burst"], 3),
        "akv_minus_stock_ms": round(medians["akv"]["median_ms_per_burst"] - medians["stock"]["median_ms_per_burst"], 2),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    results.show(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
