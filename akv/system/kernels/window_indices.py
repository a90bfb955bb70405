"""Sliding-window index lists (gpt-oss sliding layers) cut from the full visible lists.

Contract (the oracle's): a query at position ``p`` reads the visible keys whose current position is
greater than ``p - window``. :func:`window_kv_indices` keeps, per entry, the listed keys inside the
window of the entry's *first* query. That is exact for a decode entry (one query). For an extend
segment at positions ``p0 .. p0 + m - 1`` the later queries read a suffix of that list, which
SGLang's triton extend kernel selects by list index (``q_id <= kv_id + window - 1``, ``q_id`` counted
from the list's start); :func:`index_window_is_positional` says where that index rule equals the
positional one: the kept prefix keys' positions must run without a gap up to ``p0 - 1``.
"""

from __future__ import annotations

import torch

from akv.system.kernels.kv_indices import KVIndexLists


def _entry_of_each_index(kv_indptr: torch.Tensor, n_indices: int) -> torch.Tensor:
    counts = kv_indptr[1:].long() - kv_indptr[:-1].long()
    entries = torch.arange(counts.shape[0], device=kv_indptr.device)
    owner = torch.repeat_interleave(entries, counts)
    if owner.shape[0] != n_indices:
        raise ValueError(f"kv_indptr ends at {owner.shape[0]}, key_positions has {n_indices} entries")
    return owner


def _checked(kv: KVIndexLists, key_positions: torch.Tensor, query_positions: torch.Tensor, window: int) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be a positive int, got {window!r}")
    n_entries = int(kv.kv_indptr.shape[0]) - 1
    if query_positions.shape != (n_entries,):
        raise ValueError(f"query_positions must have shape ({n_entries},), got {tuple(query_positions.shape)}")
    if key_positions.dim() != 1:
        raise ValueError(f"key_positions must be 1-D, got shape {tuple(key_positions.shape)}")
    return n_entries


def window_kv_indices(
    kv: KVIndexLists, key_positions: torch.Tensor, query_positions: torch.Tensor, window: int
) -> KVIndexLists:
    """Per entry ``i``, the slots of ``kv`` whose ``key_positions`` (aligned with ``kv.kv_indices[:kv_indptr[-1]]``)
    are greater than ``query_positions[i] - window``, in list order."""
    _checked(kv, key_positions, query_positions, window)
    n_listed = int(kv.kv_indptr[-1])
    owner = _entry_of_each_index(kv.kv_indptr, key_positions.shape[0])
    if key_positions.shape[0] != n_listed:
        raise ValueError(f"key_positions has {key_positions.shape[0]} entries, kv lists {n_listed}")
    keep = key_positions.long() > query_positions.long()[owner] - window
    indptr = torch.zeros_like(kv.kv_indptr)
    indptr[1:] = torch.zeros(indptr.shape[0] - 1, dtype=torch.int64, device=keep.device).index_add_(
        0, owner, keep.long()).cumsum(0).to(indptr.dtype)
    return KVIndexLists(kv_indptr=indptr, kv_indices=kv.kv_indices[:n_listed][keep],
                        kv_last_page_len=kv.kv_last_page_len)


def index_window_is_positional(
    window_kv: KVIndexLists, key_positions: torch.Tensor, query_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """Bool per extend entry of a :func:`window_kv_indices` prefix list (``key_positions`` aligned with
    it, ``query_positions`` the segment's first position): True where the in-kernel index window gives
    every query of the segment exactly its positional window, i.e. the kept positions are
    ``p0 - L .. p0 - 1`` for a list of length ``L``."""
    _checked(window_kv, key_positions, query_positions, window)
    owner = _entry_of_each_index(window_kv.kv_indptr, key_positions.shape[0])
    lengths = (window_kv.kv_indptr[1:] - window_kv.kv_indptr[:-1]).long()
    rank = torch.arange(key_positions.shape[0], device=key_positions.device) - window_kv.kv_indptr[:-1].long()[owner]
    expected = query_positions.long()[owner] - lengths[owner] + rank
    wrong = torch.zeros(lengths.shape[0], dtype=torch.int64, device=key_positions.device).index_add_(
        0, owner, (key_positions.long() != expected).long())
    return wrong == 0
