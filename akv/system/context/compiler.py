"""Compile token ownership and parsed rules into a :class:`ContextProgram` (DESIGN.md §1).

An event anchored at message ``b`` applies right after the last token owned by a message ``<= b``;
at one anchor the Drop comes before the Repos. Work is linear in tokens + events + the size of the
position transitions produced, with one vectorised numpy step per event.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from akv.system.context.program import ContextProgram, Event, EventKind, Transition
from akv.system.context.rules import ContextRules

_ALIVE = np.iinfo(np.int64).max


class ProgramError(ValueError):
    """Token ids, owners or rules cannot form a program; the message names the field and value."""


def compile_program(token_ids: Any, owners: Any, rules: ContextRules, n_messages: int) -> ContextProgram:
    """Lay out a prompt: ``owners[t]`` is the message owning token ``t`` (``n_messages`` = the reply).

    Owners must be non-decreasing (each message one contiguous range, in message order).
    """
    ids = _int_vector(token_ids, "token_ids")
    own = _int_vector(owners, "owners")
    n = ids.shape[0]
    if own.shape[0] != n:
        raise ProgramError(f"owners: length {own.shape[0]} differs from token_ids length {n}")
    _check_owners(own, n_messages)
    if not isinstance(rules, ContextRules):
        raise ProgramError(f"rules: expected ContextRules, got {type(rules).__name__}")
    if rules.max_id >= n_messages:
        raise ProgramError(f"rules: message id {rules.max_id} is out of range for {n_messages} messages")
    events = _events(own, rules)
    return _lay_out(ids, own, n_messages, events)


def append_generated(program: ContextProgram, token_ids: Any) -> ContextProgram:
    """Extend ``program`` with generated tokens: final stage, positions from ``next_position`` on."""
    new = _int_vector(token_ids, "token_ids")
    k = new.shape[0]
    n_old = program.n_tokens
    n = n_old + k
    positions = np.arange(program.next_position, program.next_position + k, dtype=np.int64)
    keep = np.concatenate([program.keep, np.ones(k, dtype=bool)])
    visible_until = np.where(keep, n, np.concatenate([program.visible_until, np.zeros(k, np.int64)]))
    return ContextProgram(
        token_ids=_frozen(np.concatenate([program.token_ids, new])),
        owners=_frozen(np.concatenate([program.owners, np.full(k, program.n_messages, np.int64)])),
        n_prompt=program.n_prompt,
        n_messages=program.n_messages,
        events=program.events,
        birth_position=_frozen(np.concatenate([program.birth_position, positions])),
        birth_stage=_frozen(np.concatenate([program.birth_stage, np.full(k, program.n_stages - 1, np.int64)])),
        final_position=_frozen(np.concatenate([program.final_position, positions])),
        keep=_frozen(keep),
        visible_until=_frozen(visible_until.astype(np.int64)),
        transitions=program.transitions,
        next_position=program.next_position + k,
    )


def _int_vector(value: Any, field: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ProgramError(f"{field}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ProgramError(f"{field}: expected integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.max() > np.iinfo(np.int64).max:
        raise ProgramError(f"{field}: value {int(arr.max())} does not fit int64")
    out = arr.astype(np.int64)
    if out.min() < 0:
        bad = int(np.flatnonzero(out < 0)[0])
        raise ProgramError(f"{field}[{bad}]: negative value {int(out[bad])}")
    return out


def _check_owners(owners: np.ndarray, n_messages: int) -> None:
    if type(n_messages) is not int or n_messages < 0:
        raise ProgramError(f"n_messages: {n_messages!r} is not a non-negative int")
    if owners.size == 0:
        return
    if owners.max() > n_messages:
        bad = int(np.flatnonzero(owners > n_messages)[0])
        raise ProgramError(f"owners[{bad}]: message {int(owners[bad])} is beyond the reply owner {n_messages}")
    decreasing = np.flatnonzero(owners[1:] < owners[:-1])
    if decreasing.size:
        t = int(decreasing[0]) + 1
        raise ProgramError(
            f"owners[{t}]: message {int(owners[t])} follows message {int(owners[t - 1])}; "
            "each message must own one contiguous range, in order"
        )


def _events(owners: np.ndarray, rules: ContextRules) -> tuple[Event, ...]:
    """Events in stream order; ``rules`` keeps anchors sorted, so merging by anchor suffices."""
    by_anchor: dict[int, list[Event]] = {}
    for drop in rules.drops:
        msgs = np.asarray(drop.messages, dtype=np.int64)
        starts = np.searchsorted(owners, msgs, side="left")
        ends = np.searchsorted(owners, msgs, side="right")
        at = int(np.searchsorted(owners, drop.anchor, side="right"))
        event = Event(EventKind.DROP, at, drop.anchor, drop.messages, _merge_ranges(starts, ends))
        by_anchor.setdefault(drop.anchor, []).append(event)
    for anchor in rules.repositions:
        at = int(np.searchsorted(owners, anchor, side="right"))
        by_anchor.setdefault(anchor, []).append(Event(EventKind.REPOS, at, anchor))
    return tuple(e for anchor in sorted(by_anchor) for e in by_anchor[anchor])


def _merge_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Sorted, non-empty, non-touching half-open ranges covering the messages' tokens."""
    order = np.argsort(starts, kind="stable")
    merged: list[list[int]] = []
    for s, e in zip(starts[order].tolist(), ends[order].tolist()):
        if s == e:
            continue
        if merged and merged[-1][1] == s:
            merged[-1][1] = e
        else:
            merged.append([s, e])
    return tuple((s, e) for s, e in merged)


