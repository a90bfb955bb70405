"""Check plan copy jobs against the Triton re-rotation kernel's input contract (no GPU needed)."""

from __future__ import annotations

import torch

from akv.system.cache.plan import CopyJob
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import check_copies
from akv.system.kernels.rope_spec import RopeSpec, RopeTable

_SPEC = RopeSpec(theta=10000.0, head_dim=4, rotary_dim=4)


def assert_kernel_accepts(job: CopyJob, n_slots: int, max_position: int = 256) -> None:
    """``check_copies`` raises for anything the kernel cannot run safely (dst written twice, a dst that
    is another copy's src, out-of-range slots or positions)."""
    buffers = LayerBuffers.of([torch.zeros(n_slots + 1, 1, 4)])
    src, dst, old, new = (torch.from_numpy(a.copy()) for a in (job.src, job.dst, job.old_positions, job.new_positions))
    check_copies(buffers, buffers, src, dst, old, new, RopeTable.build(_SPEC, max_position))
