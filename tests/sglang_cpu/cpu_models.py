"""Test-side stand-ins that let SGLang's MiniMax-M2 module run on the CPU (nothing here changes
SGLang's wheel; the scheduler driver and the HTTP test's ``sitecustomize`` install it).

MiniMax-M2's QK RMSNorm (over all heads of a rank) runs two Triton wrappers,
``rms_sumsq_serial`` and ``rms_apply_serial``, that assert their inputs are CUDA tensors; on a CPU
without AMX nothing else is offered. The stand-ins compute the same sums and scaling in FP32 with
torch, in the wrappers' own output layout (sums of q rows, then of k rows, padded to a multiple of 4).
"""

from __future__ import annotations

from typing import Any

import torch


def rms_sumsq(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    sums = torch.cat([x1.float().pow(2).sum(-1), x2.float().pow(2).sum(-1)])
    return torch.nn.functional.pad(sums, (0, -sums.numel() % 4))


def rms_apply(x1: torch.Tensor, x2: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, sum_sq: torch.Tensor,
              tp_world: int = 1, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x1.shape[0]
    inv1 = torch.rsqrt(sum_sq[:rows] / x1.shape[1] / tp_world + eps)[:, None]
    inv2 = torch.rsqrt(sum_sq[rows : 2 * rows] / x2.shape[1] / tp_world + eps)[:, None]
    return (x1.float() * inv1 * w1.float()).to(x1.dtype), (x2.float() * inv2 * w2.float()).to(x2.dtype)


def install(minimax_m2: Any = None) -> None:
    """Put the stand-ins into SGLang's MiniMax-M2 module (``minimax_m2``: that module, imported here if None)."""
    if minimax_m2 is None:
        import sglang.srt.models.minimax_m2 as minimax_m2

    minimax_m2.rms_sumsq_serial = rms_sumsq
    minimax_m2.rms_apply_serial = rms_apply
