"""Copies re-rotate from the version stored at the token's birth position even when it is not the
first resident version (as happens once requests overlap and stale versions are evicted): keys
are rotated once from where they were computed, never from an already re-rotated copy."""

from __future__ import annotations

import numpy as np

from akv.system.cache.occurrence import plan_occurrences
from akv.system.cache.plan import MatchResult

from .conversations import Conversation

MESSAGES = ((1, 2), (3, 4), (5, 6), (7,))


def test_copies_read_the_birth_version_wherever_it_sits() -> None:
    """Messages 1 and 2 move to positions 0..3 after message 0 is dropped at anchor 2. Each of their
    tokens is resident twice: first re-rotated to an unrelated position, then at its birth position.
    Every copy must take the second."""
    program = Conversation(MESSAGES, {2: (0,)}, (2,)).program(3)
    n_matched = 6
    slots = np.full((n_matched, 2), -1, dtype=np.int64)
    positions = np.full_like(slots, -1)
    for t in range(n_matched):
        slots[t] = [100 + t, 200 + t]
        positions[t] = [40 + t, program.birth_position[t]]
    draft = plan_occurrences(program, MatchResult.of(n_matched, n_matched, slots, positions))
    jobs = [job for job in draft.plan.copies if job.size]
    moved = np.concatenate([job.tokens for job in jobs])
    assert sorted(moved.tolist()) == [2, 3, 4, 5], "messages 1 and 2 are re-rotated"
    for job in jobs:
        assert (job.src == 200 + job.tokens).all(), "a copy read the re-rotated version"
        assert (job.old_positions == program.birth_position[job.tokens]).all()
