"""Record keys: plain requests keep plain token keys; event histories separate identical text; a key's
versions spread to its records, and the row-wise mask search."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.keys import DROP_CLOSE, DROP_OPEN, REPOS, CacheKeyError, plain_key, program_key

from .conversations import Conversation

MESSAGES = ((5, 6), (7, 8, 9), (10,), (11, 12))


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    k = min(a.size, b.size)
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if diff.size else k


def test_plain_program_key_is_the_token_ids() -> None:
    program = Conversation(MESSAGES, {}, ()).program(3)
    key = program_key(program)
    assert key.records.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert key.token_record.tolist() == list(range(8))
    assert key.records.tolist() == plain_key(np.array([5, 6, 7, 8, 9, 10, 11, 12])).records.tolist()


def test_drop_and_repos_records_sit_where_the_events_apply() -> None:
    program = Conversation(MESSAGES, {2: (1,)}, (2,)).program(3)
    key = program_key(program)
    # message 1 owns tokens 2..4: the Drop hides [2, 5) after token 5 (end of message 2)
    assert key.records.tolist() == [5, 6, 7, 8, 9, 10, DROP_OPEN, -(2 + 8), -(5 + 8), DROP_CLOSE, REPOS, 11, 12]
    assert key.token_record.tolist() == [0, 1, 2, 3, 4, 5, 11, 12]


def test_same_text_with_other_history_diverges_at_the_first_event() -> None:
    a = program_key(Conversation(MESSAGES, {2: (1,)}, ()).program(3))
    b = program_key(Conversation(MESSAGES, {2: (0,)}, ()).program(3))
    plain = program_key(Conversation(MESSAGES, {}, ()).program(3))
    assert _first_difference(a.records, b.records) == 7  # inside the Drop records, after its open marker
    assert a.tokens_within(7) == b.tokens_within(7) == 6
    assert _first_difference(a.records, plain.records) == 6
    assert plain.tokens_within(6) == 6


def test_events_that_change_nothing_leave_no_record() -> None:
    repos_only = program_key(Conversation(MESSAGES, {}, (1, 2)).program(3))
    assert repos_only.records.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    twice = program_key(Conversation(MESSAGES, {1: (0,)}, (1, 2)).program(3))
    assert (twice.records == REPOS).sum() == 1


def test_repos_after_dropping_the_newest_message_counts() -> None:
    """Dropping the tokens just appended moves no token, but the next position still changes."""
    program = Conversation(MESSAGES, {1: (1,)}, (1,)).program(2)
    assert program.birth_position[5] == 2
    assert (program_key(program).records == REPOS).sum() == 1


def test_with_tokens_appends_records() -> None:
    key = program_key(Conversation(MESSAGES, {2: (1,)}, (2,)).program(2))
    longer = key.with_tokens(np.array([3, 4]))
    assert longer.records[-2:].tolist() == [3, 4]
    assert longer.token_record[-2:].tolist() == [key.records.size, key.records.size + 1]


@pytest.mark.parametrize("bad, message", [
    (np.array([1, -4]), r"token_ids\[1\]: negative token id -4"),
    (np.array([[1, 2]]), r"token_ids: expected a 1-D array"),
    (np.array([1.5]), r"token_ids: expected integers"),
])
def test_bad_token_ids_are_named(bad: np.ndarray, message: str) -> None:
    with pytest.raises(CacheKeyError, match=message):
        plain_key(bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(0, 2), st.integers(1, 3))
def test_rows_spread_to_their_records_as_by_fancy_indexing(gaps: list[int], tail: int, width: int) -> None:
    """The tree's per-record rows of a key's versions (``_spread``) against fancy-index assignment by
    ``token_record``: token ``i`` is preceded by ``gaps[i]`` event records, ``tail`` more end the key."""
    from akv.system.cache.tree import _spread

    token_record = np.cumsum(np.asarray(gaps, dtype=np.int64) + 1) - 1
    n_records = (int(token_record[-1]) + 1 if gaps else 0) + tail
    values = np.random.default_rng(len(gaps) + width).integers(-1, 50, size=(len(gaps), width))
    expected = np.full((n_records, width), -1, dtype=np.int64)
    expected[token_record] = values
    assert np.array_equal(_spread(values, token_record, n_records), expected)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 30), st.integers(0, 4), st.integers(0, 10_000))
def test_first_true_is_any_and_argmax_along_rows(rows: int, width: int, seed: int) -> None:
    from akv.system.arrays import first_true

    mask = np.random.default_rng(seed).random((rows, width)) < 0.3
    found, col = first_true(mask)
    assert found.tolist() == mask.any(axis=1).tolist()
    assert col.tolist() == (mask.argmax(axis=1).tolist() if width else [0] * rows)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 20), max_size=12), st.lists(st.integers(-3, 20), max_size=12))
def test_in_sorted_is_isin(values: list[int], x: list[int]) -> None:
    from akv.system.arrays import in_sorted

    sorted_values, probe = np.sort(np.asarray(values, dtype=np.int64)), np.asarray(x, dtype=np.int64)
    assert in_sorted(sorted_values, probe).tolist() == np.isin(probe, sorted_values).tolist()
