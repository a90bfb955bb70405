"""CSR lists of the KV slots each attention entry may read, built on the device.

An *entry* is one request at decode, or one query segment at extend. Entry ``i`` covers columns
``0 .. kv_lens[i] - 1`` of row ``req_pool_indices[i]`` of SGLang's ``req_to_token`` table; a
visibility description says which of those columns it may read. The output lists the visible
slots in column order: ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``. That is the ``kv_indptr`` /
``kv_indices`` pair of SGLang's triton backend and, with ``kv_last_page_len`` = 1, the paged-KV
description FlashInfer's wrappers take at page size 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from akv.system.kernels.launch_device import check_launchable

_BLOCK = 1024
_MODE_ALL = 0
_MODE_KEEP = 1
_MODE_UNTIL = 2


@dataclass(frozen=True)
class KeepMask:
    """Column ``c`` of entry ``i`` is visible iff ``keep[rows[i], c]`` (bool ``[R, W]``)."""

    keep: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True)
class VisibleUntil:
    """Column ``c`` of entry ``i`` is visible iff ``visible_until[rows[i], c] > query_index[i]``: the
    first query index that no longer sees the token (``ContextProgram.visible_until``), compared
    with the index of the entry's first query."""

    visible_until: torch.Tensor
    rows: torch.Tensor
    query_index: torch.Tensor


@dataclass(frozen=True)
class HiddenRanges:
    """Entry ``i`` hides columns ``[bounds[r, 0], bounds[r, 1])`` for ``indptr[i] <= r < indptr[i + 1]``;
    an entry's ranges are sorted, non-empty and disjoint."""

    indptr: torch.Tensor
    bounds: torch.Tensor


Visibility = KeepMask | VisibleUntil | HiddenRanges | None


