"""Tensor-parallel plan check (debug, off by default: ``AKV_TP_PLAN_CHECK=1``).

Under TP every rank's scheduler matches and plans its own copy of each context request, and every
rank must reach the same positions, visibility rows, KV-list sizes and copy jobs (slot indices are
the same on every rank; each rank applies them to its own KV heads). With the check on, each
context forward's plan is hashed and the digests are compared across the TP group's CPU group; a
difference stops the server with the ranks' digests instead of serving diverging KV.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

ENV = "AKV_TP_PLAN_CHECK"


class PlanDrift(RuntimeError):
    """Ranks planned the same forward differently."""


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def digest(*arrays: np.ndarray) -> str:
    """SHA-256 over the arrays' shapes, dtypes and bytes, in order."""
    h = hashlib.sha256()
    for array in arrays:
        a = np.ascontiguousarray(array)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def compare(value: str, group: Any) -> None:
    """Gather ``value`` from every rank of ``group`` (a torch.distributed CPU group); raise
    :class:`PlanDrift` on every rank when they differ."""
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    if len(set(values)) > 1:
        raise PlanDrift(f"AKV: TP ranks planned one forward differently: digests {values}")


def check_plan(*arrays: np.ndarray) -> None:
    """The check for one forward's plan (no-op unless enabled; hashed but not compared on one rank)."""
    if not enabled():
        return
    from sglang.srt.distributed.parallel_state import get_tp_group

    value = digest(*arrays)
    group = get_tp_group()
    if group.world_size > 1:
        compare(value, group.cpu_group)
