"""Positions at a stage, asked for some tokens, against replaying every Repos from the start."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.cache.stages import StagePositions

from .conversations import Conversation, conversations


@settings(max_examples=200, deadline=None)
@given(conversations(max_messages=10), st.data())
def test_positions_at_a_stage_are_those_of_a_full_replay(conv: Conversation, data: st.DataObject) -> None:
    program = conv.program(conv.n_turns - 1)
    stages = StagePositions(program)
    moves = {t.event: t for t in program.transitions}
    current = program.birth_position.copy()
    for stage in range(program.n_stages):
        if stage:
            move = moves.get(stage - 1)
            if move is not None:
                current[move.tokens] = move.new_positions
        asked = np.flatnonzero(np.asarray(data.draw(st.lists(st.booleans(), min_size=program.n_tokens,
                                                             max_size=program.n_tokens)), dtype=bool))
        assert np.array_equal(stages.at(stage, asked), current[asked]), stage
