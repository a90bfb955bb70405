"""bench/admission_sglang_cpu.py --agent: the waves it serves are the agent it describes."""

from __future__ import annotations

import base64

import numpy as np

from akv.system.context.limits import live_length
from akv.system.context.program import ContextProgram
from akv.system.context.wire import decode_program
from bench.admission_sglang_cpu import agent_waves


def test_agent_waves_keep_live_under_budget_and_the_floor_serves_the_live_tokens() -> None:
    budget, turns = 6000, 24
    waves, rows = agent_waves(turns, budget, floor_every=5)
    assert [r["turn"] for r in rows] == list(range(turns))
    floors = 0
    for row in rows:
        (request,) = waves[row["akv_wave"]]["requests"]
        program = decode_program(base64.b64decode(request["program"]))
        assert program.n_tokens == row["text_tokens"] == len(request["ids"])
        assert live_length(program) == row["live_tokens"]  # the compiler's count, not the bench's sum
        assert row["live_tokens"] <= budget
        if "floor_wave" not in row:
            continue
        floors += 1
        (prime,) = waves[row["floor_wave"] - 1]["requests"]
        (floor,) = waves[row["floor_wave"]]["requests"]
        live = program.token_ids[program.keep]
        assert len(floor["ids"]) == row["live_tokens"]
        assert floor["ids"][1:] == live[1:].tolist() and floor["ids"][0] != live[0]
        assert floor["ids"][: len(prime["ids"])] == prime["ids"] and prime["program"] is None
        assert len(floor["ids"]) - len(prime["ids"]) == _last_two(program)
    assert floors == turns // 5 + 1


def _last_two(program: ContextProgram) -> int:
    """Tokens of the program's last two messages (the turn's call and result)."""
    owners = program.owners
    return int(np.sum(owners >= owners.max() - 1))
