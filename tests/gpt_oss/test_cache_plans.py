"""gpt-oss-tiny through the cache planner and the reference executor: reused, re-rotated (YaRN) and
recomputed KV read through slot lists gives the oracle's log-probabilities, sliding layers and sinks
included (FP32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from akv.system.cache.core import ActiveRequest, CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.context.compiler import append_generated
from akv.system.reference.executor import PagedKV, run_decode, run_prefill
from akv.system.reference.gpt_oss import GptOssReferenceModel
from akv.system.reference.oracle import run_program
from tests.cache.conversations import Conversation
from tests.gpt_oss.conftest import WINDOW

POOL = 300
TOL = 3e-4  # logits reach about +-40; FP32 round-off of different summation orders


@pytest.fixture(scope="module")
def model(gpt_oss_dir: Path) -> GptOssReferenceModel:
    return GptOssReferenceModel.from_pretrained(gpt_oss_dir)


def _messages(seed: int, n: int) -> tuple[tuple[int, ...], ...]:
    rng = np.random.default_rng(seed)
    return tuple(tuple(rng.integers(0, 201088, size=int(rng.integers(3, 7))).tolist()) for _ in range(n))


def _run_turn(model: GptOssReferenceModel, core: CacheCore, kv: PagedKV, conv: Conversation, turn: int,
              max_chunk: int | None = None) -> ActiveRequest:
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


def test_agent_turns_and_a_branch_match_the_oracle(model: GptOssReferenceModel) -> None:
    messages = _messages(0, 8)
    agent = Conversation(messages, {3: (1, 2), 6: (4,)}, (3,))  # the drop at 6 leaves a gap, no reposition
    branch = Conversation(messages[:5] + _messages(1, 2), {}, (4,))
    assert sum(len(m) for m in messages[:3]) > WINDOW
    core = CacheCore(SlotPool(POOL))
    kv = PagedKV.empty(model, POOL + 1)
    plans = [_run_turn(model, core, kv, agent, turn).plan for turn in range(agent.n_turns)]
    assert any(p.terminal.copies.size for p in plans), "no re-rotation happened"
    assert all(p.usage.cached_tokens > 0 for p in plans[1:]), "later turns reused nothing"
    core.tree.evict(10)
    plans = [_run_turn(model, core, kv, branch, turn, max_chunk=3).plan for turn in (4, 5, 6)]
    assert plans[0].computed.any()
