"""Usage counters of one request (DESIGN.md §2), from what its plan reads and computes."""

from __future__ import annotations

import numpy as np

from akv.system.cache.plan import Usage


def count_usage(n_prompt: int, resident: np.ndarray, computed: np.ndarray, read: np.ndarray, rerotated: np.ndarray,
                dropped: np.ndarray) -> Usage:
    """Counts over prompt tokens. ``resident``: KV came from the tree (not recomputed); ``read``: some
    query or generation reads it; ``rerotated``: at least one read went through a re-rotated copy;
    ``dropped``: a Drop hides it, so every query after that Drop (generation's at least) skips it,
    whether this request computed it first or not; ``computed``: this request computes its KV."""
    masks = (("resident", resident), ("computed", computed), ("read", read), ("rerotated", rerotated),
             ("dropped", dropped))
    for name, mask in masks:
        if mask.shape[0] < n_prompt:
            raise ValueError(f"{name}: mask covers {mask.shape[0]} tokens, fewer than the {n_prompt} prompt tokens")
    resident, computed = resident[:n_prompt], computed[:n_prompt]
    read, rerotated = read[:n_prompt], rerotated[:n_prompt]
    reused = resident & ~computed & read
    return Usage(
        cached_tokens=int(np.count_nonzero(reused & ~rerotated)),
        repos_tokens=int(np.count_nonzero(reused & rerotated)),
        drop_skipped_tokens=int(np.count_nonzero(dropped[:n_prompt])),
        computed_tokens=int(np.count_nonzero(computed)),
    )
