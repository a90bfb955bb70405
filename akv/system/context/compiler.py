"""Compile token ownership and parsed rules into a :class:`ContextProgram` (DESIGN.md §1).

An event anchored at message ``b`` applies right after the last token owned by a message ``<= b``;
at one anchor the Drop comes before the Repos. Work is a few vectorised passes over the tokens;
what a Repos moves is worked out from the drop ranges only when first asked (:class:`Transition`), so
a program costs the same however many tokens its Repos move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from akv.system.arrays import frozen
from akv.system.context.program import ContextProgram, DropRanges, Event, EventKind, Transition
from akv.system.context.rules import ContextRules, Drop


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
    return program_of_rules(ids, own, rules, n_messages)


def compile_token_drops(
    token_ids: Any, owners: Any, drops: Sequence[TokenDrop], repositions: Sequence[int], n_messages: int
) -> ContextProgram:
    """Lay out a prompt whose drops hide explicit token ranges (parts of messages, e.g. text spans).

    Anchors increase, each range ends at or before its anchor's last token, and no token is hidden twice.
    """
    ids, own = _token_vectors(token_ids, owners, n_messages)
    return program_of_token_drops(ids, own, drops, repositions, n_messages)


def program_of_rules(ids: np.ndarray, owners: np.ndarray, rules: ContextRules, n_messages: int) -> ContextProgram:
    """:func:`compile_program` of vectors the caller has checked and hands over: int64 arrays, token
    ids non-negative (:func:`check_non_negative`), owners non-decreasing up to ``n_messages``."""
    if not isinstance(rules, ContextRules):
        raise ProgramError(f"rules: expected ContextRules, got {type(rules).__name__}")
    if rules.max_id >= n_messages:
        raise ProgramError(f"rules: message id {rules.max_id} is out of range for {n_messages} messages")
    return _lay_out(ids, owners, n_messages, _events(owners, message_drops(owners, rules.drops), rules.repositions))


def program_of_token_drops(
    ids: np.ndarray, owners: np.ndarray, drops: Sequence[TokenDrop], repositions: Sequence[int], n_messages: int
) -> ContextProgram:
    """:func:`compile_token_drops` of vectors checked and handed over as for :func:`program_of_rules`."""
    repos = tuple(repositions)
    _check_token_drops(owners, tuple(drops), repos, n_messages)
    return _lay_out(ids, owners, n_messages, _events(owners, tuple(drops), repos))


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
    if k == 0:
        return program
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
    return check_non_negative(arr.astype(np.int64), field)


def check_non_negative(values: np.ndarray, field: str) -> np.ndarray:
    """``values`` (integers), or a :class:`ProgramError` naming the first negative one."""
    if values.size and values.min() < 0:
        bad = int(np.flatnonzero(values < 0)[0])
        raise ProgramError(f"{field}[{bad}]: negative value {int(values[bad])}")
    return values


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
    """Closed forms (DESIGN.md §1): Drops never move a position and a Repos compacts every visible key,
    so after a Repos a token visible there sits at the number of tokens before it still visible, and
    the tokens born until the next Repos continue from there. A few passes over the tokens; what a
    Repos moves is worked out from the drop ranges when first asked (:class:`Transition`)."""
    n = ids.shape[0]
    n_events = len(events)
    at = np.array([e.at for e in events] + [n], dtype=np.int64)
    ranges = DropRanges.of(events)
    hidden_by = _hidden_by(ranges, n, n_events)
    hidden = np.bincount(ranges.stages, weights=ranges.ends - ranges.starts, minlength=n_events)
    hidden_before = np.concatenate([[0], np.cumsum(hidden.astype(np.int64))])  # by the events before each
    repos = [i for i, event in enumerate(events) if event.kind is EventKind.REPOS]
    starts = [0] + [int(at[s]) for s in repos] + [n]  # the runs of births between Repos
    birth_position = np.arange(n, dtype=np.int64)
    for j, s in enumerate(repos):  # a run starts at the Repos' visible count
        birth_position[starts[j + 1] : starts[j + 2]] -= int(hidden_before[s])
    transitions = tuple(Transition(s, previous, int(at[s]), ranges) for s, previous in zip(repos, [-1] + repos))
    keep = hidden_by == n_events
    final_position = birth_position.copy()
    if repos:  # before the last Repos: the count of tokens before it still visible there
        born = starts[-2]
        final_position[:born] = np.cumsum(hidden_by[:born] > repos[-1], dtype=np.int32)
        final_position[:born] -= 1
    final_position[~keep] = -1
    birth_stage = np.repeat(np.arange(n_events + 1, dtype=np.int64), np.diff(at, prepend=0))
    return ContextProgram(
        token_ids=frozen(ids),
        owners=frozen(owners),
        n_prompt=n,
        n_messages=n_messages,
        events=events,
        birth_position=frozen(birth_position),
        birth_stage=frozen(birth_stage),
        final_position=frozen(final_position),
        keep=frozen(keep),
        visible_until=frozen(np.take(at, hidden_by)),
        transitions=transitions,
        next_position=int(n - hidden_before[repos[-1]] if repos else n),
    )


def _hidden_by(ranges: DropRanges, n: int, n_events: int) -> np.ndarray:
    """Index of the Drop hiding each of ``n`` tokens, ``n_events`` if none (int32)."""
    marks = np.zeros(n + 1, dtype=np.int32)
    marks[0] = n_events
    marks[ranges.starts] += ranges.stages - n_events
    marks[ranges.ends] -= ranges.stages - n_events
    return np.cumsum(marks[:n], out=marks[:n])
