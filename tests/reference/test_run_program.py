"""run_program reads only token ids and events, and the compiler's layout agrees with the oracle's."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.context.compiler import compile_program
from akv.system.context.program import ContextProgram, Event, EventKind
from akv.system.context.rules import parse_rules
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, Repos, program_events, run_oracle, run_program, simulate_layout


def _program(ids: list[int], events: tuple[Event, ...]) -> ContextProgram:
    """A program whose layout fields are deliberately nonsense: the oracle must not read them."""
    n = len(ids)
    zeros = np.zeros(n, dtype=np.int64)
    return ContextProgram(
        token_ids=np.array(ids, dtype=np.int64), owners=zeros, n_prompt=n, n_messages=1, events=events,
        birth_position=zeros, birth_stage=zeros, final_position=zeros, keep=np.ones(n, dtype=bool),
        visible_until=zeros, transitions=(), next_position=0,
    )


def test_run_program_ignores_the_compilers_positions(qwen3: ReferenceModel) -> None:
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(9)).tolist()
    events = (Event(EventKind.DROP, 8, 1, (0,), ((1, 3), (4, 6))), Event(EventKind.REPOS, 8, 1))
    result = run_program(qwen3, _program(ids, events))
    expected = run_oracle(qwen3, ids, [Drop(8, (1, 2, 4, 5)), Repos(8)])
    assert torch.equal(result.logits, expected.logits)
    assert result.layout.birth_position.tolist() == [0, 1, 2, 3, 4, 5, 6, 7] + list(range(4, 12))


def test_compiled_request_equals_token_level_events(qwen3: ReferenceModel) -> None:
    # messages 0..3 own 3, 4, 2, 5 tokens; the reply owns 2. Drop message 1 after message 2, then compact.
    owners = [0] * 3 + [1] * 4 + [2] * 2 + [3] * 5 + [4] * 2
    ids = torch.randint(0, 512, (len(owners),), generator=torch.Generator().manual_seed(10)).tolist()
    program = compile_program(ids, owners, parse_rules({"2": [1]}, [2], 4), 4)
    expected = run_oracle(qwen3, ids, [Drop(9, (3, 4, 5, 6)), Repos(9)])
    torch.testing.assert_close(run_program(qwen3, program).logits, expected.logits, atol=0, rtol=0)


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[int], dict[str, list[int]], list[int] | None, int]:
    n_messages = draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, 4), min_size=n_messages + 1, max_size=n_messages + 1))
    owners = [m for m, length in enumerate(lengths) for _ in range(length)]
    drop_message: dict[str, list[int]] = {}
    dropped: set[int] = set()
    for anchor in sorted(draw(st.sets(st.integers(0, n_messages - 1)))):
        choices = [m for m in range(anchor + 1) if m not in dropped]
        if choices:
            chosen = draw(st.lists(st.sampled_from(choices), min_size=1, unique=True))
            drop_message[str(anchor)] = chosen
            dropped.update(chosen)
    reposition = sorted(draw(st.sets(st.integers(0, n_messages - 1))))
    return owners, drop_message, reposition or None, n_messages


@settings(max_examples=150, deadline=None)
@given(request=requests())
def test_compiler_layout_equals_oracle_layout(request: tuple) -> None:
    owners, drop_message, reposition, n_messages = request
    rules = parse_rules(drop_message, reposition, n_messages)
    program = compile_program(list(range(len(owners))), owners, rules, n_messages)
    layout = simulate_layout(program.n_tokens, program_events(program))
    assert program.birth_position.tolist() == layout.birth_position.tolist()
    assert program.birth_stage.tolist() == layout.birth_stage.tolist()
    assert program.final_position.tolist() == layout.final_position.tolist()
    assert program.keep.tolist() == layout.keep.tolist()
    assert program.visible_until.tolist() == layout.visible_until.tolist()
    assert program.next_position == layout.next_position
    repos_stages = [i for i, e in enumerate(program.events) if e.kind == EventKind.REPOS]
    assert [t.event for t in program.transitions] == repos_stages
    for transition in program.transitions:
        before, after = layout.stage_positions[transition.event], layout.stage_positions[transition.event + 1]
        moved = ((before >= 0) & (after != before)).nonzero().flatten()
        assert transition.tokens.tolist() == moved.tolist()
        assert transition.old_positions.tolist() == before[moved].tolist()
        assert transition.new_positions.tolist() == after[moved].tolist()
    for message in {m for ms in drop_message.values() for m in ms}:
        assert not any(program.keep[t] for t, owner in enumerate(owners) if owner == message)
