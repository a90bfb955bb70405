"""Plain PyTorch reference of ``visible_kv_indices``: one boolean visibility matrix, then a gather."""

from __future__ import annotations

import torch

from akv.system.kernels.kv_indices import HiddenRanges, KeepMask, KVIndexLists, Visibility, VisibleUntil


def visible_columns(kv_lens: torch.Tensor, visibility: Visibility, width: int,
                    forced_from: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[entries, width]``: column ``c`` of entry ``i`` is read (``c < kv_lens[i]`` and visible,
    or ``c >= forced_from[i]``)."""
    device = kv_lens.device
    cols = torch.arange(width, device=device)[None, :]
    n_entries = kv_lens.shape[0]
    if visibility is None:
        visible = torch.ones(n_entries, width, dtype=torch.bool, device=device)
    elif isinstance(visibility, KeepMask):
        visible = visibility.keep[visibility.rows.long(), :width]
    elif isinstance(visibility, VisibleUntil):
        visible = visibility.visible_until[visibility.rows.long(), :width] > visibility.query_index[:, None]
    elif isinstance(visibility, HiddenRanges):
        owner = torch.repeat_interleave(torch.arange(n_entries, device=device), visibility.indptr.diff().long())
        start, end = visibility.bounds[:, :1], visibility.bounds[:, 1:]
        hidden_by_range = (cols >= start) & (cols < end)
        hidden = torch.zeros(n_entries, width, dtype=torch.int32, device=device)
        hidden.index_add_(0, owner, hidden_by_range.int())
        visible = hidden == 0
    else:
        raise TypeError(f"visibility must be KeepMask, VisibleUntil, HiddenRanges or None, got {type(visibility).__name__}")
    if forced_from is not None:
        visible = visible | (cols >= forced_from[:, None])
    return visible & (cols < kv_lens[:, None])


def visible_kv_indices_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    visibility: Visibility,
    *,
    forced_from: torch.Tensor | None = None,
    index_dtype: torch.dtype = torch.int32,
) -> KVIndexLists:
    """Same contract as ``visible_kv_indices`` (exact-size output)."""
    width = req_to_token.shape[1]
    read = visible_columns(kv_lens, visibility, width, forced_from)
    indptr = torch.zeros(kv_lens.shape[0] + 1, dtype=torch.int32, device=req_to_token.device)
    indptr[1:] = read.sum(dim=1).cumsum(0)
    indices = req_to_token[req_pool_indices.long()][read].to(index_dtype)
    ones = torch.ones(kv_lens.shape[0], dtype=torch.int32, device=req_to_token.device)
    return KVIndexLists(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=ones)
