"""Wire rule parsing: normalisation of valid fields and the documented error for each bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.context.rules import (
    ContextRules,
    DoubleDropError,
    Drop,
    FutureDropError,
    RuleError,
    RuleOrderError,
    RuleRangeError,
    RuleShapeError,
    RuleSizeError,
    is_plain_request,
    parse_rules,
)


def test_valid_fields_are_normalised_and_sorted_by_anchor() -> None:
    rules = parse_rules({"9": [8, 2], "4": [3, 1]}, [4, 9], n_messages=10)
    assert rules.drops == (Drop(4, (3, 1)), Drop(9, (8, 2)))
    assert rules.repositions == (4, 9)
    assert rules.dropped == frozenset({1, 2, 3, 8})
    assert rules.max_id == 9
    assert not rules.is_empty


def test_int_keys_and_tuples_are_accepted() -> None:
    assert parse_rules({3: (0,)}, (1, 3), 4) == ContextRules((Drop(3, (0,)),), (1, 3))


def test_absent_fields_mean_plain_request() -> None:
    assert parse_rules(None, None, 5) == ContextRules.EMPTY
    assert parse_rules({}, None, 5).is_empty
    assert is_plain_request(None, None)
    assert is_plain_request({}, None)
    assert not is_plain_request(None, [1])
    assert not is_plain_request({"1": [0]}, None)


def test_drop_of_the_anchor_itself_is_allowed() -> None:
    assert parse_rules({"2": [2]}, None, 3).drops == (Drop(2, (2,)),)


@pytest.mark.parametrize(
    ("drop_message", "reposition", "error", "text"),
    [
        ([["1", [0]]], None, RuleShapeError, "drop_message: expected an object, got list"),
        ({"1": 0}, None, RuleShapeError, "drop_message['1']: expected a list of message ids, got int"),
        ({"1": []}, None, RuleShapeError, "drop_message['1']: empty list"),
        ({"1": [True]}, None, RuleShapeError, "drop_message['1'][0]: message id True is a bool"),
        ({"1": [0.0]}, None, RuleShapeError, "drop_message['1'][0]: message id 0.0 is a float"),
        ({"1": ["0"]}, None, RuleShapeError, "drop_message['1'][0]: message id '0' is a str"),
        ({"01": [0]}, None, RuleShapeError, "drop_message['01']: key '01' is not a message id"),
        ({"-1": [0]}, None, RuleShapeError, "drop_message['-1']: key '-1' is not a message id"),
        ({" 1": [0]}, None, RuleShapeError, "drop_message[' 1']: key ' 1' is not a message id"),
        ({True: [0]}, None, RuleShapeError, "drop_message[True]: key True is not a message id"),
        ({"4": [7]}, None, FutureDropError, "drop_message['4'][0]: message 7 is after its anchor 4"),
        ({"4": [-1]}, None, RuleRangeError, "drop_message['4'][0]: message id -1 is negative"),
        ({"10": [1]}, None, RuleRangeError, "drop_message['10']: message id 10 is out of range for 10 messages"),
        ({"4": [1, 1]}, None, DoubleDropError, "drop_message['4'][1]: message 1 is already dropped earlier"),
        ({"6": [1], "4": [1]}, None, DoubleDropError, "drop_message['6'][0]: message 1 is already dropped by anchor 4"),
        ({"4": [1], 4: [2]}, None, RuleOrderError, "drop_message[4]: anchor 4 repeats key '4'"),
        ({"2": [0, 1, 2, 0]}, None, RuleSizeError, "drop_message['2']: 4 ids, at most 3 possible"),
        (None, [], RuleShapeError, "reposition: empty list"),
        (None, {"1": 1}, RuleShapeError, "reposition: expected a list of message ids, got dict"),
        (None, [3, 3], RuleOrderError, "reposition[1]: anchor 3 is not greater than the previous anchor 3"),
        (None, [5, 2], RuleOrderError, "reposition[1]: anchor 2 is not greater than the previous anchor 5"),
        (None, [1, False], RuleShapeError, "reposition[1]: message id False is a bool"),
        (None, [10], RuleRangeError, "reposition[0]: message id 10 is out of range for 10 messages"),
        (None, [10**30], RuleRangeError, "reposition[0]: message id 1000000000000000000000000000000 is out of range"),
        (None, list(range(11)), RuleSizeError, "reposition: 11 ids, at most 10 possible"),
    ],
)
def test_invalid_fields_raise_named_errors(
    drop_message: object, reposition: object, error: type[RuleError], text: str
) -> None:
    with pytest.raises(error) as caught:
        parse_rules(drop_message, reposition, n_messages=10)
    assert str(caught.value).startswith(text)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(caught.value.field + ": ")


def test_too_many_anchors_is_a_size_error() -> None:
    with pytest.raises(RuleSizeError, match=r"drop_message: 4 anchors for 3 messages"):
        parse_rules({"0": [0], "1": [1], "2": [2], 3: [0]}, None, 3)


def test_bad_message_count_is_rejected() -> None:
    with pytest.raises(RuleSizeError, match="message count"):
        parse_rules(None, None, -1)
    with pytest.raises(RuleSizeError, match="message count"):
        parse_rules(None, None, True)


@pytest.mark.parametrize(
    ("drops", "repositions", "error"),
    [
        ((Drop(3, (1,)), Drop(2, (0,))), (), RuleOrderError),
        ((Drop(3, (4,)),), (), FutureDropError),
        ((Drop(3, (1,)), Drop(5, (1,))), (), DoubleDropError),
        ((Drop(3, ()),), (), RuleShapeError),
        ((Drop(3, (True,)),), (), RuleShapeError),
        ((), (2, 1), RuleOrderError),
        ((), (-1,), RuleShapeError),
        (((3, (1,)),), (), RuleShapeError),
    ],
)
def test_direct_construction_checks_invariants(
    drops: tuple[Drop, ...], repositions: tuple[int, ...], error: type[RuleError]
) -> None:
    with pytest.raises(error):
        ContextRules(drops, repositions)


def _valid_id(value: object, n: int) -> bool:
    return type(value) is int and 0 <= value < n


def _brute_force_valid(drop_message: object, reposition: object, n: int) -> bool:
    """The wire contract spelled out directly: which inputs must parse."""
    if reposition is not None:
        if not isinstance(reposition, (list, tuple)) or not reposition:
            return False
        if not all(_valid_id(r, n) for r in reposition):
            return False
        if any(b <= a for a, b in zip(reposition, reposition[1:])):
            return False
    if drop_message is None:
        return True
    if not isinstance(drop_message, dict):
        return False
    anchors: list[int] = []
    for key in drop_message:
        if isinstance(key, str) and key.isascii() and key.isdigit() and (key == "0" or key[0] != "0"):
            anchors.append(int(key))
        elif type(key) is int:
            anchors.append(key)
        else:
            return False
    if len(set(anchors)) != len(anchors) or not all(0 <= a < n for a in anchors):
        return False
    seen: list[int] = []
    for anchor, value in zip(anchors, drop_message.values()):
        if not isinstance(value, (list, tuple)) or not value:
            return False
        if not all(type(m) is int and 0 <= m <= anchor for m in value):
            return False
        seen.extend(value)
    return len(set(seen)) == len(seen)


_ids = st.one_of(st.integers(-2, 7), st.booleans(), st.floats(0, 3), st.sampled_from(["1", 10**20]))
_keys = st.one_of(st.integers(-1, 7), st.sampled_from(["0", "1", "2", "3", "5", "01", "-1", "x", " 2", "٣"]))
_lists = st.one_of(st.lists(_ids, max_size=4), st.tuples(_ids), st.integers(0, 3), st.none())


@st.composite
def _near_valid(draw: st.DrawFn) -> tuple[object, object, int]:
    """A valid request, then maybe one element swapped for an arbitrary value."""
    n = draw(st.integers(1, 6))
    free = list(range(n))
    drops: dict[object, list[object]] = {}
    for anchor in draw(st.lists(st.integers(0, n - 1), unique=True, max_size=3)):
        choices = [m for m in free if m <= anchor]
        if choices:
            picked = draw(st.lists(st.sampled_from(choices), min_size=1, max_size=2, unique=True))
            free = [m for m in free if m not in picked]
            drops[draw(st.sampled_from([str(anchor), anchor]))] = list(picked)
    reposition: list[object] | None = sorted(draw(st.sets(st.integers(0, n - 1), max_size=3))) or None
    if drops and draw(st.booleans()):
        key = draw(st.sampled_from(list(drops)))
        drops[key][draw(st.integers(0, len(drops[key]) - 1))] = draw(_ids)
    if reposition and draw(st.booleans()):
        reposition[draw(st.integers(0, len(reposition) - 1))] = draw(_ids)
    return drops or draw(st.sampled_from([None, {}])), reposition, n


_garbage = st.tuples(
    st.one_of(st.none(), st.dictionaries(_keys, _lists, max_size=4), st.lists(st.integers(0, 3), max_size=2)),
    st.one_of(st.none(), st.lists(_ids, max_size=4), st.just("1")),
    st.integers(0, 6),
)


@settings(max_examples=500, deadline=None)
@given(st.one_of(_garbage, _near_valid()))
def test_parse_accepts_exactly_the_valid_inputs(case: tuple[object, object, int]) -> None:
    drop_message, reposition, n = case
    valid = _brute_force_valid(drop_message, reposition, n)
    try:
        rules = parse_rules(drop_message, reposition, n)
    except RuleError:
        assert not valid
        return
    assert valid
    assert [d.anchor for d in rules.drops] == sorted(int(k) for k in drop_message or {})
    assert rules.repositions == tuple(reposition or ())
