"""Host arrays onto the KV device from the scheduler side of the adapter."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

def to_device(values: np.ndarray, device: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on the device, queued on the current (scheduler) stream without waiting for it:
    SGLang orders that stream's work after the in-flight forward's reads (its WAR barrier), so the
    forward being overlapped never sees a context request's next writes.

    On a CUDA device the array is first written to pinned memory (in the target dtype): a copy from
    pageable memory may make the driver wait for the stream, i.e. for the forward in flight, and
    torch converts a dtype on the host into a pageable temporary. The caching host allocator keeps
    that pinned block until the copy has run."""
    target = torch.empty(0, dtype=dtype).numpy().dtype if dtype is not None else None
    host = torch.from_numpy(np.ascontiguousarray(values, dtype=target))
    if torch.device(device).type == "cuda":
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        host = pinned
    return host.to(device=device, non_blocking=True)
