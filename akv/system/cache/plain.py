"""Plain requests on the cache core: the prefix resident at each token's own position, and the
publication of a request's KV (its own slots adopted, inserted under its tokens, handed to the tree
or back to the pool)."""

from __future__ import annotations

import numpy as np

from akv.system.arrays import first_true
from akv.system.cache.core import CacheCore
from akv.system.cache.keys import plain_key


def resident_prefix(core: CacheCore, ids: np.ndarray, namespace: str) -> np.ndarray:
    """Slots of the longest prefix of ``ids`` resident at the tokens' own positions (0, 1, ...)."""
    match = core.resident(plain_key(ids, namespace))
    exact = (match.slots >= 0) & (match.positions == np.arange(match.n_tokens)[:, None])
    found, col = first_true(exact)
    n = int(np.argmin(found)) if not found.all() else found.size
    return match.slots[np.arange(n), col[:n]].astype(np.int64)


def publish(core: CacheCore, row: np.ndarray, protected: int, ids: np.ndarray | None, namespace: str) -> np.ndarray:
    """``row[protected:]`` are the request's own slots: inserted with the rest of ``row`` under
    ``ids`` (None: not inserted), then the request's references dropped (a slot the tree did not
    take is freed). Returns the slots now resident for the row's tokens at their own positions
    (what :func:`resident_prefix` finds for ``ids[:row.size]``; empty when not inserted)."""
    own = row[protected:]
    core.pool.adopt(own)
    resident = np.zeros(0, dtype=np.int64)
    if ids is not None and row.size:
        positions = np.arange(row.size, dtype=np.int64)
        resident = core.tree.insert(plain_key(ids[: row.size], namespace), row[:, None], positions[:, None],
                                    positions)[:, 0]
    core.pool.decref(own)
    return resident
