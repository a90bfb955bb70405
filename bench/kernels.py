"""Kernel benchmarks for the H200, every comparison measured side by side in one run.

1. RoPE re-rotation of a Qwen3-8B-shaped cache (36 layers, 8 KV heads, head_dim 128, bf16, one
   buffer per layer) for 1k..256k moved tokens, against a torch device-to-device copy of the same
   bytes: ``in_place`` rewrites K only; ``moved`` writes K and V to other slots (the dropped half).
   Bytes = read + write. Also a sweep of launch shapes at 32k and 256k tokens.
2. Building the visible index lists for a decode batch (keep mask, half dropped) against the
   all-visible fill SGLang does today.
3. Decode attention (one layer, 32 query heads) over N live tokens whose slots are scattered
   (half of 2N slots dropped) against the same N tokens in contiguous slots, and against the full
   2N tokens: SGLang's triton ``decode_attention_fwd`` and FlashInfer's
   ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores, as SGLang uses for this shape).

Writes JSON (with the command) to ``--out``, else ``$OUT/kernels.json``, else
``bench/results/kernels-h200.json``. ``--smoke`` runs tiny sizes (also on CPU, Triton interpreter)
to check the script itself; its numbers mean nothing.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli
from akv.system.kernels.kv_indices import KeepMask, decode_kv_indices
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import RerotateLaunch, rerotate_kv
from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from bench.harness import results

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 36, 8, 32, 128
QWEN3 = RopeSpec(theta=1_000_000.0, head_dim=HEAD_DIM, rotary_dim=HEAD_DIM)


def timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds per call (CUDA events through ``triton.testing.do_bench``; wall clock on CPU)."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class Pool:
    """A stacked K/V allocation ``[2, layers, slots, heads, dim]`` seen as per-layer buffers, so a
    copy of the same bytes can run inside the same memory."""

    def __init__(self, layers: int, slots: int, heads: int, dim: int, device: torch.device) -> None:
        self.memory = torch.empty(2, layers, slots, heads, dim, dtype=torch.bfloat16, device=device)
        self.k = LayerBuffers.of(list(self.memory[0].unbind(0)))
        self.v = LayerBuffers.of(list(self.memory[1].unbind(0)))
        self.flat = self.memory.view(-1)

    def copy_same_bytes(self, n_bytes: int) -> Callable[[], Any]:
        elements = n_bytes // self.memory.element_size()
        if 2 * elements > self.flat.numel():
            raise ValueError(f"copy of {n_bytes} bytes does not fit twice in the pool")
        source, target = self.flat[:elements], self.flat[elements : 2 * elements]
        return lambda: target.copy_(source)


def rerotation_case(pool: Pool, rope: RopeTable, n: int, moved: bool, device: torch.device,
                    launch: RerotateLaunch | None = None) -> tuple[Callable[[], None], int]:
    """Half of slots ``1 .. 2n`` survive; they move to the dropped half or are rewritten in place."""
    gen = torch.Generator(device=device).manual_seed(n)
    order = torch.randperm(2 * n, device=device, generator=gen) + 1
    survivors = order[:n].sort().values
    dst = order[n:].sort().values if moved else survivors
    old = survivors.clone()
    new = torch.arange(n, device=device)
    row_bytes = pool.k.row_bytes + (pool.v.row_bytes if moved else 0)
    n_bytes = n * pool.k.n_layers * row_bytes

    def run() -> None:
        rerotate_kv(pool.k, pool.v, survivors, dst, old, new, rope, validate=False, launch=launch)

    return run, n_bytes


def bench_rerotation(sizes: list[int], sweep_sizes: list[int], layers: int, device: torch.device) -> dict[str, Any]:
    pool = Pool(layers, 2 * max(sizes) + 1, KV_HEADS, HEAD_DIM, device)
    rope = RopeTable.build(QWEN3, 2 * max(sizes) + 2, device)
    rows = []
    for moved in (False, True):
        for n in sizes:
            run, n_bytes = rerotation_case(pool, rope, n, moved, device)
            rerotate_ms = timed_ms(run, device)
            copy_ms = timed_ms(pool.copy_same_bytes(n_bytes), device)
            rows.append({
                "mode": "moved" if moved else "in_place",
                "tokens": n,
                "bytes_read_plus_written": 2 * n_bytes,
                "launch": vars(RerotateLaunch.default(n, pool.k)),
                "rerotate_ms": rerotate_ms,
                "copy_ms": copy_ms,
                "rerotate_tb_per_s": 2 * n_bytes / rerotate_ms / 1e9,
                "copy_tb_per_s": 2 * n_bytes / copy_ms / 1e9,
                "fraction_of_copy_bandwidth": copy_ms / rerotate_ms,
            })
            print(f"rerotate {rows[-1]['mode']:8s} {n:7d} tokens: {rerotate_ms:.3f} ms vs copy {copy_ms:.3f} ms "
                  f"({rows[-1]['fraction_of_copy_bandwidth']:.2f} of copy bandwidth)", flush=True)
    sweep = []
    for moved in (False, True):
        for n in sweep_sizes:
            default = RerotateLaunch.default(n, pool.k)
            launches = [RerotateLaunch(block, default.layers_per_program, warps) for block in (4, 8, 16) for warps in (4, 8)]
            launches += [RerotateLaunch(default.block_copies, per_program, default.num_warps) for per_program in (1, 4)]
            for launch in launches:
                run, n_bytes = rerotation_case(pool, rope, n, moved, device, launch)
                ms = timed_ms(run, device)
                sweep.append({"mode": "moved" if moved else "in_place", "tokens": n, "launch": vars(launch),
                              "rerotate_ms": ms, "rerotate_tb_per_s": 2 * n_bytes / ms / 1e9})
    return {"shape": {"layers": layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
            "rows": rows, "launch_sweep": sweep}


def scattered_and_contiguous(batch: int, live: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Per request a private region of ``2 * live`` slots: ``contiguous`` reads its first ``live``
    slots, ``scattered`` a sorted random half, ``full`` all ``2 * live``."""
    gen = torch.Generator(device=device).manual_seed(batch * live)
    base = 1 + torch.arange(batch, device=device)[:, None] * (2 * live)
    half = torch.rand(batch, 2 * live, device=device, generator=gen).argsort(dim=1)[:, :live].sort(dim=1).values
    return {
        "contiguous": (base + torch.arange(live, device=device)).flatten().int(),
        "scattered": (base + half).flatten().int(),
        "full": (base + torch.arange(2 * live, device=device)).flatten().int(),
    }


