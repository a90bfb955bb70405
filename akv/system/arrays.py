"""Read-only numpy arrays, the form plan and program objects hold; row-wise search of narrow masks;
membership in a sorted array."""

from __future__ import annotations

import numpy as np


def frozen(arr: np.ndarray, dtype: np.dtype | type | None = None) -> np.ndarray:
    """A contiguous, read-only array of ``arr`` (converted to ``dtype`` when given)."""
    out = np.ascontiguousarray(arr, dtype=dtype)
    out.flags.writeable = False
    return out


def first_true(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a 2-D boolean mask: whether any entry is set, and the first set column (0 if none),
    as ``mask.any(axis=1)`` and ``mask.argmax(axis=1)``; column by column, since the cache's tables
    have a few columns and numpy's reductions along a short last axis are ~10x slower there."""
    found = np.zeros(mask.shape[0], dtype=bool)
    col = np.zeros(mask.shape[0], dtype=np.int64)
    for j in range(mask.shape[1] - 1, -1, -1):
        column = mask[:, j]
        col[column] = j
        found |= column
    return found, col


def in_sorted(sorted_values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``np.isin(x, sorted_values)`` for an ascending ``sorted_values``: one binary search per entry,
    so a caller testing many arrays against one set sorts it once."""
    if sorted_values.size == 0:
        return np.zeros(np.shape(x), dtype=bool)
    at = np.minimum(np.searchsorted(sorted_values, x), sorted_values.size - 1)
    return sorted_values[at] == x
