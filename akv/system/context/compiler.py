"""Compile token ownership and parsed rules into a :class:`ContextProgram` (DESIGN.md §1).

An event anchored at message ``b`` applies right after the last token owned by a message ``<= b``;
at one anchor the Drop comes before the Repos. Work is linear in tokens + events + the size of the
position transitions produced: drops are marked in one vectorised pass, and only a Repos costs a
numpy step (over the tokens after the earliest new gap).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.system.arrays import frozen
from akv.system.context.program import ContextProgram, Event, EventKind, Transition
from akv.system.context.rules import ContextRules, Drop

_ALIVE = np.iinfo(np.int64).max


class ProgramError(ValueError):
    """Token ids, owners or rules cannot form a program; the message names the field and value."""


@dataclass(frozen=True)
class TokenDrop:
    """After message ``anchor``: hide the token ``ranges`` (half-open, sorted, neither overlapping nor
    touching); ``messages`` are the messages whose tokens the drop is about, in request order."""

    anchor: int
    messages: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]


def compile_program(token_ids: Any, owners: Any, rules: ContextRules, n_messages: int) -> ContextProgram:
    """Lay out a prompt: ``owners[t]`` is the message owning token ``t`` (``n_messages`` = the reply).

    Owners must be non-decreasing (each message one contiguous range, in message order).
    """
    ids, own = _token_vectors(token_ids, owners, n_messages)
    if not isinstance(rules, ContextRules):
        raise ProgramError(f"rules: expected ContextRules, got {type(rules).__name__}")
    if rules.max_id >= n_messages:
        raise ProgramError(f"rules: message id {rules.max_id} is out of range for {n_messages} messages")
    return _lay_out(ids, own, n_messages, _events(own, message_drops(own, rules.drops), rules.repositions))


def compile_token_drops(
    token_ids: Any, owners: Any, drops: Sequence[TokenDrop], repositions: Sequence[int], n_messages: int
) -> ContextProgram:
    """Lay out a prompt whose drops hide explicit token ranges (parts of messages, e.g. text spans).

    Anchors increase, each range ends at or before its anchor's last token, and no token is hidden twice.
    """
    ids, own = _token_vectors(token_ids, owners, n_messages)
    repos = tuple(repositions)
    _check_token_drops(own, tuple(drops), repos, n_messages)
    return _lay_out(ids, own, n_messages, _events(own, tuple(drops), repos))


def message_drops(owners: Any, drops: Sequence[Drop]) -> tuple[TokenDrop, ...]:
    """The token ranges each of ``drops`` hides: every token its messages own."""
    own = np.asarray(owners, dtype=np.int64)
    flat = np.asarray([m for d in drops for m in d.messages], dtype=np.int64)
    starts = np.searchsorted(own, flat, side="left").tolist()
    ends = np.searchsorted(own, flat, side="right").tolist()
    out = []
    k = 0
    for drop in drops:
        n = len(drop.messages)
        out.append(TokenDrop(drop.anchor, drop.messages, _merge_ranges(starts[k : k + n], ends[k : k + n])))
        k += n
    return tuple(out)


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
        token_ids=frozen(np.concatenate([program.token_ids, new])),
        owners=frozen(np.concatenate([program.owners, np.full(k, program.n_messages, np.int64)])),
        n_prompt=program.n_prompt,
        n_messages=program.n_messages,
        events=program.events,
        birth_position=frozen(np.concatenate([program.birth_position, positions])),
        birth_stage=frozen(np.concatenate([program.birth_stage, np.full(k, program.n_stages - 1, np.int64)])),
        final_position=frozen(np.concatenate([program.final_position, positions])),
        keep=frozen(keep),
        visible_until=frozen(visible_until),
        transitions=program.transitions,
        next_position=program.next_position + k,
    )


def merge_drops(drops: Sequence[TokenDrop]) -> tuple[TokenDrop, ...]:
    """One drop per anchor, in anchor order: its ranges united, less the tokens an earlier anchor
    already hides (a message whose reasoning went earlier can still be dropped whole later)."""
    by_anchor: dict[int, list[TokenDrop]] = {}
    for drop in drops:
        by_anchor.setdefault(drop.anchor, []).append(drop)
    hidden: list[tuple[int, int]] = []
    out = []
    for anchor in sorted(by_anchor):
        group = by_anchor[anchor]
        ranges = _subtract(merge_spans([r for d in group for r in d.ranges]), hidden)
        hidden = list(merge_spans(hidden + list(ranges)))
        out.append(TokenDrop(anchor, tuple(sorted({m for d in group for m in d.messages})), ranges))
    return tuple(out)


def merge_spans(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted union of half-open ranges, touching ones merged, empty ones left out."""
    merged: list[list[int]] = []
    for s, e in sorted(ranges):
        if s >= e:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return tuple((s, e) for s, e in merged)


