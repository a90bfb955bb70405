"""Host work of a next turn scales with what it computes and reads, not with the dropped text: matching,
planning, committing and publishing an agent's turn neither read nor write the versions of the tree
nodes that hold only messages it dropped on earlier turns (issues #28, #29, #30). Counted on the
nodes' arrays themselves."""

from __future__ import annotations

from typing import Any

import numpy as np

from akv.system.cache.core import CacheCore
from akv.system.cache.keys import program_key
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.rules import parse_rules

TURNS, KEEP, LENGTH = 30, 3, 8


class Watched(np.ndarray):
    """An array that counts every read or write of its contents."""

    touches = 0

    def __getitem__(self, key: Any) -> Any:
        Watched.touches += 1
        return np.asarray(self)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        Watched.touches += 1
        np.asarray(self)[key] = value

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        Watched.touches += 1
        plain = tuple(np.asarray(x) if isinstance(x, Watched) else x for x in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(x) if isinstance(x, Watched) else x for x in kwargs["out"])
        return getattr(ufunc, method)(*plain, **kwargs)


def _agent(rng: np.random.Generator) -> tuple[list[np.ndarray], dict[str, list[int]], list[int]]:
    """Messages, and a policy that keeps the last ``KEEP`` of them: each turn from ``KEEP`` on drops
    the oldest kept one and repositions there."""
    messages = [rng.integers(0, 50_000, size=LENGTH) for _ in range(TURNS + 1)]
    drops = {str(t): [t - KEEP] for t in range(KEEP, TURNS)}
    return messages, drops, list(range(KEEP, TURNS))


def _program(messages: list[np.ndarray], drops: dict[str, list[int]], repositions: list[int], turn: int) -> Any:
    ids = np.concatenate(messages[: turn + 1])
    owners = np.repeat(np.arange(turn + 1), LENGTH)
    rules = parse_rules({a: m for a, m in drops.items() if int(a) <= turn} or None,
                        [r for r in repositions if r <= turn] or None, turn + 1)
    return compile_program(ids, owners, rules, turn + 1)


def _serve(core: CacheCore, program: Any, reply: np.ndarray, watch: set[int] | None = None,
           from_match: bool = False) -> int:
    """One turn: match, commit with births, publish with one generated token (the next message's
    first, so the next turn continues the path). ``watch``: tokens whose nodes are counted from the
    commit on (``from_match``: from the match on) (nodes holding only those tokens); returns the
    touches counted there."""
    if watch is not None and from_match:
        _watch(core, program, watch)
    draft = core.match(program, in_place=True)
    if watch is not None and not from_match:
        _watch(core, program, watch)
    Watched.touches = 0 if not from_match else Watched.touches
    request = core.admit_draft(draft)
    generated = core.pool.alloc(1)
    core.finish(request, reply[:1], generated)
    return Watched.touches


def _watch(core: CacheCore, program: Any, tokens: set[int]) -> None:
    """Count from now on every access to the versions of the nodes holding only ``tokens``."""
    watched = _nodes_holding_only(core, program_key(program), tokens)
    assert len(watched) >= TURNS - 2 * KEEP - 2, "the path keeps a node per dropped message"
    for node in watched:
        node.slots, node.positions = node.slots.view(Watched), node.positions.view(Watched)
    Watched.touches = 0


def _nodes_holding_only(core: CacheCore, key: Any, tokens: set[int]) -> list[Any]:
    """Nodes of ``key``'s path (walked here) whose token records all belong to ``tokens``."""
    record_token = {int(r): t for t, r in enumerate(key.token_record)}
    out, node, i = [], core.tree._roots[key.namespace], 0
    while i < key.records.size and int(key.records[i]) in node.children:
        node = node.children[int(key.records[i])]
        rows = range(i, i + node.key.shape[0])
        mine = [record_token[r] for r in rows if r in record_token]
        if mine and all(t in tokens for t in mine):
            out.append(node)
        i += node.key.shape[0]
    return out


def test_a_turn_leaves_the_nodes_of_earlier_dropped_messages_untouched() -> None:
    rng = np.random.default_rng(0)
    messages, drops, repositions = _agent(rng)
    core = CacheCore(SlotPool(20_000))  # room for everything: no eviction
    last = TURNS - 1
    for turn in range(last):
        _serve(core, _program(messages, drops, repositions, turn), messages[turn + 1])
    dropped_before = {t for a, ms in drops.items() if int(a) < last for m in ms
                      for t in range(m * LENGTH, (m + 1) * LENGTH)}
    touches = _serve(core, _program(messages, drops, repositions, last), messages[last + 1], watch=dropped_before)
    assert touches == 0


def test_a_whole_turn_from_its_match_leaves_those_nodes_untouched() -> None:
    """Matching and planning the turn too: the match reads the versions of only the rows the plan
    reads, not a text-length table of every matched token's."""
    rng = np.random.default_rng(1)
    messages, drops, repositions = _agent(rng)
    core = CacheCore(SlotPool(20_000))
    last = TURNS - 1
    for turn in range(last):
        _serve(core, _program(messages, drops, repositions, turn), messages[turn + 1])
    dropped_before = {t for a, ms in drops.items() if int(a) < last for m in ms
                      for t in range(m * LENGTH, (m + 1) * LENGTH)}
    program = _program(messages, drops, repositions, last)
    touches = _serve(core, program, messages[last + 1], watch=dropped_before, from_match=True)
    assert touches == 0


def test_the_count_sees_a_touch() -> None:
    """The counting array counts what the tree does to a node (so a zero above means untouched)."""
    Watched.touches = 0
    arr = np.full((4, 1), -1, dtype=np.int64).view(Watched)
    _ = arr[:2] >= 0
    arr[1, 0] = 5
    assert Watched.touches == 2 and int(np.asarray(arr)[1, 0]) == 5
