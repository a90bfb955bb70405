"""The TP plan check: equal plans pass on every rank, one rank's drift stops them all."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from akv.system.adapter import tp_check


def test_digest_covers_values_shapes_and_dtypes() -> None:
    a = np.arange(6, dtype=np.int64)
    assert tp_check.digest(a, a) == tp_check.digest(a.copy(), a.copy())
    assert tp_check.digest(a) != tp_check.digest(a.reshape(2, 3))
    assert tp_check.digest(a) != tp_check.digest(a.astype(np.int32))
    assert tp_check.digest(a) != tp_check.digest(np.r_[a[:5], 9])
    assert tp_check.digest(a[:3], a[3:]) != tp_check.digest(a[:2], a[2:])


def test_off_by_default_and_a_single_rank_checks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tp_check.ENV, raising=False)
    assert not tp_check.enabled()
    tp_check.check_plan(np.zeros(3))  # no TP group needed when off


def _rank(rank: int, port: int, drift: bool, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    plan = np.arange(4) + (rank if drift else 0)
    try:
        tp_check.compare(tp_check.digest(plan), dist.group.WORLD)
        results[rank] = "same"
    except tp_check.PlanDrift as exc:
        results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("drift", [False, True])
def test_two_gloo_ranks_agree_or_both_fail_loudly(drift: bool) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(_free_port(), drift, results), nprocs=2, join=True)
        outcome = dict(results)
    if drift:
        assert all("planned one forward differently" in outcome[r] for r in (0, 1)), outcome
    else:
        assert outcome == {0: "same", 1: "same"}
