"""An extend forward's attention entries and per-layer copy levels
(``akv.system.adapter.extend_entries``), on hand-made inputs; SGLang's real scheduler serves them in
tests/sglang_cpu."""

from __future__ import annotations

import numpy as np
import torch

from akv.system.adapter.extend_entries import ExtendEntries, add_layer_jobs
from akv.system.cache.plan import CopyJob


def _job(src: list[int], dst: list[int]) -> CopyJob:
    a, b = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    return CopyJob(b * 0, a, b, a * 0, a * 0 + 1)


def test_a_copy_that_reads_another_copys_slot_runs_in_a_later_level() -> None:
    levels: list[list[CopyJob]] = []
    first, chained, independent = _job([1, 2], [10, 11]), _job([11], [12]), _job([3], [13])
    add_layer_jobs(levels, [first, independent, chained])  # one request: the chain starts a level
    add_layer_jobs(levels, [_job([4], [14])])  # another request's job joins the first level
    assert [[j.dst.tolist() for j in level] for level in levels] == [[[10, 11], [13], [14]], [[12]]]


def test_entries_list_each_prefix_then_its_own_slots() -> None:
    req_to_token = torch.arange(100, dtype=torch.int32).reshape(4, 25)  # row r, column c holds 25 r + c
    entries = ExtendEntries(
        rows=np.array([2, -1, -1, 1]), n_prefix=np.array([3, 2, 4, 0]), n_own=np.array([2, 1, 2, 3]),
        qo_indptr=torch.tensor([0, 2, 3, 5, 8], dtype=torch.int32),
        context_prefix=torch.tensor([90, 91, 92, 93, 94, 95], dtype=torch.int32),
        context_own=torch.tensor([80, 81, 82], dtype=torch.int32))
    indptr, indices = entries.kv_lists(req_to_token, include_own=False, dtype=torch.int64)
    assert indptr.tolist() == [0, 3, 5, 9, 9] and indices.dtype == torch.int64
    assert indices.tolist() == [50, 51, 52, 90, 91, 92, 93, 94, 95]
    indptr, indices = entries.kv_lists(req_to_token, include_own=True, dtype=torch.int32)
    assert indptr.tolist() == [0, 5, 8, 14, 17]
    assert indices.tolist() == [50, 51, 52, 53, 54, 90, 91, 80, 92, 93, 94, 95, 81, 82, 25, 26, 27]