def _subtract(ranges: tuple[tuple[int, int], ...], hidden: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out = []
    for s, e in ranges:
        for hs, he in hidden:
            if he <= s or hs >= e:
                continue
            if hs > s:
                out.append((s, hs))
            s = max(s, he)
        if s < e:
            out.append((s, e))
    return merge_spans(out)


def _token_vectors(token_ids: Any, owners: Any, n_messages: int) -> tuple[np.ndarray, np.ndarray]:
    ids = _int_vector(token_ids, "token_ids")
    own = _int_vector(owners, "owners")
    if own.shape[0] != ids.shape[0]:
        raise ProgramError(f"owners: length {own.shape[0]} differs from token_ids length {ids.shape[0]}")
    _check_owners(own, n_messages)
    return ids, own


def _check_token_drops(
    owners: np.ndarray, drops: tuple[TokenDrop, ...], repositions: tuple[int, ...], n_messages: int
) -> None:
    previous_anchor, previous_end = -1, 0
    for j, drop in enumerate(drops):
        field = f"drops[{j}]"
        if not isinstance(drop, TokenDrop):
            raise ProgramError(f"{field}: expected a TokenDrop, got {type(drop).__name__}")
        if type(drop.anchor) is not int or not previous_anchor < drop.anchor < n_messages:
            raise ProgramError(f"{field}.anchor: anchor {drop.anchor!r} does not follow {previous_anchor} "
                               f"within {n_messages} messages")
        previous_anchor = drop.anchor
        if not drop.messages or any(type(m) is not int or not 0 <= m <= drop.anchor for m in drop.messages):
            raise ProgramError(
                f"{field}.messages: {drop.messages!r} must be message ids up to the anchor {drop.anchor}")
        at = int(np.searchsorted(owners, drop.anchor, side="right"))
        for i, (start, end) in enumerate(drop.ranges):
            if not (type(start) is int and type(end) is int and previous_end <= start < end <= at):
                raise ProgramError(
                    f"{field}.ranges[{i}]: range {(start, end)!r} must be non-empty, after token {previous_end} "
                    f"(earlier ranges) and end by token {at} (the anchor's end)"
                )
            previous_end = end + 1 if i + 1 < len(drop.ranges) else end
        previous_end = 0
    for i, anchor in enumerate(repositions):
        if type(anchor) is not int or not 0 <= anchor < n_messages or (i and anchor <= repositions[i - 1]):
            raise ProgramError(f"repositions[{i}]: anchor {anchor!r} must increase within {n_messages} messages")
    spans = sorted(r for d in drops for r in d.ranges)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise ProgramError(f"drops: token {start} is hidden by two drops")


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


def _events(owners: np.ndarray, drops: tuple[TokenDrop, ...], repositions: tuple[int, ...]) -> tuple[Event, ...]:
    """Events in stream order; anchors are sorted, so grouping by anchor suffices."""
    anchors = [d.anchor for d in drops] + list(repositions)
    ats = np.searchsorted(owners, np.asarray(anchors, dtype=np.int64), side="right").tolist()
    by_anchor: dict[int, list[Event]] = {}
    for i, drop in enumerate(drops):
        by_anchor.setdefault(drop.anchor, []).append(
            Event(EventKind.DROP, ats[i], drop.anchor, drop.messages, drop.ranges))
    for j, anchor in enumerate(repositions, start=len(drops)):
        by_anchor.setdefault(anchor, []).append(Event(EventKind.REPOS, ats[j], anchor))
    return tuple(e for anchor in sorted(by_anchor) for e in by_anchor[anchor])


def _merge_ranges(starts: list[int], ends: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted, non-empty, non-touching half-open ranges covering the messages' tokens."""
    if len(starts) == 1:
        return ((starts[0], ends[0]),) if starts[0] < ends[0] else ()
    merged: list[list[int]] = []
    for s, e in sorted(zip(starts, ends)):
        if s == e:
            continue
        if merged and merged[-1][1] == s:
            merged[-1][1] = e
        else:
            merged.append([s, e])
    return tuple((s, e) for s, e in merged)


def _lay_out(ids: np.ndarray, owners: np.ndarray, n_messages: int, events: tuple[Event, ...]) -> ContextProgram:
    """Walk the events once. Drops never move the next position, so births between two Repos
    form one contiguous run; only a Repos needs the current positions of earlier tokens."""
    n = ids.shape[0]
    hidden_by = _hidden_by(n, events)
    birth_position = np.empty(n, dtype=np.int64)
    position = np.empty(n, dtype=np.int64)
    transitions: list[Transition] = []
    run_start = 0
    run_base = 0
    first_gap = n
    for stage, event in enumerate(events):
        if event.kind is EventKind.DROP:
            if event.ranges:
                first_gap = min(first_gap, event.ranges[0][0])
            continue
        born = event.at
        birth_position[run_start:born] = np.arange(run_base, run_base + born - run_start)
        position[run_start:born] = birth_position[run_start:born]
        tokens = np.zeros(0, dtype=np.int64)
        old = new = tokens
        if first_gap < born:
            gap_position = int(position[first_gap])
            tokens = first_gap + np.flatnonzero(hidden_by[first_gap:born] > stage)
            old = position[tokens]
            new = np.arange(gap_position, gap_position + tokens.size, dtype=np.int64)
            position[tokens] = new
            run_base = gap_position + tokens.size
            first_gap = n
        else:
            run_base += born - run_start
        run_start = born
        transitions.append(Transition(stage, frozen(tokens), frozen(old), frozen(new)))
    birth_position[run_start:] = np.arange(run_base, run_base + n - run_start)
    position[run_start:] = birth_position[run_start:]
    at = np.array([e.at for e in events] + [n], dtype=np.int64)
    birth_stage = np.repeat(np.arange(len(events) + 1, dtype=np.int64), np.diff(at, prepend=0))
    keep = hidden_by == _ALIVE
    return ContextProgram(
        token_ids=frozen(ids),
        owners=frozen(owners),
        n_prompt=n,
        n_messages=n_messages,
        events=events,
        birth_position=frozen(birth_position),
        birth_stage=frozen(birth_stage),
        final_position=frozen(np.where(keep, position, -1)),
        keep=frozen(keep),
        visible_until=frozen(at[np.minimum(hidden_by, len(events))]),
        transitions=tuple(transitions),
        next_position=run_base + n - run_start,
    )


def _hidden_by(n: int, events: tuple[Event, ...]) -> np.ndarray:
    """Index of the Drop event hiding each token (``_ALIVE`` if none); drop ranges are disjoint."""
    spans = [(i, s, e) for i, event in enumerate(events) for s, e in event.ranges]
    hidden_by = np.full(n, _ALIVE, dtype=np.int64)
    if spans:
        index, starts, ends = (np.asarray(col, dtype=np.int64) for col in zip(*spans))
        lengths = ends - starts
        first = np.cumsum(lengths) - lengths
        tokens = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(starts - first, lengths)
        hidden_by[tokens] = np.repeat(index, lengths)
    return hidden_by