def _lay_out(ids: np.ndarray, owners: np.ndarray, n_messages: int, events: tuple[Event, ...]) -> ContextProgram:
    n = ids.shape[0]
    hidden_by = np.full(n, _ALIVE, dtype=np.int64)
    birth_position = np.empty(n, dtype=np.int64)
    birth_stage = np.empty(n, dtype=np.int64)
    position = np.empty(n, dtype=np.int64)
    transitions: list[Transition] = []
    next_position = 0
    born = 0
    first_gap = n
    for stage, event in enumerate(events + (None,)):
        upto = n if event is None else event.at
        fresh = np.arange(next_position, next_position + upto - born, dtype=np.int64)
        birth_position[born:upto] = fresh
        position[born:upto] = fresh
        birth_stage[born:upto] = stage
        next_position += upto - born
        born = upto
        if event is None:
            break
        if event.kind is EventKind.DROP:
            for start, end in event.ranges:
                hidden_by[start:end] = stage
                first_gap = min(first_gap, start)
            continue
        tokens = np.zeros(0, dtype=np.int64)
        old = new = tokens
        if first_gap < born:
            gap_position = int(position[first_gap])
            tokens = first_gap + np.flatnonzero(hidden_by[first_gap:born] == _ALIVE)
            old = position[tokens]
            new = np.arange(gap_position, gap_position + tokens.size, dtype=np.int64)
            position[tokens] = new
            next_position = gap_position + tokens.size
            first_gap = n
        transitions.append(Transition(stage, _frozen(tokens), _frozen(old), _frozen(new)))
    keep = hidden_by == _ALIVE
    at = np.array([e.at for e in events] + [n], dtype=np.int64)
    return ContextProgram(
        token_ids=_frozen(ids),
        owners=_frozen(owners),
        n_prompt=n,
        n_messages=n_messages,
        events=events,
        birth_position=_frozen(birth_position),
        birth_stage=_frozen(birth_stage),
        final_position=_frozen(np.where(keep, position, -1)),
        keep=_frozen(keep),
        visible_until=_frozen(at[np.minimum(hidden_by, len(events))]),
        transitions=tuple(transitions),
        next_position=next_position,
    )


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    arr.flags.writeable = False
    return arr
