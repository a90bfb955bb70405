"""Drop-aware eviction order against a brute force over the published event histories: versions of a
token every path drops go first, then versions no path reads, then the rest; never a version a
request references."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.core import CacheCore
from akv.system.cache.keys import DROP_CLOSE, DROP_OPEN, BOUND_BASE, RecordKey, plain_key, program_key
from akv.system.cache.pool import SlotPool
from akv.system.cache.tree import DROPPED, STALE, RadixTree

from .conversations import Conversation, conversations

Published = tuple[tuple[int, ...], np.ndarray, int, int]
"""A publication: its records, terminal, generated records, and how many of its records the tree
held before (where its new leaf starts)."""


def brute_ranks(paths: list[Published], cells: dict[tuple[tuple[int, ...], int], int]) -> dict[int, int]:
    """Rank of each cell's slot: 0 when every path (a recorded history, :func:`recorded`) through the
    token drops it, 1 when none reads this version's position, else 2."""
    maximal = paths
    ranks: dict[int, int] = {}
    for (prefix, position), slot in cells.items():
        token = sum(1 for record in prefix if record >= 0) - 1
        finals = [int(t[token]) for r, t, *_ in maximal if r[: len(prefix)] == prefix]
        rank = 0 if all(f < 0 for f in finals) else 1 if position not in finals else 2
        assert ranks.setdefault(slot, rank) == rank, f"slot {slot} sits in two cells of different ranks"
    return ranks


def resident_cells(tree: RadixTree, published: list[Published]) -> dict[tuple[tuple[int, ...], int], int]:
    """(record prefix ending at the token, position) -> slot, for every resident version."""
    cells = {}
    for records, *_ in published:
        key_records = np.array(records, dtype=np.int64)
        token_record = np.flatnonzero(key_records >= 0)
        match = tree.match(RecordKey(key_records, token_record))
        for t in range(match.n_tokens):
            for slot, position in zip(match.slots[t].tolist(), match.positions[t].tolist()):
                if slot >= 0:
                    cells[(records[: token_record[t] + 1], position)] = slot
    return cells


