"""A bounded soak through SGLang's real scheduler on the CPU: concurrent agent conversations, their
branches and retries, drops and repositions, on a KV pool several times smaller than what they
publish. Every request equals the oracle, every cache read holds the KV of the request's own event
history (the driver's brute-force audit), the allocator never hands out or frees a slot the cache
holds, and the pool is back to its start after every wave with SGLang's strict leak check on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from akv.system.reference.model import ReferenceModel

from . import scenarios
from .conftest import serve
from .scenarios import Conversation, Request
from .test_scheduler import assert_exact, assert_pool_back

pytestmark = pytest.mark.slow
POOL = 300
TURNS = 8
FORK = 3


def _agent_turns(conv: Conversation, rid: str, first: int, last: int, *, first_kept: int) -> list[Request]:
    """Turns ``first..last`` of a tool loop over ``conv``: an assistant call and a tool result per turn;
    from turn 2 the oldest kept message of every other one from ``first_kept`` on (2: the calls,
    3: the tool results) is dropped, repositioned every third turn; turn 0 is a plain request."""
    requests = []
    for turn in range(first, last + 1):
        if turn:
            conv.add(4, 9)
            dropped = {m for v in conv.drops.values() for m in v}
            kept = [m for m in range(first_kept, len(conv.messages) - 2, 2) if m not in dropped]
            if turn >= 2 and kept:
                conv.drop(kept[0])
            if turn % 3 == 0:
                conv.reposition()
        requests.append(conv.request(f"{rid}-{turn}", plain=turn == 0, max_new=4))
    return requests


def soak_waves() -> list[list[Request]]:
    """Wave ``t`` holds turn ``t`` of every conversation: three agents, a branch of each forked after
    turn ``FORK`` (the same messages, ever after, but it drops tool results where the agent drops
    calls: the same tokens with another event history), and at the fork a retry of each agent's
    turn sent alongside it."""
    lanes: list[list[Request]] = []
    for i, seed in enumerate((40, 41, 42)):
        agent = Conversation(seed).add(7, 5)
        lanes.append(_agent_turns(agent, f"agent{i}", 0, FORK, first_kept=2))
        branch = agent.copy()
        lanes[-1] += _agent_turns(agent, f"agent{i}", FORK + 1, TURNS - 1, first_kept=2)
        lanes.append([None] * (FORK + 1) + _agent_turns(branch, f"branch{i}", FORK + 1, TURNS - 1, first_kept=3))
        retry = lanes[-2][FORK]
        lanes.append([None] * FORK + [Request(f"retry{i}", retry.ids, retry.program, max_new=4)])
    return [[lane[t] for lane in lanes if t < len(lane) and lane[t] is not None] for t in range(TURNS)]


@pytest.fixture(scope="module")
def soak(patched_site: Path, tiny_qwen3: Path) -> tuple[list[list[Request]], dict]:
    waves = soak_waves()
    return waves, serve(patched_site, tiny_qwen3, scenarios.job(waves), chunk=32, max_total_tokens=POOL, audit=True)


def test_soak_is_exact_audited_and_leak_free(soak: tuple[list[list[Request]], dict], tiny_qwen3: Path) -> None:
    waves, report = soak
    model = ReferenceModel.from_pretrained(tiny_qwen3, dtype=torch.float32)
    requests = [r for wave in waves for r in wave]
    for request in requests:
        assert_exact(model, request, report["results"][request.rid])
    audit = report["audit"]
    n_context = sum(r.program is not None for r in requests)
    assert audit["context_plans"] >= n_context, f"the audit saw {audit['context_plans']} of {n_context} context plans"
    assert audit["plain_publications"] >= sum(r.program is None for r in requests)
    assert_pool_back(report)


def test_soak_runs_under_memory_pressure(soak: tuple[list[list[Request]], dict]) -> None:
    """What the conversations publish is several times the pool, so the tree evicts again and again."""
    waves, report = soak
    published = sum(len(r.ids) + r.max_new for wave in waves for r in wave)
    assert published >= 4 * POOL, published
    assert report["audit"]["evicted"] >= 2 * POOL, report["audit"]
    branched = [r for wave in waves for r in wave if r.rid.startswith("branch")]
    assert branched and all(r.program is not None and r.program.events for r in branched)
    assert np.mean([len(wave) for wave in waves[FORK:]]) >= 6, "branches run concurrently with their agents"
