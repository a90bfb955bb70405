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


class _Event:
    """A device copy's completion as ``torch.cuda.Event`` reports it."""

    def __init__(self) -> None:
        self.complete = False
        self.waited = 0

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.waited += 1
        self.complete = True


def test_copies_apply_in_allocation_order_and_reading_waits_for_those_in_flight() -> None:
    row = host_rows.HostRow()
    truth = np.full(host_rows._RESOLVE_AT + 2, -1, dtype=np.int64)
    slow = _Event()
    row.expect(host_rows._Copy(torch.tensor([5, 6]), slow), 0, 2, 0)  # columns 0-1, still in flight
    truth[:2] = [5, 6]
    for step in range(host_rows._RESOLVE_AT):  # later copies done, one overwriting column 1
        copy = host_rows._Copy(torch.tensor([100 + step, 9]), _Event())
        copy.done.complete = True
        row.expect(copy, 0, 1, 1 + step)
        truth[1 + step] = 100 + step
    assert len(row.pending) == host_rows._RESOLVE_AT + 1 and slow.waited == 0, "applied past a copy in flight"
    again = host_rows._Copy(torch.tensor([77]), None)  # column 3 allocated again (the latest wins)
    row.expect(again, 0, 1, 3)
    truth[3] = 77
    assert np.array_equal(row.get(host_rows._RESOLVE_AT + 1), truth[: host_rows._RESOLVE_AT + 1])
    assert slow.waited == 1 and not row.pending