def recounted_ranks(tree: RadixTree) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Each node's (dropped, stale) cell masks recomputed from scratch: every leaf's recorded terminal
    walked over its whole path (what the tree's incremental read counts must agree with)."""
    kept: dict[int, np.ndarray] = {}
    read: dict[int, np.ndarray] = {}
    nodes = []
    stack = [[c] for root in tree._roots.values() for c in root.children.values()]
    while stack:
        path = stack.pop()
        nodes.append(path[-1])
        stack.extend(path + [c] for c in path[-1].children.values())
        if path[-1].children or path[-1].terminal is None:
            continue
        offset = 0
        for node in path:
            rows = np.flatnonzero(node.key >= 0)
            final = path[-1].terminal[offset : offset + rows.size]
            offset += rows.size
            k = kept.setdefault(node.uid, np.zeros(node.key.shape[0], dtype=bool))
            r = read.setdefault(node.uid, np.zeros(node.slots.shape, dtype=bool))
            k[rows] |= final >= 0
            r[rows] |= (node.positions[rows] == final[:, None]) & (final[:, None] >= 0)
    out = {}
    for node in nodes:
        held = node.slots >= 0
        k = kept.get(node.uid, np.zeros(node.key.shape[0], dtype=bool))
        r = read.get(node.uid, np.zeros(node.slots.shape, dtype=bool))
        out[node.uid] = (held & ~k[:, None], held & k[:, None] & ~r)
    return out


def assert_counts_agree(tree: RadixTree) -> None:
    recounted = recounted_ranks(tree)
    for node in [c for root in tree._roots.values() for c in root.children.values()]:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            for got, want in zip(n.ranked(), recounted[n.uid]):
                assert (got == want).all(), f"node {n.uid}: incremental ranks differ from a full recount"


def publish_turn(core: CacheCore, conv: Conversation, turn: int, with_reply: bool) -> Published:
    """Serve ``conv``'s ``turn`` (with its reply or not) and publish it; its recorded path and terminal positions."""
    program = conv.program(turn)
    request = core.admit(program)
    reply = conv.reply(turn) if with_reply else np.zeros(0, np.int64)
    key = program_key(program).with_tokens(reply)
    held = core.tree.match(key).n_records
    core.finish(request, reply, core.allocate(reply.size))
    terminal = np.concatenate([program.final_position, program.next_position + np.arange(reply.size)])
    return tuple(key.records.tolist()), terminal, reply.size, held


@st.composite
def published_histories(draw: st.DrawFn) -> tuple[list[Conversation], list[tuple[int, int, bool]]]:
    base = draw(conversations())
    convs = [base] + [draw(conversations(prefix=base)) for _ in range(draw(st.integers(1, 3)))]
    turns = draw(st.permutations([(i, t) for i, c in enumerate(convs) for t in range(c.n_turns)]))
    return convs, [(i, t, draw(st.booleans())) for i, t in turns]


@settings(max_examples=150, deadline=None)
@given(published_histories(), st.data())
def test_eviction_order_matches_brute_force(scenario: tuple[list[Conversation], list[tuple[int, int, bool]]],
                                            data: st.DataObject) -> None:
    convs, turns = scenario
    freed: list[int] = []
    pool = SlotPool(2000, on_free=lambda slots: freed.extend(slots.tolist()))
    core = CacheCore(pool)
    published: list[Published] = []
    for i, turn, with_reply in turns:
        published.append(publish_turn(core, convs[i], turn, with_reply))
    ranks = brute_ranks(recorded(core.tree, published), resident_cells(core.tree, published))
    got = core.tree.ranks()
    for rank in (DROPPED, STALE, 2):
        assert sorted(got[rank].tolist()) == sorted(s for s, r in ranks.items() if r == rank), f"rank {rank}"

    resident = sorted(ranks)
    held = set(data.draw(st.lists(st.sampled_from(resident), unique=True, max_size=5)) if resident else [])
    pool.incref(np.array(sorted(held), dtype=np.int64))
    for _ in range(data.draw(st.integers(1, 12))):
        ranks = brute_ranks(recorded(core.tree, published), resident_cells(core.tree, published))
        free_ranks = [r for s, r in ranks.items() if s not in held]
        if not free_ranks:
            break
        freed.clear()
        assert core.tree.evict(1) >= 1
        assert freed and not held & set(freed), "evicted a version a request references"
        lowest = min(free_ranks)
        if lowest < 2:
            assert {ranks[s] for s in freed} <= set(range(lowest + 1)), f"evicted {freed} before rank {lowest}"
        assert_counts_agree(core.tree)
    # one larger eviction: releases prune path ends and so may lower ranks on the way (never raise them)
    cells = resident_cells(core.tree, published)
    before = brute_ranks(recorded(core.tree, published), cells)
    freed.clear()
    core.tree.evict(data.draw(st.integers(1, max(1, len(before)))))
    assert not held & set(freed), "evicted a version a request references"
    assert_single_eviction_order(before, brute_ranks(recorded(core.tree, published), cells), set(freed), held)
    assert_counts_agree(core.tree)
    pool.decref(np.array(sorted(held), dtype=np.int64))


@settings(max_examples=100, deadline=None)
@given(published_histories(), st.data())
def test_spare_slots_are_what_the_dropped_and_stale_ranks_free(
        scenario: tuple[list[Conversation], list[tuple[int, int, bool]]], data: st.DataObject) -> None:
    """``n_spare`` (what ``--akv-protect-live`` admission counts as evictable) is the brute force's
    count of slots no recorded path reads and no request holds, before and after requests take
    references and after evictions of every rank; evicting that many frees at least that many, none of
    them a version a recorded path left after the eviction reads."""
    convs, turns = scenario
    freed: list[int] = []
    pool = SlotPool(2000, on_free=lambda slots: freed.extend(slots.tolist()))
    core = CacheCore(pool)
    published = [publish_turn(core, convs[i], turn, with_reply) for i, turn, with_reply in turns]
    cells = resident_cells(core.tree, published)
    ranks = brute_ranks(recorded(core.tree, published), cells)
    assert core.tree.n_spare() == sum(r < 2 for r in ranks.values())
    held = set(data.draw(st.lists(st.sampled_from(sorted(ranks)), unique=True, max_size=5)) if ranks else [])
    pool.incref(np.array(sorted(held), dtype=np.int64))
    n = core.tree.n_spare()
    assert n == sum(r < 2 for s, r in ranks.items() if s not in held)
    freed.clear()
    assert core.tree.evict(n) >= n
    after = brute_ranks(recorded(core.tree, published), cells)
    assert not held & set(freed), "evicted a version a request references"
    assert all(after[s] < 2 for s in freed), "evicted a version a remaining recorded path reads"
    core.tree.evict(data.draw(st.integers(0, len(cells))))  # into the LRU ranks, inner nodes included
    ranks = brute_ranks(recorded(core.tree, published), resident_cells(core.tree, published))
    assert core.tree.n_spare() == sum(r < 2 for s, r in ranks.items() if s not in held)
    # the freed slots are taken again (the free list hands out the last freed first); brute_ranks does
    # not know that a publication records its path again, so recount from a full walk of the tree
    i, turn, with_reply = turns[-1]
    published.append(publish_turn(core, convs[i], turn, with_reply))
    assert core.tree.n_spare() == walked_spare(core.tree, held)
    pool.decref(np.array(sorted(held), dtype=np.int64))
    assert core.tree.n_spare() == walked_spare(core.tree, set())


def walked_spare(tree: RadixTree, held: set[int]) -> int:
    """Distinct slots that a full walk ranks DROPPED or STALE in every version holding them, not held."""
    ranks = tree.ranks()
    unread = np.concatenate([ranks[DROPPED], ranks[STALE]]).tolist()
    everywhere = tree.resident_slots().tolist()
    return sum(1 for s in set(unread) if s not in held and unread.count(s) == everywhere.count(s))


def assert_single_eviction_order(before: dict[int, int], after: dict[int, int], freed: set[int],
                                 held: set[int]) -> None:
    """One ``evict`` call: every version of a token no path kept goes before anything else, and a
    version still read at the end (so an LRU eviction) goes only after every unread one."""
    left = {s for s in before if s not in freed and s not in held}
    if any(before[s] > DROPPED for s in freed):
        assert not [s for s in left if before[s] == DROPPED], "a DROPPED version outlived a later rank"
    if any(before[s] == 2 and after[s] == 2 for s in freed):
        assert not [s for s in left if before[s] < 2], "an unread version outlived an LRU eviction"


def recorded(tree: RadixTree, published: list[Published]) -> list[Published]:
    """The published histories whose path the tree still has whole (those whose end eviction pruned
    stop being paths; the maximal ones among all published are the paths), less those a later
    publication left within their generated records: its new leaf starts where the two part, and
    the earlier one goes on from there for no more records than it generated."""
    last = {records: (k, terminal, generated, held)
            for k, (records, terminal, generated, held) in enumerate(published)}
    out = []
    for records, (k, terminal, generated, held) in last.items():
        if any(len(o) > len(records) and o[: len(records)] == records for o in last):
            continue
        if any(j > k and _parting(records, o) == o_held < len(o) and len(records) - o_held <= generated
               for j, (o, _, _, o_held) in enumerate(published) if o_held < len(records)):
            continue
        key = np.array(records, dtype=np.int64)
        if tree.match(RecordKey(key, np.flatnonzero(key >= 0))).n_records == key.size:
            out.append((records, terminal, generated, held))
    return out


def _parting(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading records ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _publish(tree: RadixTree, key: RecordKey, terminal: list[int]) -> np.ndarray:
    slots = tree.pool.alloc(key.n_tokens)
    positions = np.arange(key.n_tokens, dtype=np.int64)
    tree.insert(key, slots[:, None], positions[:, None], np.array(terminal, dtype=np.int64))
    tree.pool.decref(slots)
    return slots


def test_a_token_one_branch_still_reads_is_not_evicted_first() -> None:
    """Branch B keeps token 1, then branch A drops it: B's path still reads it, so an older leaf
    goes first (the most recent publication alone does not decide)."""
    pool = SlotPool(32)
    tree = RadixTree(pool)
    b = _publish(tree, plain_key(np.array([1, 2, 3, 5])), [0, 1, 2, 3])
    drop = [DROP_OPEN, -(1 + BOUND_BASE), -(2 + BOUND_BASE), DROP_CLOSE]
    a_key = RecordKey(np.array([1, 2, 3, *drop, 4]), np.array([0, 1, 2, 7]))
    _publish(tree, a_key, [0, -1, 2, 3])
    assert tree.evict(1) == 1
    resident = set(tree.resident_slots().tolist())
    assert int(b[1]) in resident and int(b[3]) not in resident, "B's own leaf went, its token 1 stayed"


def test_versions_a_pruned_path_end_leaves_unkept_go_before_lru_leaves() -> None:
    """A 7-turn branch that drops and repositions, and a 2-turn one beside it. Evicting 6 slots takes
    the 5 versions no path keeps, pruning the long branch's end on the way; the next node in LRU order
    (ties: creation order) then holds versions no remaining path keeps, and those go, not the
    remaining leaves (hand-derived from the brute-force ranks; found by hypothesis)."""
    convs = [Conversation(messages=((0,),) * 7, drops={4: (0, 1), 6: (2, 6)}, repositions=tuple(range(7))),
             Conversation(messages=((0,), (0,)), drops={}, repositions=(0, 1))]
    freed: list[int] = []
    pool = SlotPool(64, on_free=lambda slots: freed.extend(slots.tolist()))
    core = CacheCore(pool)
    published: list[Published] = []
    for conv, turn in [(convs[0], t) for t in range(7)] + [(convs[1], 0), (convs[1], 1)]:
        program = conv.program(turn)
        core.finish(core.admit(program))
        published.append((tuple(program_key(program).records.tolist()), np.asarray(program.final_position), 0, 0))
    ranks = brute_ranks(recorded(core.tree, published), resident_cells(core.tree, published))
    assert sorted(s for s, r in ranks.items() if r == DROPPED) == [1, 2, 3, 5, 13]
    assert sorted(s for s, r in ranks.items() if r == STALE) == [4, 6, 7, 8, 9]
    freed.clear()
    core.tree.evict(6)
    assert sorted(freed) == [1, 2, 3, 4, 5, 6, 10, 13]


def test_a_growing_path_end_keeps_the_counts_of_a_full_recount() -> None:
    """A plain request published after its prefill and again at its finish (the leaf grows, its
    terminal extended), then grown once more under a terminal that drops tokens 2-3 and moves the
    rest back by 2 (not an extension), and a branch beside it that keeps them: the incremental read
    counts equal a full recount and the ranks the brute force's after every publication."""
    pool = SlotPool(128)
    tree = RadixTree(pool)
    ids = np.arange(100, 130)
    published: list[Published] = []
    moved = np.concatenate([[0, 1, -1, -1], np.arange(2, 24)])
    resident: list[int] = []
    for n, terminal in ((12, np.arange(12)), (20, np.arange(20)), (26, moved), (8, np.arange(8))):
        key = plain_key(ids[:n] if n != 8 else np.concatenate([ids[:5], [7, 8, 9]]))
        slots = _publish(tree, key, terminal.tolist())
        resident += slots[len(resident):].tolist() if n != 8 else []
        published.append((tuple(key.records.tolist()), terminal, 0, 0))
        assert_counts_agree(tree)
        ranks = brute_ranks(recorded(tree, published), resident_cells(tree, published))
        got = tree.ranks()
        for rank in (DROPPED, STALE, 2):
            assert sorted(got[rank].tolist()) == sorted(s for s, r in ranks.items() if r == rank), f"rank {rank}"
        if n == 26:  # hand-derived: tokens 2-3 dropped by the one path, every later token read 2 back
            assert sorted(got[DROPPED].tolist()) == sorted(resident[2:4])
            assert sorted(got[STALE].tolist()) == sorted(resident[4:26])
