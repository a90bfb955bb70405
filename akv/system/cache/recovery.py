"""Which queries must run, and how they split into segmented-prefill forwards.

A query must run when its KV is needed but not resident: the last prompt token (for the next
token's logits) always runs; a token without resident KV runs when a query that runs, or generation,
reads it (``visible_until`` says who reads what). That is the least set closed under "needed by a
needed query", so nothing resident is recomputed and nothing unread is computed. Runs of such
queries are cut at every stage change and every resident gap, so each forward sees exactly the keys
its queries saw originally: earlier visible keys (resident or computed before) plus causal keys
inside the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from akv.system.context.program import ContextProgram


@dataclass(frozen=True)
class SegmentSpan:
    """Queries ``start .. end - 1``, all at stage ``stage``."""

    start: int
    end: int
    stage: int


def needed_queries(program: ContextProgram, resident: np.ndarray) -> np.ndarray:
    """Bool mask over the program's tokens: queries that must run given ``resident`` (a mask over a
    prefix of the tokens; tokens past it count as not resident)."""
    n = program.n_tokens
    if n == 0:
        raise ValueError("program: has no tokens; a request needs at least one token to run")
    if resident.ndim != 1 or resident.shape[0] > n:
        raise ValueError(f"resident: expected a 1-D mask of at most {n} tokens, got shape {resident.shape}")
    missing = np.ones(n, dtype=bool)
    missing[: resident.shape[0]] = ~resident
    needed = missing & program.keep
    needed[n - 1] = True
    # a missing token not needed yet becomes needed once a needed query after it reads it
    candidates = np.flatnonzero(missing & ~needed)
    while candidates.size:
        readers = np.flatnonzero(needed)
        after = np.searchsorted(readers, candidates, side="right")
        next_reader = np.where(after < readers.size, readers[np.minimum(after, readers.size - 1)], n)
        grow = next_reader < program.visible_until[candidates]
        if not grow.any():
            break
        needed[candidates[grow]] = True
        candidates = candidates[~grow]
    return needed


def segment_spans(program: ContextProgram, needed: np.ndarray) -> tuple[SegmentSpan, ...]:
    """Maximal runs of consecutive needed queries that share a stage, in order."""
    idx = np.flatnonzero(needed)
    if idx.size == 0:
        return ()
    stages = program.birth_stage[idx]
    cut = np.flatnonzero((np.diff(idx) != 1) | (np.diff(stages) != 0)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [idx.size]])
    return tuple(
        SegmentSpan(int(idx[a]), int(idx[b - 1]) + 1, int(stages[a])) for a, b in zip(starts.tolist(), ends.tolist())
    )
