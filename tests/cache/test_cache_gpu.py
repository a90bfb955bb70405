"""On the GPU: the copy jobs of real plans run through the Triton re-rotation kernel give the FP32
reference result, in plan order, on a bf16 pool shaped like a small Qwen3 cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import rerotate_kv
from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from akv.system.reference.rope import rerotate

from .conversations import Conversation

SLOTS, LAYERS, HEADS, DIM, THETA = 2000, 4, 8, 128, 1_000_000.0


def _plans() -> list:
    rng = np.random.default_rng(0)
    messages = tuple(tuple(rng.integers(0, 1000, size=int(rng.integers(20, 60))).tolist()) for _ in range(12))
    agent = Conversation(messages, {3: (1, 2), 6: (4,), 9: (5, 7)}, (3, 6, 9))
    core = CacheCore(SlotPool(SLOTS - 1))
    plans = []
    for turn in range(agent.n_turns):
        request = core.admit(agent.program(turn))
        plans.append(request.plan)
        core.finish(request)
    cold = core.admit(Conversation(messages, {2: (0,), 5: (1, 3), 8: (6,)}, (2, 5, 8)).program(11))
    plans.append(cold.plan)
    return plans


@pytest.mark.gpu
def test_plan_copy_jobs_on_the_triton_kernel_match_the_reference() -> None:
    torch.manual_seed(0)
    spec = RopeSpec(theta=THETA, head_dim=DIM, rotary_dim=DIM)
    rope = RopeTable.build(spec, 4096, "cuda")
    k = torch.randn(LAYERS, SLOTS, HEADS, DIM, device="cuda").to(torch.bfloat16)
    v = torch.randn(LAYERS, SLOTS, HEADS, DIM, device="cuda").to(torch.bfloat16)
    k_ref, v_ref = k.float().cpu(), v.float().cpu()
    jobs = [job for plan in _plans() for job in plan.copies if job.size]
    assert len(jobs) >= 5
    for job in jobs:
        src, dst = torch.from_numpy(job.src.copy()), torch.from_numpy(job.dst.copy())
        old, new = torch.from_numpy(job.old_positions.copy()), torch.from_numpy(job.new_positions.copy())
        rerotate_kv(LayerBuffers.of(k), LayerBuffers.of(v), src.cuda(), dst.cuda(), old.cuda(), new.cuda(), rope)
        k_ref[:, dst] = torch.stack([rerotate(k_ref[layer, src], old, new, theta=THETA) for layer in range(LAYERS)])
        k_ref[:, dst] = k_ref[:, dst].to(torch.bfloat16).float()
        v_ref[:, dst] = v_ref[:, src]
    torch.testing.assert_close(k.float().cpu(), k_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(v.float().cpu(), v_ref, atol=0, rtol=0)
