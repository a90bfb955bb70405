"""The H200 run's requests, offline: the browse trajectory carried on past 3x a 131,072-token context
length, decided by ``akv_live_budget``, compiles to requests whose live length and peak position while
computed all fit the context (the compiler counts them; no server needed), so none would be refused."""

from __future__ import annotations

import numpy as np

from akv.system.context.compiler import compile_program
from akv.system.context.limits import live_length, peak_length
from akv.system.context.rules import parse_rules
from bench.agent_replay.methods import default_methods
from bench.agent_replay.trajectories import PRESETS, generate

CONTEXT = 131_072
BUDGET = 96_000
OUTPUT = 128


def test_a_browse_run_3x_the_context_stays_live_under_the_budget() -> None:
    trajectory = generate(PRESETS["browse"], 0, "browse-0", 90)
    assert trajectory.total_tokens > 3 * CONTEXT
    method = next(m for m in default_methods(live_budget=BUDGET) if m.name == "akv_live_budget")
    requests = list(method.requests(trajectory))
    last = requests[-1]
    sizes = [p.tokens for p in last.pieces] + [trajectory.generation_tokens]
    owners = np.repeat(np.arange(len(sizes)), sizes)
    n = len(last.pieces)
    program = compile_program(np.zeros(owners.size, dtype=np.int64), owners,
                              parse_rules(last.drop_message, last.reposition, n), n)
    assert program.n_prompt > 3 * CONTEXT
    assert live_length(program) <= BUDGET
    assert live_length(program) + OUTPUT <= CONTEXT and peak_length(program) <= CONTEXT
