"""Visible KV index lists (Triton kernels and the PyTorch reference) against a brute-force walk over
every column of every entry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.kernels.kv_indices import (
    HiddenRanges,
    KeepMask,
    VisibleUntil,
    decode_kv_indices,
    extend_kv_indices,
    visible_kv_indices,
)
from akv.system.kernels.kv_indices_reference import visible_kv_indices_reference

ROWS, WIDTH = 4, 70
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="builds CPU tensors for the Triton interpreter (CI); the H200 runs the gpu-marked tests",
)


def brute_force(req_to_token, rows, kv_lens, visible, forced_from=None) -> tuple[list[int], list[int]]:
    """CSR of ``req_to_token[rows[i], c]`` for columns ``c < kv_lens[i]`` where ``visible(i, c)`` or
    ``c >= forced_from[i]``."""
    indptr, indices = [0], []
    for i, (row, n) in enumerate(zip(rows.tolist(), kv_lens.tolist())):
        for c in range(n):
            if visible(i, c) or (forced_from is not None and c >= int(forced_from[i])):
                indices.append(int(req_to_token[row, c]))
        indptr.append(len(indices))
    return indptr, indices


def ranges_visible(indptr: list[int], bounds: list[tuple[int, int]]):
    def visible(i: int, c: int) -> bool:
        return not any(start <= c < end for start, end in bounds[indptr[i] : indptr[i + 1]])

    return visible


@st.composite
def batches(draw):
    n = draw(st.integers(0, 5))
    rows = draw(st.lists(st.integers(0, ROWS - 1), min_size=n, max_size=n))
    kv_lens = draw(st.lists(st.integers(0, WIDTH), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**16))
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(kv_lens, dtype=torch.int32), seed


@st.composite
def hidden_ranges(draw, n_entries: int):
    indptr, bounds = [0], []
    for _ in range(n_entries):
        cuts = sorted(draw(st.sets(st.integers(0, WIDTH + 5), max_size=8)))
        pairs = [(a, b) for a, b in zip(cuts[0::2], cuts[1::2])]
        bounds.extend(pairs)
        indptr.append(len(bounds))
    return indptr, bounds


def table(seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(1, 10_000, (ROWS, WIDTH), generator=gen, dtype=torch.int32)
    return gen, req_to_token, req_to_token.to(device)


def check(result, expected) -> None:
    indptr, indices = expected
    assert result.kv_indptr.tolist() == indptr
    assert result.kv_indices[: indptr[-1]].tolist() == indices
    assert result.kv_last_page_len.tolist() == [1] * (len(indptr) - 1)


def on(device, *tensors):
    return [t.to(device) for t in tensors]


@settings(max_examples=15, deadline=None)
@given(batch=batches(), use_forced=st.booleans())
def test_keep_mask(batch, use_forced):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, kv_lens, seed = batch
    gen, req_to_token, r2t = table(seed, device)
    keep = torch.rand(ROWS, WIDTH, generator=gen) < 0.5
    forced = (kv_lens - 3).clamp(min=0) if use_forced else None
    arguments = (r2t, *on(device, rows, kv_lens), KeepMask(*on(device, keep, rows)))
    forced_from = None if forced is None else forced.to(device)
    expected = brute_force(req_to_token, rows, kv_lens, lambda i, c: bool(keep[rows[i], c]), forced)
    check(visible_kv_indices(*arguments, forced_from=forced_from), expected)
    check(visible_kv_indices_reference(*arguments, forced_from=forced_from), expected)


@settings(max_examples=15, deadline=None)
@given(batch=batches(), query_seed=st.integers(0, 100))
def test_visible_until(batch, query_seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, kv_lens, seed = batch
    gen, req_to_token, r2t = table(seed, device)
    visible_until = torch.randint(0, WIDTH + 1, (ROWS, WIDTH), generator=gen)
    query = (torch.arange(rows.shape[0]) * 7 + query_seed) % WIDTH
    arguments = (r2t, *on(device, rows, kv_lens), VisibleUntil(*on(device, visible_until, rows, query)))
    expected = brute_force(req_to_token, rows, kv_lens, lambda i, c: bool(visible_until[rows[i], c] > query[i]))
    check(visible_kv_indices(*arguments), expected)
    check(visible_kv_indices_reference(*arguments), expected)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), batch=batches(), use_forced=st.booleans())
def test_hidden_ranges(data, batch, use_forced):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, kv_lens, seed = batch
    _, req_to_token, r2t = table(seed, device)
    indptr, bounds = data.draw(hidden_ranges(rows.shape[0]))
    forced = (kv_lens // 2) if use_forced else None
    ranges = HiddenRanges(torch.tensor(indptr, device=device),
                          torch.tensor(bounds, dtype=torch.int64, device=device).view(-1, 2))
    forced_from = None if forced is None else forced.to(device)
    expected = brute_force(req_to_token, rows, kv_lens, ranges_visible(indptr, bounds), forced)
    check(visible_kv_indices(r2t, *on(device, rows, kv_lens), ranges, forced_from=forced_from), expected)
    check(visible_kv_indices_reference(r2t, *on(device, rows, kv_lens), ranges, forced_from=forced_from), expected)


def test_all_visible_and_preallocated_buffer(device):
    _, req_to_token, r2t = table(1, device)
    rows, kv_lens = torch.tensor([3, 0, 3]), torch.tensor([5, 70, 0])
    buffer = torch.full((200,), -7, dtype=torch.int64, device=device)
    result = visible_kv_indices(r2t, *on(device, rows, kv_lens), None, out=buffer)
    assert result.kv_indices is buffer and result.kv_indices.dtype == torch.int64
    check(result, brute_force(req_to_token, rows, kv_lens, lambda i, c: True))
    assert buffer[75:].tolist() == [-7] * 125


def test_decode_always_reads_the_token_being_decoded(device):
    _, req_to_token, r2t = table(2, device)
    rows, seq_lens = torch.tensor([1, 2]), torch.tensor([10, 4])
    keep = torch.zeros(ROWS, WIDTH, dtype=torch.bool)
    keep[1, :3] = True
    result = decode_kv_indices(r2t, *on(device, rows, seq_lens), KeepMask(*on(device, keep, rows)))
    assert result.kv_indptr.tolist() == [0, 4, 5]
    assert result.kv_indices.tolist() == req_to_token[1, [0, 1, 2, 9]].tolist() + [int(req_to_token[2, 3])]


def test_extend_segments_in_both_backend_forms(device):
    """Segments [4, 9) and [9, 12) of row 0; the second one no longer sees columns 1..2."""
    _, req_to_token, r2t = table(3, device)
    rows, prefix, extend = torch.tensor([0, 0]), torch.tensor([4, 9]), torch.tensor([5, 3])
    ranges = HiddenRanges(torch.tensor([0, 0, 1], device=device), torch.tensor([[1, 3]], device=device))
    triton_form = extend_kv_indices(r2t, *on(device, rows, prefix, extend), ranges, include_extend=False)
    assert triton_form.qo_indptr.tolist() == [0, 5, 8]
    assert triton_form.kv.kv_indptr.tolist() == [0, 4, 11]
    assert triton_form.kv.kv_indices.tolist() == req_to_token[0, [0, 1, 2, 3, 0, 3, 4, 5, 6, 7, 8]].tolist()
    paged_form = extend_kv_indices(r2t, *on(device, rows, prefix, extend), ranges, include_extend=True)
    assert paged_form.kv.kv_indptr.tolist() == [0, 9, 19]
    assert paged_form.kv.kv_indices.tolist() == req_to_token[0, [*range(9), 0, *range(3, 12)]].tolist()


def test_hidden_range_over_a_forced_column_is_ignored(device):
    _, req_to_token, r2t = table(4, device)
    rows, prefix, extend = torch.tensor([2]), torch.tensor([5]), torch.tensor([3])
    ranges = HiddenRanges(torch.tensor([0, 1], device=device), torch.tensor([[3, 7]], device=device))
    paged_form = extend_kv_indices(r2t, *on(device, rows, prefix, extend), ranges, include_extend=True)
    assert paged_form.kv.kv_indices.tolist() == req_to_token[2, [0, 1, 2, 5, 6, 7]].tolist()


@CPU_ONLY
@pytest.mark.parametrize(
    ("indptr", "bounds", "message"),
    [
        ([0, 1], [[3, 3]], r"bounds\[0\] = \[3, 3\] is not a non-empty range"),
        ([0, 2], [[3, 6], [5, 8]], r"bounds\[1\] = \[5, 8\] is not after bounds\[0\] = \[3, 6\]"),
        ([0, 1], [[-1, 2]], "is not a non-empty range"),
        ([1, 1], [[1, 2]], "must rise from 0 to 1"),
        ([0], [[1, 2]], r"indptr must have shape \[2\]"),
    ],
)
def test_bad_hidden_ranges(indptr, bounds, message):
    ranges = HiddenRanges(torch.tensor(indptr), torch.tensor(bounds))
    with pytest.raises(ValueError, match=message):
        visible_kv_indices(torch.zeros(2, 10, dtype=torch.int32), torch.tensor([0]), torch.tensor([5]), ranges)


@CPU_ONLY
def test_ranges_of_different_entries_may_restart():
    ranges = HiddenRanges(torch.tensor([0, 1, 2]), torch.tensor([[3, 6], [1, 2]]))
    result = visible_kv_indices(torch.arange(20, dtype=torch.int32).view(2, 10), torch.tensor([0, 1]),
                                torch.tensor([8, 4]), ranges)
    assert result.kv_indices.tolist() == [0, 1, 2, 6, 7, 10, 12, 13]


@CPU_ONLY
def test_other_bad_inputs():
    r2t = torch.zeros(2, 10, dtype=torch.int32)
    rows, lens = torch.tensor([0]), torch.tensor([5])
    with pytest.raises(ValueError, match="kv_lens max 11 exceeds req_to_token width 10"):
        visible_kv_indices(r2t, rows, torch.tensor([11]), None)
    with pytest.raises(ValueError, match=r"kv_lens must have shape \[1\], got \(2,\)"):
        visible_kv_indices(r2t, rows, torch.tensor([1, 2]), None)
    with pytest.raises(ValueError, match="KeepMask.keep must be bool"):
        visible_kv_indices(r2t, rows, lens, KeepMask(torch.zeros(2, 10, dtype=torch.int32), rows))
    with pytest.raises(ValueError, match=r"KeepMask.rows \[5\] index outside \[0, 2\)"):
        visible_kv_indices(r2t, rows, lens, KeepMask(torch.ones(2, 10, dtype=torch.bool), torch.tensor([5])))
    with pytest.raises(ValueError, match="out holds 3 indices, 5 are visible"):
        visible_kv_indices(r2t, rows, lens, None, out=torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="req_to_token must be a 2-D int32/int64 table"):
        visible_kv_indices(r2t.float(), rows, lens, None)
    with pytest.raises(ValueError, match="extend_lens must be positive"):
        extend_kv_indices(r2t, rows, lens, torch.tensor([0]), None, include_extend=True)
