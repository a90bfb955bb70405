"""Positions and visibility implied by the events, checked on a hand-worked example and on bad input."""

from __future__ import annotations

import pytest

from akv.system.reference.oracle import Drop, Repos, simulate_layout


def test_hand_worked_layout() -> None:
    # tokens 0-3 at positions 0-3; drop {1, 2} and compact: 0 -> 0, 3 -> 1; tokens 4-6 at 2-4;
    # drop {4}; tokens 7-8 at 5-6; compact: 0,3,5,6,7,8 -> 0..5; token 9 at 6.
    events = [Drop(4, (1, 2)), Repos(4), Drop(7, (4,)), Repos(9)]
    layout = simulate_layout(10, events)
    assert layout.birth_position.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 6, 6]
    assert layout.birth_stage.tolist() == [0, 0, 0, 0, 2, 2, 2, 3, 3, 4]
    assert layout.final_position.tolist() == [0, -1, -1, 1, -1, 2, 3, 4, 5, 6]
    assert layout.keep.tolist() == [True, False, False, True, False, True, True, True, True, True]
    assert layout.visible_until.tolist() == [10, 4, 4, 10, 7, 10, 10, 10, 10, 10]
    assert layout.next_position == 7
    assert layout.stage_positions.tolist() == [
        [0, 1, 2, 3, -1, -1, -1, -1, -1, -1],
        [0, -1, -1, 3, -1, -1, -1, -1, -1, -1],
        [0, -1, -1, 1, 2, 3, 4, -1, -1, -1],
        [0, -1, -1, 1, -1, 3, 4, 5, 6, -1],
        [0, -1, -1, 1, -1, 2, 3, 4, 5, 6],
    ]


def test_events_at_the_ends_and_repeated_drops() -> None:
    layout = simulate_layout(4, [Repos(0), Drop(2, (0,)), Drop(2, (0, 1)), Drop(4, (3,)), Repos(4)])
    assert layout.birth_position.tolist() == [0, 1, 2, 3]  # drops never move positions
    assert layout.birth_stage.tolist() == [1, 1, 3, 3]
    assert layout.visible_until.tolist() == [2, 2, 4, 4]
    assert layout.final_position.tolist() == [-1, -1, 0, -1]
    assert layout.next_position == 1


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([Drop(3, (3,))], r"events\[0\].tokens must be ints in \[0, 3\), got 3"),
        ([Drop(3, (-1,))], r"events\[0\].tokens must be ints in \[0, 3\), got -1"),
        ([Repos(6)], r"events\[0\].at must be an int in \[0, 5\], got 6"),
        ([Repos(True)], r"events\[0\].at must be an int in \[0, 5\], got True"),
        ([Repos(3), Drop(2, (0,))], r"events\[1\].at must not decrease, got 2 after 3"),
    ],
)
def test_bad_events_name_the_event(events: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate_layout(5, events)


def test_unknown_event_type_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"events\[0\] must be Drop or Repos, got tuple"):
        simulate_layout(5, [(1, 2)])  # type: ignore[list-item]


def test_numpy_integers_are_accepted_as_plain_ints() -> None:
    import numpy as np

    layout = simulate_layout(3, [Drop(np.int64(2), (np.int64(0),)), Repos(np.int32(2))])
    assert layout.final_position.tolist() == [-1, 0, 1]
    assert layout.birth_position.tolist() == [0, 1, 1]
