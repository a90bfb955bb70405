"""JSON values as the client library accepts them, and the one notion of "the same message".

Messages and the settings a history is tied to must be JSON values: dicts with string keys, lists,
str, int, float, bool and None, nested at most `MAX_DEPTH` containers deep. Two values are the same
when their JSON texts are (so `1`, `1.0` and `True` differ, as they render differently); this holds
in memory and after a JSON round-trip alike."""

from __future__ import annotations

from typing import Any

from akv.agent.errors import PayloadError

MAX_DEPTH = 100
_SCALARS = frozenset((str, int, float, bool, type(None)))
_PLAIN = frozenset((str, int, bool, type(None)))
_MISSING = object()


class _NotJSON(Exception):
    """Raised inside the fast walks; the caller re-walks with `check_json` to name the path."""


def check_json(value: Any, field: str) -> None:
    """Raise PayloadError naming the JSON path (e.g. `messages[3].tool_calls[0]`) of the first part of
    `value` that is not a JSON value, has a non-string key, or nests deeper than `MAX_DEPTH`."""
    stack: list[tuple[Any, str, int]] = [(value, field, 0)]
    while stack:
        item, path, depth = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if kind is not dict and kind is not list:
            raise PayloadError(f"{path}: {kind.__name__} is not a JSON value (dict, list, str, int, float, bool, "
                               f"None)", message_id=_message_id(path), field=path)
        if depth == MAX_DEPTH:
            raise PayloadError(f"{path}: nested deeper than {MAX_DEPTH} levels", message_id=_message_id(path),
                               field=path)
        if kind is dict:
            for key, v in reversed(item.items()):
                if type(key) is not str:
                    raise PayloadError(f"{path}: key {key!r} ({type(key).__name__}) is not a string; JSON object "
                                       f"keys must be strings", message_id=_message_id(path), field=path)
                stack.append((v, f"{path}.{key}", depth + 1))
        else:
            stack.extend((v, f"{path}[{k}]", depth + 1) for k, v in reversed(list(enumerate(item))))


def _message_id(path: str) -> int | None:
    if not path.startswith("messages["):
        return None
    return int(path[len("messages["):path.index("]")])


def validate_json(value: Any, field: str) -> None:
    """`check_json` with a fast walk first: raises the same PayloadError, costs less when all is well."""
    try:
        _valid(value, MAX_DEPTH)
    except _NotJSON:
        check_json(value, field)
        raise AssertionError("check_json accepted a value the fast walk refused") from None


def _valid(value: Any, depth: int) -> None:
    kind = type(value)
    if kind is dict:
        if depth == 0:
            raise _NotJSON
        for k, v in value.items():
            if type(k) is not str:
                raise _NotJSON
            if type(v) not in _SCALARS:
                _valid(v, depth - 1)
    elif kind is list:
        if depth == 0:
            raise _NotJSON
        for v in value:
            if type(v) not in _SCALARS:
                _valid(v, depth - 1)
    elif kind not in _SCALARS:
        raise _NotJSON


def copy_json_pair(values: list[Any], field: str, start: int = 0) -> tuple[list[Any], list[Any]]:
    """Two deep copies of `values[start:]` (JSON values) that share nothing mutable with them or with
    each other, made in one walk; raises PayloadError naming `field[i]...` (see `check_json`) for an
    item that is not a JSON value."""
    try:
        return _pair(values[start:], MAX_DEPTH)
    except _NotJSON:
        check_json(values, field)
        raise AssertionError("check_json accepted a value the copy refused") from None


def _pair(value: Any, depth: int) -> tuple[Any, Any]:
    kind = type(value)
    if kind is dict:
        if depth == 0:
            raise _NotJSON
        first, second = value.copy(), value.copy()
        for k, v in value.items():
            if type(k) is not str:
                raise _NotJSON
            if type(v) not in _SCALARS:
                first[k], second[k] = _pair(v, depth - 1)
        return first, second
    if kind is list:
        if depth == 0:
            raise _NotJSON
        first, second = value.copy(), value.copy()
        for k, v in enumerate(value):
            if type(v) not in _SCALARS:
                first[k], second[k] = _pair(v, depth - 1)
        return first, second
    if kind in _SCALARS:
        return value, value
    raise _NotJSON


def same_json(a: Any, b: Any) -> bool:
    """True when `a` and `b` have the same JSON text up to key order. `a` must be a JSON value
    (as made by `copy_json_pair`); `b` may be anything."""
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is dict:
        if len(a) != len(b):
            return False
        get = b.get
        for k, v in a.items():
            w = get(k, _MISSING)
            inner = type(v)
            if inner is not type(w):
                return False
            if inner in _PLAIN:
                if v != w:
                    return False
            elif not same_json(v, w):
                return False
        return True
    if kind is list:
        if len(a) != len(b):
            return False
        for v, w in zip(a, b):
            inner = type(v)
            if inner is not type(w):
                return False
            if inner in _PLAIN:
                if v != w:
                    return False
            elif not same_json(v, w):
                return False
        return True
    if kind is float:
        return float.__repr__(a) == float.__repr__(b)
    return a == b
