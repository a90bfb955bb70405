"""Drops of explicit token ranges (text spans: parts of messages, several ranges per drop, ranges of
two drops touching) against a token-by-token simulation of DESIGN.md §1 written here, and through the
wire. The message-drop programs are checked against ``naive.simulate`` in test_compiler.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.context.compiler import TokenDrop, append_generated, compile_token_drops
from akv.system.context.program import ContextProgram, EventKind
from akv.system.context.wire import decode_program, encode_program


@dataclass
class Case:
    owners: list[int]
    n_messages: int
    drops: list[TokenDrop]
    repositions: list[int]
    generated: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    n_messages = draw(st.integers(1, 7))
    sizes = draw(st.lists(st.integers(0, 6), min_size=n_messages + 1, max_size=n_messages + 1))
    owners = [m for m, k in enumerate(sizes) for _ in range(k)]
    hidden: set[int] = set()
    drops = []
    for anchor in range(n_messages):
        end = sum(sizes[: anchor + 1])
        free = [t for t in range(end) if t not in hidden]
        if not free or not draw(st.booleans()):
            continue
        chosen = sorted(draw(st.sets(st.sampled_from(free), min_size=1)))
        ranges: list[list[int]] = []
        for t in chosen:  # consecutive tokens form one range (ranges of one drop never touch)
            if ranges and ranges[-1][1] == t:
                ranges[-1][1] = t + 1
            else:
                ranges.append([t, t + 1])
        hidden.update(chosen)
        messages = tuple(sorted({owners[t] for t in chosen}))
        drops.append(TokenDrop(anchor, messages, tuple((s, e) for s, e in ranges)))
    repositions = sorted(draw(st.sets(st.integers(0, n_messages - 1))))
    return Case(owners, n_messages, drops, repositions, draw(st.integers(0, 3)))


@dataclass
class Expected:
    at: list[int]
    birth_position: list[int]
    birth_stage: list[int]
    visible_until: list[int]
    final_position: list[int]
    moves: dict[int, dict[int, tuple[int, int]]]
    next_position: int


def simulate(case: Case) -> Expected:
    """Append tokens one at a time; before token ``t``, apply the events whose anchor message has
    ended by then (a Drop before the Repos of the same anchor)."""
    n = len(case.owners) + case.generated
    events = [(d.anchor, 0, d) for d in case.drops] + [(a, 1, None) for a in case.repositions]
    events.sort(key=lambda e: (e[0], e[1]))
    at = [sum(1 for o in case.owners if o <= anchor) for anchor, _, _ in events]
    position: dict[int, int] = {}
    hidden: set[int] = set()
    out = Expected(at, [], [], [n] * n, [], {}, 0)
    stage = 0
    for t in range(n + 1):
        while stage < len(events) and at[stage] == t:
            _, kind, drop = events[stage]
            if kind == 0:
                for s, e in drop.ranges:
                    for u in range(s, e):
                        hidden.add(u)
                        out.visible_until[u] = t
            else:
                visible = [u for u in range(t) if u not in hidden]
                moved = {u: (position[u], r) for r, u in enumerate(visible) if position[u] != r}
                out.moves[stage] = moved
                position.update({u: r for u, (_, r) in moved.items()})
                out.next_position = len(visible)
            stage += 1
        if t == n:
            break
        position[t] = out.next_position
        out.birth_position.append(out.next_position)
        out.birth_stage.append(stage)
        out.next_position += 1
    out.final_position = [-1 if t in hidden else position[t] for t in range(n)]
    return out


def _check(program: ContextProgram, expected: Expected) -> None:
    assert [e.at for e in program.events] == expected.at
    assert program.birth_position.tolist() == expected.birth_position
    assert program.birth_stage.tolist() == expected.birth_stage
    assert program.visible_until.tolist() == expected.visible_until
    assert program.final_position.tolist() == expected.final_position
    assert program.keep.tolist() == [p >= 0 for p in expected.final_position]
    assert program.next_position == expected.next_position
    repos = [i for i, e in enumerate(program.events) if e.kind is EventKind.REPOS]
    assert [tr.event for tr in program.transitions] == repos
    for tr in program.transitions:
        got = dict(zip(tr.tokens.tolist(), zip(tr.old_positions.tolist(), tr.new_positions.tolist())))
        assert got == expected.moves[tr.event]
        assert tr.tokens.tolist() == sorted(got)
        assert tr.size == len(got)
        assert not (tr.tokens.flags.writeable or tr.old_positions.flags.writeable or tr.new_positions.flags.writeable)
    for name in ("birth_position", "birth_stage", "final_position", "keep", "visible_until", "token_ids", "owners"):
        arr = getattr(program, name)
        assert not arr.flags.writeable and arr.shape == (program.n_tokens,), name
        assert arr.dtype == (bool if name == "keep" else np.int64), name


@settings(max_examples=400, deadline=None)
@given(cases())
def test_token_range_drops_equal_the_token_by_token_simulation(case: Case) -> None:
    ids = [(11 * t + 5) % 97 for t in range(len(case.owners))]
    program = compile_token_drops(ids, case.owners, case.drops, case.repositions, case.n_messages)
    program = append_generated(program, list(range(case.generated)))
    expected = simulate(case)
    _check(program, expected)
    _check(decode_program(encode_program(program)), expected)


def test_repos_after_drops_on_both_sides_of_an_earlier_gap() -> None:
    # Worked by hand: 10 tokens, message m owns tokens 2m, 2m+1 (the reply owns none). After message 1,
    # drop token 1 and reposition; after message 3, drop tokens 2 and 5..6 and reposition; after
    # message 4, reposition again with nothing new hidden.
    owners = [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    drops = [TokenDrop(1, (0,), ((1, 2),)), TokenDrop(3, (1, 2, 3), ((2, 3), (5, 7)))]
    program = compile_token_drops(np.arange(10), owners, drops, [1, 3, 4], 5)
    assert program.birth_position.tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 4, 5]  # 4..7 from 3, 8..9 from 4
    first, second, third = program.transitions
    assert first.tokens.tolist() == [2, 3] and first.old_positions.tolist() == [2, 3]
    assert first.new_positions.tolist() == [1, 2]
    # before the second Repos tokens 0, 3, 4, 7 are visible at 0, 2, 3, 6 (token 3 moved by the first
    # Repos, 4 and 7 born at 3 and 6); they move to 0, 1, 2, 3
    assert second.tokens.tolist() == [3, 4, 7] and second.old_positions.tolist() == [2, 3, 6]
    assert second.new_positions.tolist() == [1, 2, 3]
    assert third.tokens.size == 0 and third.size == 0
    assert program.final_position.tolist() == [0, -1, -1, 1, 2, -1, -1, 3, 4, 5]
    assert program.next_position == 6
