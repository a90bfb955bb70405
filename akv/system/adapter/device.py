"""Host arrays onto the KV device from the scheduler side of the adapter."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def to_device(values: np.ndarray, device: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host array on the device, queued on the current (scheduler) stream without waiting for it:
    SGLang orders that stream's work after the in-flight forward's reads (its WAR barrier), so the
    forward being overlapped never sees a context request's next writes."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype, non_blocking=True)
