"""Slot recycling inside one request: versions alive at a common step never share a slot."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from akv.system.cache.core import CacheCore
from akv.system.cache.occurrence import recycle_slots
from akv.system.cache.pool import SlotPool

from .conversations import Conversation, conversations

FOREVER = np.iinfo(np.int64).max


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.one_of(st.integers(0, 6), st.none())), max_size=30))
def test_recycled_slots_never_overlap_and_match_the_peak(raw: list[tuple[int, int | None]]) -> None:
    """Version ``k`` is written at step ``a`` and last read at ``a + b`` (``None``: kept to the end)."""
    spans = sorted((a, 99 if b is None else a + b) for a, b in raw)
    created = np.array([a for a, _ in spans], dtype=np.int64)
    last_use = np.array([FOREVER if b == 99 else b for _, b in spans], dtype=np.int64)
    colors, n_colors = recycle_slots(created, last_use)
    for i, (a, b) in enumerate(spans):
        for j, (c, d) in enumerate(spans[:i]):
            if a <= d and c <= b:
                assert colors[i] != colors[j], f"versions {j} and {i} are both alive but share slot {colors[i]}"
    peak = max((sum(a <= t <= b for a, b in spans) for t in range(100)), default=0)
    assert n_colors == peak
    assert ((colors >= 0) & (colors < n_colors)).all()


def test_a_slot_frees_only_after_its_last_read() -> None:
    colors, n = recycle_slots(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 2]))
    assert n == 2
    assert colors[2] == colors[0] and colors[3] in (colors[0], colors[1]) and colors[1] != colors[2]


# Found by search: the last request's cold plan gives a later segment's copy the slot of a copy an
# earlier segment read.
RECYCLING = Conversation(((1,), (2,), (0,), (1,), (1, 0, 0, 1, 1), (2, 1), (0, 1, 0, 2), (1,), (0, 2, 2, 2, 0)),
                         {0: (0,), 3: (1,), 4: (4,), 5: (2, 5), 7: (3,), 8: (7,)}, (4, 6))


@settings(max_examples=150, deadline=None)
@example(RECYCLING, 8)
@given(conversations(max_messages=9), st.integers(0, 8))
def test_a_drafts_shared_segments_name_a_slot_exactly_as_binding_does(conv: Conversation, turn: int) -> None:
    """Before commit, an engine reads which entries will share a slot from the draft (a round must
    stop before a copy that reuses a slot it reads): two entries carry the same id in
    ``shared_segments`` exactly when the bound plan gives them the same real slot. On an empty
    cache every segment is computed, so a request makes the most copies."""
    draft = CacheCore(SlotPool(4096)).match(conv.program(min(turn, conv.n_turns - 1)))
    bound = draft.plan.bind_copies(np.arange(1000, 1000 + draft.plan.n_copy_slots, dtype=np.int64)).segments
    shared = draft.plan.shared_segments()
    ids = np.concatenate([np.concatenate([s.prefix_slots, s.copies.dst]) for s in shared])
    real = np.concatenate([np.concatenate([s.prefix_slots, s.copies.dst]) for s in bound])
    assert np.array_equal(ids[:, None] == ids[None, :], real[:, None] == real[None, :])
