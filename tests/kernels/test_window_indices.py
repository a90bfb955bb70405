"""Sliding-window index lists: the positional window against a brute force and against the oracle's
layout, and when SGLang's in-kernel index window is the positional one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.kernels.kv_indices import KVIndexLists
from akv.system.kernels.window_indices import index_window_is_positional, window_kv_indices
from akv.system.reference.oracle import Drop, Repos, simulate_layout


def _lists(entries: list[list[tuple[int, int]]]) -> tuple[KVIndexLists, torch.Tensor]:
    """CSR lists of (slot, position) pairs, one list per entry."""
    indptr = torch.tensor([0] + [len(e) for e in entries]).cumsum(0).to(torch.int32)
    slots = torch.tensor([s for e in entries for s, _ in e], dtype=torch.int32)
    positions = torch.tensor([p for e in entries for _, p in e], dtype=torch.int64)
    ones = torch.ones(len(entries), dtype=torch.int32)
    return KVIndexLists(kv_indptr=indptr, kv_indices=slots, kv_last_page_len=ones), positions


def _per_entry(kv: KVIndexLists) -> list[list[int]]:
    ptr = kv.kv_indptr.tolist()
    return [kv.kv_indices[ptr[i]:ptr[i + 1]].tolist() for i in range(len(ptr) - 1)]


@st.composite
def entries(draw: st.DrawFn) -> tuple[list[list[tuple[int, int]]], list[int], int]:
    window = draw(st.integers(1, 12))
    lists, queries = [], []
    for _ in range(draw(st.integers(1, 5))):
        query = draw(st.integers(0, 40))
        positions = sorted(draw(st.sets(st.integers(0, query), max_size=query + 1)))
        lists.append([(1000 + 50 * len(lists) + p, p) for p in positions])
        queries.append(query)
    return lists, queries, window


@settings(max_examples=200, deadline=None)
@given(case=entries())
def test_window_lists_equal_a_brute_force(case: tuple[list[list[tuple[int, int]]], list[int], int]) -> None:
    lists, queries, window = case
    kv, positions = _lists(lists)
    got = window_kv_indices(kv, positions, torch.tensor(queries), window)
    assert _per_entry(got) == [[s for s, p in e if p > q - window] for e, q in zip(lists, queries)]
    assert got.kv_indices.dtype == kv.kv_indices.dtype


def test_decode_lists_are_the_keys_the_oracle_reads_on_a_sliding_layer() -> None:
    """Query t reads the visible tokens at positions > p(t) - W at its stage (oracle layout), here for
    every token of a history with a drop, a reposition after a drop, and a second drop."""
    window, n = 6, 40
    layout = simulate_layout(n, [Drop(10, tuple(range(3, 9))), Repos(18), Drop(25, (18, 19, 20)), Repos(33)])
    for t in range(n):
        stage = int(layout.birth_stage[t])
        p = int(layout.birth_position[t])
        earlier = [s for s in range(t) if int(layout.stage_positions[stage, s]) >= 0]
        listed = [(s, int(layout.stage_positions[stage, s])) for s in earlier] + [(t, p)]
        kv, positions = _lists([listed])
        got = _per_entry(window_kv_indices(kv, positions, torch.tensor([p]), window))[0]
        assert got == [s for s, pos in listed if pos > p - window], t
        if t >= 33:
            assert got == [s for s, _ in listed][-window:], t


def _index_rule_reads(length: int, j: int, window: int) -> list[int]:
    """SGLang's triton extend prefix mask for query j of a segment: q_id = length + j <= kv_id + window - 1."""
    return [k for k in range(length) if length + j <= k + window - 1]


@settings(max_examples=300, deadline=None)
@given(window=st.integers(1, 10), start=st.integers(0, 30), data=st.data())
def test_the_index_window_is_positional_exactly_when_the_kept_prefix_has_no_gap(
    window: int, start: int, data: st.DataObject
) -> None:
    prefix = sorted(data.draw(st.sets(st.integers(0, max(start - 1, 0)), max_size=start)) if start else [])
    kv, positions = _lists([[(100 + p, p) for p in prefix]])
    cut = window_kv_indices(kv, positions, torch.tensor([start]), window)
    kept = [p for p in prefix if p > start - window]
    kept_positions = torch.tensor(kept, dtype=torch.int64)
    agrees = all(
        [kept[k] for k in _index_rule_reads(len(kept), j, window)] == [p for p in kept if p > start + j - window]
        for j in range(window)
    )
    assert bool(index_window_is_positional(cut, kept_positions, torch.tensor([start]), window)[0]) == agrees
    assert agrees == (kept == list(range(start - len(kept), start)))
