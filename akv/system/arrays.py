"""Read-only numpy arrays, the form plan and program objects hold."""

from __future__ import annotations

import numpy as np


def frozen(arr: np.ndarray, dtype: np.dtype | type | None = None) -> np.ndarray:
    """A contiguous, read-only array of ``arr`` (converted to ``dtype`` when given)."""
    out = np.ascontiguousarray(arr, dtype=dtype)
    out.flags.writeable = False
    return out
