"""KV produced through the cache planner and the reference executor (reused, re-rotated and
recomputed entries) gives the oracle's log-probabilities computed from scratch (FP32)."""

from __future__ import annotations

import numpy as np
import torch

from akv.system.cache.core import ActiveRequest, CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import append_generated
from akv.system.reference.executor import PagedKV, run_decode, run_prefill
from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import run_program

from .conversations import Conversation

POOL = 400
TOL = 2e-5


def _messages(seed: int, n: int) -> tuple[tuple[int, ...], ...]:
    rng = np.random.default_rng(seed)
    return tuple(tuple(rng.integers(0, 512, size=int(rng.integers(3, 7))).tolist()) for _ in range(n))


def _run_turn(model: ReferenceModel, core: CacheCore, kv: PagedKV, conv: Conversation, turn: int,
              max_chunk: int | None = None) -> ActiveRequest:
    """Admit, execute, compare prefill and decode log-probs with the oracle, finish with the reply."""
    program = conv.program(turn)
    request = core.admit(program)
    logits = run_prefill(model, program, request.plan, kv, max_chunk)
    expected = run_program(model, program).log_probs()
    computed = np.flatnonzero(request.plan.computed).tolist()
    assert sorted(logits) == computed and program.n_tokens - 1 in logits
    for t in computed:
        torch.testing.assert_close(torch.log_softmax(logits[t], -1), expected[t], atol=TOL, rtol=0)
    reply = conv.reply(turn)
    slots = core.allocate(reply.size)
    decoded = torch.log_softmax(run_decode(model, request.plan, kv, reply, slots), -1)
    extended = run_program(model, append_generated(program, reply)).log_probs()
    torch.testing.assert_close(decoded, extended[program.n_tokens :], atol=TOL, rtol=0)
    core.finish(request, reply, slots)
    return request


def test_agent_turns_and_branches_match_the_oracle(tiny_qwen3: ReferenceModel) -> None:
    messages = _messages(0, 7)
    agent = Conversation(messages, {3: (1, 2), 5: (4,)}, (3, 5))
    same_text = Conversation(messages, {3: (2,)}, (3,))
    branch = Conversation(messages[:4] + _messages(1, 2), {}, (4,))
    core = CacheCore(SlotPool(POOL))
    kv = PagedKV.empty(tiny_qwen3, POOL + 1)
    plans = [_run_turn(tiny_qwen3, core, kv, agent, turn).plan for turn in range(agent.n_turns)]
    assert any(p.terminal.copies.size for p in plans), "no re-rotation happened"
    assert all(p.usage.cached_tokens > 0 for p in plans[1:]), "later turns reused nothing"
    assert plans[-1].usage.drop_skipped_tokens > 0 and plans[-1].usage.repos_tokens == 0

    plans = [_run_turn(tiny_qwen3, core, kv, same_text, turn).plan for turn in (4, 5)]
    assert plans[0].match.n_tokens == agent.program(3).n_tokens, "matched past a different drop"

    core.tree.evict(10)
    plans = [_run_turn(tiny_qwen3, core, kv, branch, turn, max_chunk=3).plan for turn in (3, 4, 5)]
    first = plans[0]
    recomputed = first.computed[: first.match.n_tokens - 1]
    assert first.match.n_tokens == branch.program(3).n_tokens and recomputed.any(), "no recovery happened"
    assert len(first.segments) >= 2, "recovery did not need segmented prefill"
