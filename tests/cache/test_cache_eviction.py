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

Published = tuple[tuple[int, ...], np.ndarray]


def brute_ranks(published: list[Published], cells: dict[tuple[tuple[int, ...], int], int]) -> dict[int, int]:
    """Rank of each cell's slot: 0 when every maximal published history through the token drops it,
    1 when none reads this version's position, else 2. A maximal history is a published record
    sequence that is no strict prefix of another."""
    histories = {records: terminal for records, terminal in published}
    maximal = [(r, t) for r, t in histories.items()
               if not any(len(o) > len(r) and o[: len(r)] == r for o in histories)]
    ranks: dict[int, int] = {}
    for (prefix, position), slot in cells.items():
        token = sum(1 for record in prefix if record >= 0) - 1
        finals = [int(t[token]) for r, t in maximal if r[: len(prefix)] == prefix]
        rank = 0 if all(f < 0 for f in finals) else 1 if position not in finals else 2
        assert ranks.setdefault(slot, rank) == rank, f"slot {slot} sits in two cells of different ranks"
    return ranks


def resident_cells(tree: RadixTree, published: list[Published]) -> dict[tuple[tuple[int, ...], int], int]:
    """(record prefix ending at the token, position) -> slot, for every resident version."""
    cells = {}
    for records, _ in published:
        key_records = np.array(records, dtype=np.int64)
        token_record = np.flatnonzero(key_records >= 0)
        match = tree.match(RecordKey(key_records, token_record))
        for t in range(match.n_tokens):
            for slot, position in zip(match.slots[t].tolist(), match.positions[t].tolist()):
                if slot >= 0:
                    cells[(records[: token_record[t] + 1], position)] = slot
    return cells


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
        program = convs[i].program(turn)
        request = core.admit(program)
        reply = convs[i].reply(turn) if with_reply else np.zeros(0, np.int64)
        core.finish(request, reply, core.allocate(reply.size))
        key = program_key(program).with_tokens(reply)
        terminal = np.concatenate([program.final_position, program.next_position + np.arange(reply.size)])
        published.append((tuple(key.records.tolist()), terminal))
    ranks = brute_ranks(published, resident_cells(core.tree, published))
    got = core.tree.ranks()
    for rank in (DROPPED, STALE, 2):
        assert sorted(got[rank].tolist()) == sorted(s for s, r in ranks.items() if r == rank), f"rank {rank}"

    resident = sorted(ranks)
    held = set(data.draw(st.lists(st.sampled_from(resident), unique=True, max_size=5)) if resident else [])
    pool.incref(np.array(sorted(held), dtype=np.int64))
    freed.clear()
    n = data.draw(st.integers(1, max(1, len(resident))))
    core.tree.evict(n)
    assert not held & set(freed), "evicted a version a request references"
    if freed:
        worst = max(ranks[s] for s in freed)
        skipped = [s for s in resident if ranks[s] < worst and s not in held and s not in freed]
        assert not skipped, f"evicted rank {worst} before lower-ranked slots {skipped}"
    pool.decref(np.array(sorted(held), dtype=np.int64))


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
