"""Slot recycling inside one request: versions alive at a common step never share a slot."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.occurrence import recycle_slots

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
