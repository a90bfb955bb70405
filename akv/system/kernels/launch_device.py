"""Where this process can launch the Triton kernels: CUDA tensors always, CPU tensors only when
Triton was in interpreter mode (``TRITON_INTERPRET=1``) as the kernel modules were imported."""

from __future__ import annotations

import torch
from triton import knobs

INTERPRETED = bool(knobs.runtime.interpret)


def check_launchable(tensor: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` when its device cannot run the kernels here."""
    if tensor.device.type == "cuda" or (INTERPRETED and tensor.device.type == "cpu"):
        return
    hint = " (set TRITON_INTERPRET=1 before importing akv.system.kernels)" if tensor.device.type == "cpu" else ""
    raise ValueError(f"{name} is on {tensor.device}, where these Triton kernels cannot run{hint}")
