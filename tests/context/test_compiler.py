"""The event compiler against the naive token-by-token simulator and hand-worked layouts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from akv.system.context.compiler import ProgramError, append_generated, compile_program
from akv.system.context.program import ContextProgram, EventKind
from akv.system.context.rules import ContextRules, Drop, parse_rules

from .naive import simulate
from .strategies import History, histories


def _compile(
    n_messages: int, owners: list[int], drop_message: dict[int, list[int]], reposition: list[int]
) -> ContextProgram:
    wire = {str(k): v for k, v in reversed(list(drop_message.items()))}
    rules = parse_rules(wire, reposition or None, n_messages)
    token_ids = [(7 * t + 3) % 101 for t in range(len(owners))]
    return compile_program(token_ids, owners, rules, n_messages)


def _hidden_by(program: ContextProgram) -> list[int]:
    """Index of the event hiding each token (len(events) if none), read off the event ranges."""
    out = [len(program.events)] * program.n_tokens
    for i, event in enumerate(program.events):
        for start, end in event.ranges:
            for t in range(start, end):
                out[t] = i
    return out


def _assert_matches_naive(
    program: ContextProgram,
    owners: list[int],
    drop_message: dict[int, list[int]],
    reposition: list[int],
    generated: int,
) -> None:
    naive = simulate(owners, drop_message, reposition, generated)
    assert [e.at for e in program.events] == naive.event_at
    assert program.birth_position.tolist() == naive.birth_position
    assert program.birth_stage.tolist() == naive.birth_stage
    assert program.final_position.tolist() == naive.final_position
    assert program.keep.tolist() == [p >= 0 for p in naive.final_position]
    assert program.visible_until.tolist() == naive.visible_until
    assert program.next_position == naive.next_position
    repos = [i for i, e in enumerate(program.events) if e.kind is EventKind.REPOS]
    assert [tr.event for tr in program.transitions] == repos
    for tr in program.transitions:
        moved = dict(zip(tr.tokens.tolist(), zip(tr.old_positions.tolist(), tr.new_positions.tolist())))
        assert moved == naive.moves[tr.event]
        assert tr.tokens.tolist() == sorted(moved)


@settings(max_examples=300, deadline=None)
@given(histories())
def test_compiler_equals_naive_simulator(history: History) -> None:
    n_messages, owners, drop_message, reposition, generated = history
    program = _compile(n_messages, owners, drop_message, reposition)
    _assert_matches_naive(program, owners, drop_message, reposition, 0)
    extended = append_generated(program, list(range(generated)))
    _assert_matches_naive(extended, owners, drop_message, reposition, generated)
    assert extended.n_prompt == len(owners)
    assert extended.owners.tolist() == owners + [n_messages] * generated


@settings(max_examples=200, deadline=None)
@given(histories())
def test_positions_after_each_repos_are_exactly_0_to_r(history: History) -> None:
    n_messages, owners, drop_message, reposition, _ = history
    program = _compile(n_messages, owners, drop_message, reposition)
    hidden_by = _hidden_by(program)
    position = program.birth_position.copy()
    transitions = iter(program.transitions)
    for i, event in enumerate(program.events):
        if event.kind is not EventKind.REPOS:
            continue
        tr = next(transitions)
        position[tr.tokens] = tr.new_positions
        alive = [t for t in range(event.at) if hidden_by[t] > i]
        assert position[alive].tolist() == list(range(len(alive)))
        later = [t for t in range(event.at, program.n_tokens) if program.birth_stage[t] == i + 1]
        assert program.birth_position[later].tolist() == list(range(len(alive), len(alive) + len(later)))


def test_worked_example_character_template() -> None:
    # <user>old | <assistant>answer | <user>new | <assistant>  (one token per character)
    sizes = [len("<user>old"), len("<assistant>answer"), len("<user>new"), len("<assistant>")]
    owners = [m for m, k in enumerate(sizes) for _ in range(k)]
    n = len(owners)
    program = compile_program(np.arange(n), owners, parse_rules({"1": [0]}, [1], 3), 3)
    first_of_message_2 = sizes[0] + sizes[1]
    assert program.visible_until[:9].tolist() == [first_of_message_2] * 9
    assert program.birth_position[first_of_message_2] == first_of_message_2 - 9
    assert program.next_position == n - 9
    assert program.final_position[9:].tolist() == list(range(n - 9))
    plain = compile_program(np.arange(n), owners, parse_rules({"1": [0]}, None, 3), 3)
    assert plain.next_position == n
    assert plain.final_position[9:].tolist() == list(range(9, n))
    assert plain.transitions == ()


def test_events_at_one_boundary_order_drop_before_repos_and_merge_ranges() -> None:
    owners = [0, 0, 1, 1, 1, 2, 3, 3, 4]
    rules = ContextRules((Drop(3, (2, 0, 1)),), (3,))
    program = compile_program(np.zeros(len(owners), np.int64), owners, rules, 4)
    drop, repos = program.events
    assert (drop.kind, drop.at, drop.anchor, drop.messages, drop.ranges) == (EventKind.DROP, 8, 3, (2, 0, 1), ((0, 6),))
    assert drop.hidden_count == 6
    assert (repos.kind, repos.at, repos.anchor) == (EventKind.REPOS, 8, 3)
    assert program.final_position.tolist() == [-1] * 6 + [0, 1, 2]
    assert program.next_position == 3


def test_repos_with_nothing_to_close_moves_nothing() -> None:
    owners = [0, 1, 1, 2, 3]
    program = compile_program([1, 2, 3, 4, 5], owners, parse_rules({"0": [0]}, [0, 2], 3), 3)
    first, second = program.transitions
    assert first.tokens.tolist() == [] and second.tokens.tolist() == []
    assert program.birth_position.tolist() == [0, 0, 1, 2, 3]
    assert program.final_position.tolist() == [-1, 0, 1, 2, 3]
    assert program.next_position == 4


def test_program_arrays_are_read_only() -> None:
    program = compile_program([5, 6], [0, 1], ContextRules.EMPTY, 1)
    for name in ("token_ids", "owners", "birth_position", "birth_stage", "final_position", "keep", "visible_until"):
        with pytest.raises(ValueError):
            getattr(program, name)[0] = 1


def test_plain_request_is_identity_layout() -> None:
    program = compile_program(np.arange(50), [0] * 20 + [1] * 30, ContextRules.EMPTY, 1)
    assert not program.has_events and program.n_stages == 1
    assert program.birth_position.tolist() == list(range(50))
    assert program.final_position.tolist() == list(range(50))
    assert program.visible_until.tolist() == [50] * 50
    assert program.next_position == 50


@pytest.mark.parametrize(
    ("token_ids", "owners", "rules", "n_messages", "text"),
    [
        ([1, 2, 3], [0, 1], ContextRules.EMPTY, 1, "owners: length 2 differs from token_ids length 3"),
        ([1, 2, 3], [0, 1, 0], ContextRules.EMPTY, 1, r"owners\[2\]: message 0 follows message 1"),
        ([1, 2, 3], [0, 1, 3], ContextRules.EMPTY, 2, r"owners\[2\]: message 3 is beyond the reply owner 2"),
        ([1, -2, 3], [0, 0, 1], ContextRules.EMPTY, 1, r"token_ids\[1\]: negative value -2"),
        ([1.0, 2.0], [0, 1], ContextRules.EMPTY, 1, "token_ids: expected integers, got dtype float64"),
        ([[1, 2]], [0, 1], ContextRules.EMPTY, 1, r"token_ids: expected a 1-D sequence, got shape \(1, 2\)"),
        ([1, 2], [False, True], ContextRules.EMPTY, 1, "owners: expected integers, got dtype bool"),
        ([1, 2], [0, 1], ContextRules((), (1,)), 1, "rules: message id 1 is out of range for 1 messages"),
        ([1, 2], [0, 1], {"0": [0]}, 1, "rules: expected ContextRules, got dict"),
        ([1, 2], [0, 1], ContextRules.EMPTY, -1, "n_messages: -1 is not a non-negative int"),
    ],
)
def test_invalid_inputs_raise_program_error(
    token_ids: object, owners: object, rules: object, n_messages: int, text: str
) -> None:
    with pytest.raises(ProgramError, match=text):
        compile_program(token_ids, owners, rules, n_messages)  # type: ignore[arg-type]