@dataclass(frozen=True)
class KVIndexLists:
    """Visible slots per entry in CSR form; ``kv_indices`` may be longer than ``kv_indptr[-1]`` when a
    preallocated buffer was filled."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


@dataclass(frozen=True)
class ExtendKVMetadata:
    """Extend metadata: query segments ``qo_indptr`` and the KV each segment reads."""

    qo_indptr: torch.Tensor
    kv: KVIndexLists


@triton.jit
def _column_visibility(col, in_range, vis_ptr, vis_row_offset, query, forced_from, MODE: tl.constexpr):
    if MODE == 1:
        keep = tl.load(vis_ptr + vis_row_offset + col, mask=in_range, other=0) != 0
    elif MODE == 2:
        keep = tl.load(vis_ptr + vis_row_offset + col, mask=in_range, other=0) > query
    else:
        keep = in_range
    return in_range & (keep | (col >= forced_from))


@triton.jit
def _count_columns_kernel(
    vis_ptr,
    vis_stride,
    vis_rows_ptr,
    query_ptr,
    kv_lens_ptr,
    forced_ptr,
    counts_ptr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    n = tl.load(kv_lens_ptr + entry)
    forced_from = tl.load(forced_ptr + entry)
    vis_row_offset = tl.load(vis_rows_ptr + entry).to(tl.int64) * vis_stride
    query = tl.load(query_ptr + entry)
    total = tl.zeros((), dtype=tl.int32)
    start = n * 0
    while start < n:
        col = start + tl.arange(0, BLOCK)
        visible = _column_visibility(col, col < n, vis_ptr, vis_row_offset, query, forced_from, MODE)
        total += tl.sum(visible.to(tl.int32), axis=0)
        start += BLOCK
    tl.store(counts_ptr + entry, total)


@triton.jit
def _fill_columns_kernel(
    req_to_token_ptr,
    req_to_token_stride,
    req_rows_ptr,
    vis_ptr,
    vis_stride,
    vis_rows_ptr,
    query_ptr,
    kv_lens_ptr,
    forced_ptr,
    indptr_ptr,
    out_ptr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    n = tl.load(kv_lens_ptr + entry)
    forced_from = tl.load(forced_ptr + entry)
    token_row = req_to_token_ptr + tl.load(req_rows_ptr + entry).to(tl.int64) * req_to_token_stride
    vis_row_offset = tl.load(vis_rows_ptr + entry).to(tl.int64) * vis_stride
    query = tl.load(query_ptr + entry)
    out = out_ptr + tl.load(indptr_ptr + entry).to(tl.int64)
    start = n * 0
    while start < n:
        col = start + tl.arange(0, BLOCK)
        visible = _column_visibility(col, col < n, vis_ptr, vis_row_offset, query, forced_from, MODE)
        rank = tl.cumsum(visible.to(tl.int32), axis=0) - 1
        slots = tl.load(token_row + col, mask=visible)
        tl.store(out + rank, slots.to(out_ptr.dtype.element_ty), mask=visible)
        out += tl.sum(visible.to(tl.int32), axis=0)
        start += BLOCK


@triton.jit
def _fill_gaps_kernel(
    req_to_token_ptr,
    req_to_token_stride,
    req_rows_ptr,
    ranges_indptr_ptr,
    bounds_ptr,
    kv_lens_ptr,
    forced_ptr,
    indptr_ptr,
    out_ptr,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    n = tl.load(kv_lens_ptr + entry)
    limit = tl.minimum(tl.load(forced_ptr + entry), n)
    token_row = req_to_token_ptr + tl.load(req_rows_ptr + entry).to(tl.int64) * req_to_token_stride
    out = out_ptr + tl.load(indptr_ptr + entry).to(tl.int64)
    first = tl.load(ranges_indptr_ptr + entry)
    last = tl.load(ranges_indptr_ptr + entry + 1)
    gap_start = tl.zeros((), dtype=tl.int64)
    r = first
    while r <= last:
        is_range = r < last
        hide_start = tl.load(bounds_ptr + 2 * r, mask=is_range, other=0).to(tl.int64)
        hide_end = tl.load(bounds_ptr + 2 * r + 1, mask=is_range, other=0).to(tl.int64)
        hide_start = tl.where(is_range, tl.minimum(hide_start, limit), n)
        hide_end = tl.where(is_range, tl.minimum(hide_end, limit), n)
        start = gap_start
        while start < hide_start:
            col = start + tl.arange(0, BLOCK)
            in_gap = col < hide_start
            slots = tl.load(token_row + col, mask=in_gap)
            tl.store(out + (col - gap_start), slots.to(out_ptr.dtype.element_ty), mask=in_gap)
            start += BLOCK
        out += tl.maximum(hide_start - gap_start, 0)
        gap_start = tl.maximum(gap_start, hide_end)
        r += 1


def _as_entries(tensor: torch.Tensor, name: str, n_entries: int, device: torch.device) -> torch.Tensor:
    if tensor.dim() != 1 or tensor.shape[0] != n_entries:
        raise ValueError(f"{name} must have shape [{n_entries}], got {tuple(tensor.shape)}")
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, req_to_token on {device}")
    return tensor


def _check_ranges(ranges: HiddenRanges, n_entries: int) -> None:
    indptr, bounds = ranges.indptr, ranges.bounds
    if indptr.dim() != 1 or indptr.shape[0] != n_entries + 1:
        raise ValueError(f"HiddenRanges.indptr must have shape [{n_entries + 1}], got {tuple(indptr.shape)}")
    if bounds.dim() != 2 or bounds.shape[1] != 2:
        raise ValueError(f"HiddenRanges.bounds must have shape [n, 2], got {tuple(bounds.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != bounds.shape[0] or bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"HiddenRanges.indptr must rise from 0 to {bounds.shape[0]}, got {indptr.tolist()}")
    start, end = bounds[:, 0], bounds[:, 1]
    bad = ((start < 0) | (end <= start)).nonzero()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"HiddenRanges.bounds[{r}] = {bounds[r].tolist()} is not a non-empty range of columns")
    entry_start = torch.zeros(bounds.shape[0], dtype=torch.bool, device=bounds.device)
    entry_start[indptr[:-1][indptr[:-1] < indptr[1:]].long()] = True
    overlap = ((start[1:] < end[:-1]) & ~entry_start[1:]).nonzero()
    if overlap.numel():
        r = int(overlap[0]) + 1
        raise ValueError(
            f"HiddenRanges.bounds[{r}] = {bounds[r].tolist()} is not after bounds[{r - 1}] = {bounds[r - 1].tolist()}"
        )


def _range_counts(ranges: HiddenRanges, kv_lens: torch.Tensor, forced_from: torch.Tensor) -> torch.Tensor:
    limit = torch.minimum(forced_from, kv_lens).to(torch.int64)
    n_ranges = ranges.bounds.shape[0]
    owner = torch.searchsorted(
        ranges.indptr[1:].to(torch.int64), torch.arange(n_ranges, device=kv_lens.device), right=True
    )
    cap = limit[owner]
    hidden = (torch.minimum(ranges.bounds[:, 1].to(torch.int64), cap)
              - torch.minimum(ranges.bounds[:, 0].to(torch.int64), cap)).clamp(min=0)
    per_entry = torch.zeros_like(limit).scatter_add_(0, owner, hidden)
    return kv_lens.to(torch.int64) - per_entry


def visible_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    visibility: Visibility,
    *,
    forced_from: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    index_dtype: torch.dtype = torch.int32,
    validate: bool = True,
) -> KVIndexLists:
    """Visible slots of ``req_to_token[req_pool_indices[i], :kv_lens[i]]`` for every entry ``i``.

    Columns ``>= forced_from[i]`` are visible whatever ``visibility`` says (an extend segment's own
    tokens). ``out``: a preallocated 1-D buffer to fill (no host synchronisation, CUDA-graph
    friendly); without it the exact size is read back once. ``validate=False`` skips the checks
    that read tensors back to the host."""
    device = req_to_token.device
    check_launchable(req_to_token, "req_to_token")
    if req_to_token.dim() != 2 or req_to_token.dtype not in (torch.int32, torch.int64) or req_to_token.stride(1) != 1:
        raise ValueError(
            f"req_to_token must be a 2-D int32/int64 table with contiguous rows, got {req_to_token.dtype} "
            f"{tuple(req_to_token.shape)} strides {req_to_token.stride()}"
        )
    n_entries = int(req_pool_indices.shape[0]) if req_pool_indices.dim() == 1 else -1
    _as_entries(req_pool_indices, "req_pool_indices", n_entries, device)
    _as_entries(kv_lens, "kv_lens", n_entries, device)
    forced_from = kv_lens if forced_from is None else _as_entries(forced_from, "forced_from", n_entries, device)
    if validate and n_entries and int(kv_lens.max()) > req_to_token.shape[1]:
        raise ValueError(f"kv_lens max {int(kv_lens.max())} exceeds req_to_token width {req_to_token.shape[1]}")

    indptr = torch.zeros(n_entries + 1, dtype=torch.int32, device=device)
    if isinstance(visibility, HiddenRanges):
        if validate:
            _check_ranges(visibility, n_entries)
        counts = _range_counts(visibility, kv_lens, forced_from)
    else:
        mode, vis, vis_rows, query = _column_arguments(visibility, req_pool_indices, n_entries, device, validate)
        counts = torch.empty(n_entries, dtype=torch.int32, device=device)
        if n_entries:
            _count_columns_kernel[(n_entries,)](
                vis, vis.stride(0), vis_rows, query, kv_lens, forced_from, counts, MODE=mode, BLOCK=_BLOCK
            )
    indptr[1:] = torch.cumsum(counts, 0)
    if out is None:
        out = torch.empty(int(indptr[-1]), dtype=index_dtype, device=device)
    elif out.dim() != 1 or out.device != device or out.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out must be a 1-D int32/int64 tensor on {device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    elif validate and int(indptr[-1]) > out.shape[0]:
        raise ValueError(f"out holds {out.shape[0]} indices, {int(indptr[-1])} are visible")

    if n_entries and isinstance(visibility, HiddenRanges):
        _fill_gaps_kernel[(n_entries,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, visibility.indptr, visibility.bounds,
            kv_lens, forced_from, indptr, out, BLOCK=_BLOCK,
        )
    elif n_entries:
        _fill_columns_kernel[(n_entries,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, vis, vis.stride(0), vis_rows, query,
            kv_lens, forced_from, indptr, out, MODE=mode, BLOCK=_BLOCK,
        )
    last_page_len = torch.ones(n_entries, dtype=torch.int32, device=device)
    return KVIndexLists(kv_indptr=indptr, kv_indices=out, kv_last_page_len=last_page_len)


def _column_arguments(
    visibility: KeepMask | VisibleUntil | None,
    req_pool_indices: torch.Tensor,
    n_entries: int,
    device: torch.device,
    validate: bool,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    if visibility is None:
        return _MODE_ALL, req_pool_indices[:, None], req_pool_indices, req_pool_indices
    if isinstance(visibility, KeepMask):
        mode, table, name = _MODE_KEEP, visibility.keep, "KeepMask.keep"
        if table.dtype != torch.bool:
            raise ValueError(f"{name} must be bool, got {table.dtype}")
        query = visibility.rows
        table = table.view(torch.uint8)
    elif isinstance(visibility, VisibleUntil):
        mode, table, name = _MODE_UNTIL, visibility.visible_until, "VisibleUntil.visible_until"
        if table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {table.dtype}")
        query = _as_entries(visibility.query_index, "VisibleUntil.query_index", n_entries, device)
    else:
        raise TypeError(f"visibility must be KeepMask, VisibleUntil, HiddenRanges or None, got {type(visibility).__name__}")
    if table.dim() != 2 or table.stride(1) != 1 or table.device != device:
        raise ValueError(f"{name} must be a 2-D table with contiguous rows on {device}, got {tuple(table.shape)} on {table.device}")
    rows = _as_entries(visibility.rows, f"{type(visibility).__name__}.rows", n_entries, device)
    if validate and n_entries and (int(rows.min()) < 0 or int(rows.max()) >= table.shape[0]):
        raise ValueError(f"{type(visibility).__name__}.rows {rows.tolist()} index outside [0, {table.shape[0]})")
    return mode, table, rows, query


def decode_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    visibility: Visibility,
    *,
    out: torch.Tensor | None = None,
    index_dtype: torch.dtype = torch.int32,
    validate: bool = True,
) -> KVIndexLists:
    """Decode: one query per request, reading the visible columns of ``[0, seq_lens[i])``; the last
    column (the token being decoded, already written) is always visible."""
    return visible_kv_indices(
        req_to_token, req_pool_indices, seq_lens, visibility,
        forced_from=seq_lens - 1, out=out, index_dtype=index_dtype, validate=validate,
    )


def extend_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    visibility: Visibility,
    *,
    include_extend: bool,
    out: torch.Tensor | None = None,
    index_dtype: torch.dtype = torch.int32,
    validate: bool = True,
) -> ExtendKVMetadata:
    """Extend / segmented prefill: entry ``i`` is a query segment of ``extend_lens[i]`` tokens at
    columns ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])`` of its row, all sharing one
    visibility. ``include_extend=False`` lists the visible prefix only (SGLang's triton extend
    kernel attends to the segment's own tokens separately, causally); ``True`` appends the segment's
    own slots (FlashInfer paged prefill, causal mask aligned to the end of each list)."""
    device = req_to_token.device
    n_entries = int(req_pool_indices.shape[0])
    _as_entries(prefix_lens, "prefix_lens", n_entries, device)
    _as_entries(extend_lens, "extend_lens", n_entries, device)
    if validate and n_entries and int(extend_lens.min()) <= 0:
        raise ValueError(f"extend_lens must be positive, got {extend_lens.tolist()}")
    qo_indptr = torch.zeros(n_entries + 1, dtype=torch.int32, device=device)
    qo_indptr[1:] = torch.cumsum(extend_lens, 0)
    kv_lens = prefix_lens + extend_lens if include_extend else prefix_lens
    kv = visible_kv_indices(
        req_to_token, req_pool_indices, kv_lens, visibility,
        forced_from=prefix_lens, out=out, index_dtype=index_dtype, validate=validate,
    )
    return ExtendKVMetadata(qo_indptr=qo_indptr, kv=kv)
