"""Hypothesis strategies shared by the compiler and wire tests."""

from __future__ import annotations

from hypothesis import strategies as st

History = tuple[int, list[int], dict[int, list[int]], list[int], int]


@st.composite
def histories(draw: st.DrawFn) -> History:
    """Random conversation layout (0-4 tokens per message) with a random valid op history."""
    n_messages = draw(st.integers(1, 9))
    sizes = draw(st.lists(st.integers(0, 4), min_size=n_messages + 1, max_size=n_messages + 1))
    owners = [m for m, k in enumerate(sizes) for _ in range(k)]
    dropped: set[int] = set()
    drop_message: dict[int, list[int]] = {}
    for anchor in range(n_messages):
        candidates = [m for m in range(anchor + 1) if m not in dropped]
        if candidates and draw(st.booleans()):
            chosen = draw(st.lists(st.sampled_from(candidates), min_size=1, unique=True))
            drop_message[anchor] = chosen
            dropped.update(chosen)
    reposition = sorted(draw(st.sets(st.integers(0, n_messages - 1))))
    generated = draw(st.integers(0, 3))
    return n_messages, owners, drop_message, reposition, generated