def load_sglang_decode() -> Callable[..., None] | None:
    try:
        return importlib.import_module("sglang.kernels.ops.attention.decode_attention").decode_attention_fwd
    except ImportError:
        return None


def bench_decode_attention(batches: list[int], lives: list[int], device: torch.device) -> dict[str, Any]:
    decode = load_sglang_decode()
    try:
        flashinfer = importlib.import_module("flashinfer")
    except ImportError:
        flashinfer = None
    slots = 1 + max(batches) * 2 * max(lives)
    k_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, device=device).bfloat16()
    v_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, device=device).bfloat16()
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device) if flashinfer else None
    rows: list[dict[str, Any]] = []
    max_splits = 8
    for batch in batches:
        for live in lives:
            q = torch.randn(batch, Q_HEADS, HEAD_DIM, device=device).bfloat16()
            row: dict[str, Any] = {"batch": batch, "live_tokens": live}
            for layout, indices in scattered_and_contiguous(batch, live, device).items():
                per_request = indices.numel() // batch
                indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * per_request
                if decode is not None:
                    out = torch.empty(batch, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
                    logits = torch.empty(batch, Q_HEADS, max_splits, HEAD_DIM, dtype=torch.float32, device=device)
                    lse = torch.empty(batch, Q_HEADS, max_splits, dtype=torch.float32, device=device)
                    splits = torch.full((batch,), max_splits, dtype=torch.int32, device=device)
                    indices64 = indices.long()
                    row[f"triton_{layout}_ms"] = timed_ms(
                        partial(decode, q, k_pool, v_pool, out, indptr, indices64, logits, lse, splits, max_splits,
                                1.0 / math.sqrt(HEAD_DIM), 1.0, 1.0),
                        device,
                    )
                if flashinfer is not None:
                    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
                    wrapper.plan(indptr, indices, torch.ones(batch, dtype=torch.int32, device=device), Q_HEADS,
                                 KV_HEADS, HEAD_DIM, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                    paged = (k_pool.view(slots, 1, KV_HEADS, HEAD_DIM), v_pool.view(slots, 1, KV_HEADS, HEAD_DIM))
                    row[f"flashinfer_{layout}_ms"] = timed_ms(partial(wrapper.run, q, paged), device)
            for backend in ("triton", "flashinfer"):
                if f"{backend}_scattered_ms" in row:
                    row[f"{backend}_scattered_over_contiguous"] = row[f"{backend}_scattered_ms"] / row[f"{backend}_contiguous_ms"]
                    row[f"{backend}_scattered_over_full"] = row[f"{backend}_scattered_ms"] / row[f"{backend}_full_ms"]
            print("decode", json.dumps(row), flush=True)
            rows.append(row)
    return {"shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                      "triton_kv_splits": max_splits},
            "sglang_triton_available": decode is not None, "flashinfer_available": flashinfer is not None,
            "rows": rows}


def bench_index_build(batch: int, live: int, device: torch.device) -> dict[str, Any]:
    """Decode lists for ``batch`` requests of ``2 * live`` columns with half of them dropped, vs the
    all-visible fill of the same rows."""
    width = 2 * live
    gen = torch.Generator(device=device).manual_seed(7)
    req_to_token = torch.randint(1, 2**30, (batch + 1, width), dtype=torch.int32, device=device, generator=gen)
    keep = torch.rand(batch + 1, width, device=device, generator=gen) < 0.5
    rows = torch.arange(1, batch + 1, device=device)
    seq_lens = torch.full((batch,), width, device=device)
    out = torch.empty(batch * width, dtype=torch.int32, device=device)
    mask = KeepMask(keep, rows)
    return {
        "batch": batch,
        "columns_per_request": width,
        "keep_mask_ms": timed_ms(lambda: decode_kv_indices(req_to_token, rows, seq_lens, mask, out=out, validate=False), device),
        "all_visible_ms": timed_ms(lambda: decode_kv_indices(req_to_token, rows, seq_lens, None, out=out, validate=False), device),
    }


def main(argv: list[str]) -> None:
    parser = cli.parser(None, __doc__.splitlines()[0])
    parser.add_argument("--out", type=cli.new_file, help="a new JSON file (default: $OUT/kernels.json where $OUT is set, "
                                                          "else bench/results/kernels-h200.json)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script (any device)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("needs a CUDA GPU (or --smoke)")
    out = args.out or (Path(os.environ["OUT"]) / "kernels.json" if os.environ.get("OUT")
                       else Path(__file__).resolve().parent / "results" / "kernels-h200.json")
    results.refuse_existing(parser, out)
    started = time.perf_counter()
    result: dict[str, Any] = {
        **results.header("bench/kernels.py", argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": args.smoke,
    }
    if args.smoke:
        result["rerotation"] = bench_rerotation([16, 40], [16], 2, device)
        result["index_build"] = bench_index_build(2, 64, device)
        result["decode_attention"] = bench_decode_attention([1], [32], device)
    else:
        sizes = [1024, 4096, 16384, 32768, 65536, 131072, 262144]
        result["rerotation"] = bench_rerotation(sizes, [32768, 262144], LAYERS, device)
        torch.cuda.empty_cache()
        result["index_build"] = bench_index_build(8, 32768, device)
        result["decode_attention"] = bench_decode_attention([1, 8], [8192, 32768, 131072], device)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    results.write(result, out)
    print(f"wrote {out} in {result['wall_s']} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
