"""The adapter's sliding-window lists for SGLang's triton backend, and where an extend round has to
end for the kernel's index window to give every query its positional window."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.adapter.window_lists import PositionTable, exact_round_end, triton_window_lists
from akv.system.kernels import VisibleUntil, decode_kv_indices


def kernel_keeps(n_listed: int, j: int, radius: int) -> set[int]:
    """SGLang's extend kernel, stage 1: query ``j`` of the round (index ``n_listed + j``) keeps list
    entry ``i`` iff ``q_id <= i + radius``."""
    return {i for i in range(n_listed) if n_listed + j <= i + radius}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_round_end_is_the_first_query_the_kernel_would_serve_wrongly(data: st.DataObject) -> None:
    window = data.draw(st.integers(2, 10))
    p0 = data.draw(st.integers(0, 30))
    keys = sorted(data.draw(st.sets(st.integers(0, max(p0 - 1, 0)), max_size=p0)) if p0 else [])
    n = data.draw(st.integers(1, 14))
    queries = np.arange(p0, p0 + n)
    listed = [k for k in keys if k > p0 - window]
    exact = [kernel_keeps(len(listed), j, window - 1) == {i for i, k in enumerate(listed) if k > p0 + j - window}
             for j in range(n)]
    expected = exact.index(False) if False in exact else n
    assert exact_round_end(np.array(keys), queries, window) == max(1, expected)


def test_a_gap_right_before_the_round_ends_it_after_one_query() -> None:
    # W = 8: keys 21, 26, 27 before a round at 28 (22..25 dropped); query 29 must lose key 21
    assert exact_round_end(np.array([0, 5, 21, 26, 27]), np.arange(28, 40), 8) == 1
    # the next round, at 29, lists 26, 27, 28: contiguous up to the round, exact to the end
    assert exact_round_end(np.array([0, 5, 21, 26, 27, 28]), np.arange(29, 40), 8) == 11
    # a gap at the front of the window does not matter
    assert exact_round_end(np.array([0, 1, 2, 22, 23, 24, 25]), np.arange(26, 40), 8) == 14


def test_decode_window_lists_context_by_position_and_plain_like_stock() -> None:
    """Entry 0 (context, row 1): columns 0..9, columns 7..8 dropped without a reposition, decoding
    at column 9 = position 9. Entry 1 (plain, row 0): 10 columns. W = 4."""
    width = 12
    req_to_token = torch.arange(100, 100 + 2 * width, dtype=torch.int32).reshape(2, width)
    visible_until = torch.full((3, width), np.iinfo(np.int32).max, dtype=torch.int32)
    visible_until[1, 7:9] = 0
    positions = PositionTable(req_to_token)
    positions.table[1, :10] = torch.arange(10, dtype=torch.int32)
    rows = torch.tensor([1, 0])
    seq_lens = torch.tensor([10, 10])
    visibility = VisibleUntil(visible_until=visible_until, rows=rows, query_index=seq_lens - 1)
    full = decode_kv_indices(req_to_token, torch.tensor([0, 1]), seq_lens, visibility, index_dtype=torch.int64)
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_decode_or_idle=lambda: True), seq_lens=seq_lens,
        akv=SimpleNamespace(key_positions=positions.table, visibility=visibility, positions=torch.tensor([9, 9])),
    )
    indptr, indices, lens, _ = triton_window_lists(batch, full.kv_indptr, full.kv_indices, radius=3)
    # context: positions > 9 - 4 -> columns 6 and 9 (not the last 4 visible); plain (stock): 3 columns
    assert indices[: int(indptr[1])].tolist() == [106, 109]
    assert indices[int(indptr[1]) : int(indptr[2])].tolist() == [119, 120, 121]
    assert lens.tolist() == [2, 3]
