"""MiniMax-M2 KV through the cache planner and the reference executor (reused, re-rotated on the first
64 dims, recomputed) gives the oracle's log-probabilities computed from scratch (FP32)."""

from __future__ import annotations

import numpy as np
import torch

from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import compile_program
from akv.system.context.program import ContextProgram
from akv.system.context.rules import parse_rules
from akv.system.reference.executor import PagedKV, run_decode, run_prefill
from akv.system.reference.minimax_m2 import MiniMaxM2Model
from akv.system.reference.oracle import run_program

POOL = 300
TOL = 2e-5
MESSAGES = tuple(
    tuple(np.random.default_rng(seed).integers(0, 512, size=4 + seed % 3).tolist()) for seed in range(7)
)
DROPS = {3: (1, 2), 5: (4,)}
REPOSITIONS = (3, 5)


def _program(turn: int) -> ContextProgram:
    ids = [t for m in MESSAGES[: turn + 1] for t in m]
    owners = [i for i, m in enumerate(MESSAGES[: turn + 1]) for _ in m]
    drops = {str(a): list(ms) for a, ms in DROPS.items() if a <= turn} or None
    repositions = [r for r in REPOSITIONS if r <= turn] or None
    return compile_program(np.array(ids), np.array(owners), parse_rules(drops, repositions, turn + 1), turn + 1)


def test_agent_turns_with_drops_and_repositions_match_the_oracle(minimax: MiniMaxM2Model) -> None:
    core, kv = CacheCore(SlotPool(POOL)), PagedKV.empty(minimax, POOL + 1)
    plans = []
    for turn in range(len(MESSAGES) - 1):
        program = _program(turn)
        request = core.admit(program)
        logits = run_prefill(minimax, program, request.plan, kv)
        expected = run_program(minimax, program).log_probs()
        for t in np.flatnonzero(request.plan.computed).tolist():
            torch.testing.assert_close(torch.log_softmax(logits[t], -1), expected[t], atol=TOL, rtol=0)
        reply = np.array(MESSAGES[turn + 1], dtype=np.int64)
        slots = core.allocate(reply.size)
        run_decode(minimax, request.plan, kv, reply, slots)
        core.finish(request, reply, slots)
        plans.append(request.plan)
    assert any(p.terminal.copies.size for p in plans), "no re-rotation happened"
    assert all(p.usage.cached_tokens > 0 for p in plans[1:]), "later turns reused nothing"
