"""Parse and validate the request fields ``drop_message`` and ``reposition`` (DESIGN.md §1–2).

Wire shapes: ``drop_message`` is a JSON object whose keys are message ids written as canonical
decimal strings (``"4"``; Python ints are accepted too) and whose values are non-empty lists of
message ids; ``reposition`` is a non-empty, strictly increasing list of message ids. Message ids
are 0-based indexes into ``messages``. ``None`` (field absent) and an empty ``drop_message`` object
mean "no rule". Every failure raises a :class:`RuleError` subclass whose message starts with the
offending field (``drop_message['4'][1]``, ``reposition[0]``) and names the value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

MAX_MESSAGES = 1 << 20
"""Largest message count a request may carry; bounds every id and list length."""

_CANONICAL_ID = re.compile(r"0|[1-9][0-9]{0,18}")


class RuleError(ValueError):
    """A ``drop_message``/``reposition`` field is invalid; ``field`` and ``value`` name the culprit."""

    def __init__(self, field: str, value: Any, problem: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"{field}: {problem}")


class RuleShapeError(RuleError):
    """Wrong JSON type or shape: not an object/list, bool or float instead of int, bad key text."""


class RuleRangeError(RuleError):
    """A message id is negative or not an index into ``messages``."""


class RuleSizeError(RuleError):
    """A list or object is larger than the request can meaningfully hold."""


class RuleOrderError(RuleError):
    """Anchors are repeated or not strictly increasing."""


class FutureDropError(RuleError):
    """A drop names a message later than its anchor."""


class DoubleDropError(RuleError):
    """A message is dropped twice (in one list or by two anchors)."""


@dataclass(frozen=True)
class Drop:
    """After message ``anchor`` has been appended, hide ``messages`` (in request order)."""

    anchor: int
    messages: tuple[int, ...]


@dataclass(frozen=True)
class ContextRules:
    """Normalised cache operations of one request: drops sorted by anchor, repositions increasing.

    Construct with :func:`parse_rules`; direct construction re-checks the same invariants
    (except the range check, which needs the message count).
    """

    drops: tuple[Drop, ...] = ()
    repositions: tuple[int, ...] = ()

    EMPTY: ClassVar[ContextRules]

    def __post_init__(self) -> None:
        _check_normalised(self.drops, self.repositions)

    @property
    def is_empty(self) -> bool:
        """True when the request carries no cache operation (a plain request)."""
        return not self.drops and not self.repositions

    @property
    def max_id(self) -> int:
        """Largest message id referenced, -1 when empty."""
        ids = [d.anchor for d in self.drops] + list(self.repositions)
        return max(ids, default=-1)

    @property
    def dropped(self) -> frozenset[int]:
        """Every message hidden by some drop."""
        return frozenset(m for d in self.drops for m in d.messages)


def is_plain_request(drop_message: Any, reposition: Any) -> bool:
    """True when neither field is present (``None``) or ``drop_message`` is an empty object."""
    return reposition is None and (drop_message is None or drop_message == {})


def parse_rules(drop_message: Any, reposition: Any, n_messages: int) -> ContextRules:
    """Validate the wire fields against a request of ``n_messages`` messages and normalise them."""
    if type(n_messages) is not int or not 0 <= n_messages <= MAX_MESSAGES:
        raise RuleSizeError("messages", n_messages, f"message count {n_messages!r} must be an int in 0..{MAX_MESSAGES}")
    drops = _parse_drops(drop_message, n_messages)
    repositions = _parse_repositions(reposition, n_messages)
    return ContextRules(drops=drops, repositions=repositions)


def _parse_drops(drop_message: Any, n_messages: int) -> tuple[Drop, ...]:
    if drop_message is None:
        return ()
    if not isinstance(drop_message, Mapping):
        raise RuleShapeError("drop_message", drop_message, f"expected an object, got {type(drop_message).__name__}")
    if len(drop_message) > n_messages:
        raise RuleSizeError(
            "drop_message", len(drop_message), f"{len(drop_message)} anchors for {n_messages} messages"
        )
    by_anchor: dict[int, tuple[Any, Any]] = {}
    for key, value in drop_message.items():
        field = f"drop_message[{key!r}]"
        anchor = _parse_key(key, field, n_messages)
        if anchor in by_anchor:
            raise RuleOrderError(field, key, f"anchor {anchor} repeats key {by_anchor[anchor][0]!r}")
        by_anchor[anchor] = (key, value)
    dropped_by: dict[int, int] = {}
    drops = []
    for anchor in sorted(by_anchor):
        key, value = by_anchor[anchor]
        field = f"drop_message[{key!r}]"
        messages = _parse_id_list(value, field, n_messages, max_len=anchor + 1)
        for i, message in enumerate(messages):
            if message > anchor:
                raise FutureDropError(f"{field}[{i}]", message, f"message {message} is after its anchor {anchor}")
            if message in dropped_by:
                earlier = dropped_by[message]
                where = "earlier in this list" if earlier == anchor else f"by anchor {earlier}"
                raise DoubleDropError(f"{field}[{i}]", message, f"message {message} is already dropped {where}")
            dropped_by[message] = anchor
        drops.append(Drop(anchor=anchor, messages=messages))
    return tuple(drops)


def _parse_repositions(reposition: Any, n_messages: int) -> tuple[int, ...]:
    if reposition is None:
        return ()
    ids = _parse_id_list(reposition, "reposition", n_messages, max_len=n_messages)
    for i in range(1, len(ids)):
        if ids[i] <= ids[i - 1]:
            raise RuleOrderError(
                f"reposition[{i}]", ids[i], f"anchor {ids[i]} is not greater than the previous anchor {ids[i - 1]}"
            )
    return ids


def _parse_key(key: Any, field: str, n_messages: int) -> int:
    if type(key) is int:
        value = key
    elif isinstance(key, str) and _CANONICAL_ID.fullmatch(key):
        value = int(key)
    else:
        raise RuleShapeError(field, key, f"key {key!r} is not a message id (decimal digits, no sign or padding)")
    return _check_id(value, field, n_messages)


def _parse_id_list(value: Any, field: str, n_messages: int, max_len: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise RuleShapeError(field, value, f"expected a list of message ids, got {type(value).__name__}")
    if not value:
        raise RuleShapeError(field, value, "empty list")
    if len(value) > max_len:
        raise RuleSizeError(field, len(value), f"{len(value)} ids, at most {max_len} possible")
    out = []
    for i, item in enumerate(value):
        item_field = f"{field}[{i}]"
        if type(item) is not int:
            raise RuleShapeError(item_field, item, f"message id {item!r} is a {type(item).__name__}, not an int")
        out.append(_check_id(item, item_field, n_messages))
    return tuple(out)


def _check_id(value: int, field: str, n_messages: int) -> int:
    if value < 0:
        raise RuleRangeError(field, value, f"message id {value} is negative")
    if value >= n_messages:
        raise RuleRangeError(field, value, f"message id {value} is out of range for {n_messages} messages")
    return value


def _check_normalised(drops: tuple[Drop, ...], repositions: tuple[int, ...]) -> None:
    seen: set[int] = set()
    previous = -1
    for j, drop in enumerate(drops):
        field = f"drops[{j}]"
        if not isinstance(drop, Drop):
            raise RuleShapeError(field, drop, f"expected a Drop, got {type(drop).__name__}")
        if type(drop.anchor) is not int or drop.anchor < 0:
            raise RuleShapeError(f"{field}.anchor", drop.anchor, f"anchor {drop.anchor!r} is not a non-negative int")
        if drop.anchor <= previous:
            raise RuleOrderError(f"{field}.anchor", drop.anchor, f"anchor {drop.anchor} does not follow {previous}")
        previous = drop.anchor
        if not drop.messages:
            raise RuleShapeError(f"{field}.messages", drop.messages, "empty drop")
        for i, message in enumerate(drop.messages):
            item = f"{field}.messages[{i}]"
            if type(message) is not int or message < 0:
                raise RuleShapeError(item, message, f"message id {message!r} is not a non-negative int")
            if message > drop.anchor:
                raise FutureDropError(item, message, f"message {message} is after its anchor {drop.anchor}")
            if message in seen:
                raise DoubleDropError(item, message, f"message {message} is already dropped")
            seen.add(message)
    for i, anchor in enumerate(repositions):
        field = f"repositions[{i}]"
        if type(anchor) is not int or anchor < 0:
            raise RuleShapeError(field, anchor, f"anchor {anchor!r} is not a non-negative int")
        if i and anchor <= repositions[i - 1]:
            raise RuleOrderError(field, anchor, f"anchor {anchor} does not follow {repositions[i - 1]}")


ContextRules.EMPTY = ContextRules()
