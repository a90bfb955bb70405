"""Compile every kernel for the H200 (sm_90) with the arguments its wrapper passes, without a GPU.

Run as a script in a process where Triton is *not* in interpreter mode; it prints a JSON object
``{case: {"vector_loads", "vector_stores", "b16_loads", "b16_stores"}}`` counted in the PTX.
Launches are intercepted (nothing runs) and handed to Triton's ahead-of-time compiler."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from akv.system.kernels import kv_indices, launch_device, rerotate
from akv.system.kernels.kv_indices import HiddenRanges, KeepMask, VisibleUntil
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rope_spec import RopeSpec, RopeTable

H200 = GPUTarget("cuda", 90, 32)
_TYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
               torch.int64: "i64", torch.uint8: "u8"}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextmanager
def _recorded(module: Any, name: str) -> Iterator[_Recorder]:
    original = getattr(module, name)
    recorder = _Recorder(original)
    setattr(module, name, recorder)
    try:
        yield recorder
    finally:
        setattr(module, name, original)


def _ptx(kernel: Any, args: tuple, kwargs: dict) -> str:
    """Compile one call the way Triton specialises a launch: pointers and integers divisible by 16
    are marked so."""
    constexprs = dict(kwargs)
    options = {key: constexprs.pop(key) for key in ("num_warps", "num_stages") if key in constexprs}
    signature, attrs = {}, {}
    for index, (name, value) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPE_NAMES[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=H200, options=options)
    if not compiled.asm["cubin"]:
        raise RuntimeError(f"{kernel.__name__}: no cubin")
    return compiled.asm["ptx"]


def _counts(ptx: str) -> dict[str, int]:
    return {
        "vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v[24]", ptx)),
        "vector_stores": len(re.findall(r"st\.global(?:\.\w+)*\.v[24]", ptx)),
        "b16_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b16\b", ptx)),
        "b16_stores": len(re.findall(r"st\.global(?:\.\w+)*\.b16\b", ptx)),
    }


def _compile_recorded(recorder: _Recorder) -> dict[str, int]:
    totals: dict[str, int] = {}
    for args, kwargs in recorder.calls:
        for key, value in _counts(_ptx(recorder.kernel, args, kwargs)).items():
            totals[key] = totals.get(key, 0) + value
    return totals


def _rerotation(name: str, dtype: torch.dtype, n_copies: int, layers: int, heads: int, head_dim: int,
                rotary_dim: int, neox: bool) -> tuple[str, dict[str, int]]:
    k = LayerBuffers.of(torch.empty(layers, 64, heads, head_dim, dtype=dtype))
    v = LayerBuffers.of(torch.empty(layers, 64, heads, head_dim, dtype=dtype))
    index = torch.zeros(n_copies, dtype=torch.int64)
    rope = RopeTable.build(RopeSpec(theta=1e6, head_dim=head_dim, rotary_dim=rotary_dim, neox=neox), 16)
    with _recorded(rerotate, "_rerotate_kernel") as recorder:
        rerotate.rerotate_kv(k, v, index, index + 1, index, index, rope, validate=False)
    return name, _compile_recorded(recorder)


def run() -> dict[str, dict[str, int]]:
    launch_device.INTERPRETED = True  # launches are intercepted, so CPU tensors are fine here
    results = dict(
        _rerotation(f"rerotate_qwen3_8b_{str(dtype)[6:]}_{n}", dtype, n, 36, 8, 128, 128, True)
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
        for n in (1024, 65536)
    )
    results.update([_rerotation("rerotate_gptj_partial_bf16", torch.bfloat16, 4, 3, 4, 80, 40, False)])
    req_to_token = torch.zeros(4, 256, dtype=torch.int32)
    rows, lens = torch.arange(3), torch.full((3,), 100, dtype=torch.int32)
    out = torch.empty(1024, dtype=torch.int64)
    visibilities = {
        "all": None,
        "keep_mask": KeepMask(torch.ones(4, 256, dtype=torch.bool), rows),
        "visible_until": VisibleUntil(torch.zeros(4, 256, dtype=torch.int32), rows, lens),
        "hidden_ranges": HiddenRanges(torch.tensor([0, 1, 1, 2]), torch.tensor([[3, 9], [0, 4]], dtype=torch.int32)),
    }
    for name, visibility in visibilities.items():
        with (_recorded(kv_indices, "_count_columns_kernel") as count,
              _recorded(kv_indices, "_fill_columns_kernel") as fill,
              _recorded(kv_indices, "_fill_gaps_kernel") as gaps):
            kv_indices.visible_kv_indices(req_to_token, rows, lens, visibility, out=out, validate=False)
        calls = len(count.calls) + len(fill.calls) + len(gaps.calls)
        results[f"kv_indices_{name}"] = {"kernels": calls, **_compile_recorded(count), **_compile_recorded(fill),
                                         **_compile_recorded(gaps)}
    return results


if __name__ == "__main__":
    json.dump(run(), sys.stdout)
