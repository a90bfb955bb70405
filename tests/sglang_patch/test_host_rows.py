"""A request's host row against a brute-force ``req_to_token`` row: allocations land in their
columns in order, a later publication overwrites and forgets what follows, and a column never
written is refused rather than guessed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from akv.system.adapter import host_rows


def test_rows_follow_allocations_and_publications_like_req_to_token() -> None:
    reqs = [SimpleNamespace(), SimpleNamespace()]
    truth = np.full((2, 64), -1, dtype=np.int64)
    rng = np.random.default_rng(0)

    def alloc(columns: list[int], counts: list[int]) -> None:
        slots = rng.permutation(10_000)[: sum(counts)]
        offset = 0
        for i, (column, n) in enumerate(zip(columns, counts)):
            truth[i, column : column + n] = slots[offset : offset + n]
            offset += n
        host_rows.record(reqs, columns, counts, torch.from_numpy(slots))

    prefix = np.array([7, 8, 9], dtype=np.int64)
    host_rows.row_of(reqs[0]).set(0, prefix)  # a matched prefix
    truth[0, :3] = prefix
    host_rows.row_of(reqs[1]).set(0, prefix[:0])
    alloc([3, 0], [5, 4])  # extend
    for step in range(40):  # decode steps: more than a row keeps pending
        alloc([8 + step, 4 + step], [1, 1])
    for i, length in ((0, 48), (1, 44)):
        assert np.array_equal(host_rows.row_of(reqs[i]).get(length), truth[i, :length])

    resident = np.arange(100, 110, dtype=np.int64)  # publication swaps in the tree's slots
    host_rows.row_of(reqs[0]).set(0, resident)
    assert np.array_equal(host_rows.row_of(reqs[0]).get(10), resident)
    with pytest.raises(RuntimeError, match="length: 11 columns asked, 10 known"):
        host_rows.row_of(reqs[0]).get(11)
