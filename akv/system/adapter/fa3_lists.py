"""FlashAttention-3 metadata for a batch that holds context requests (the patched
``flashattention_backend.py``).

FA3 reads paged KV through a page table; at page size 1, row ``i`` of ``page_table`` lists the
slots attention entry ``i`` reads and ``cache_seqlens[i]`` how many. Each row is the visible list
the triton and FlashInfer backends read (:mod:`akv.system.adapter.batch_metadata`): at decode every
visible column of the request (the decoded token last); at extend one query segment per attention
entry (a plain request, or one segment's part of a context request's round: ``cu_seqlens_q``) over
its visible prefix followed by its own keys, whose causal mask FA3 aligns to the end of each row.
Eager forwards get tensors of their own; a decode CUDA-graph replay writes the rows, lengths and
FA3's scheduler metadata into the buffers the graph captured. Sizes come from the host counts, so
nothing is read back from the device.

What FA3 cannot serve this way is refused when the server starts (:func:`check_model`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from akv.system.adapter.batch_metadata import AkvForward
from akv.system.adapter.device import to_device
from akv.system.adapter.flashinfer_lists import padded_visibility
from akv.system.kernels import decode_kv_indices

BACKEND = "fa3"


@dataclass(frozen=True)
class Rows:
    """The slots each attention entry reads: entry ``i`` reads ``indices[indptr[i]:indptr[i + 1]]``
    (int32 on the device, ``indptr`` FA3's ``cu_seqlens_k``), ``lens[i]`` of them (on the host)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    lens: np.ndarray

    @property
    def width(self) -> int:
        """The longest row (0 for none)."""
        return int(self.lens.max()) if self.lens.size else 0

    def into(self, page_table: torch.Tensor) -> None:
        """Write row ``i`` into ``page_table[i, :lens[i]]`` (columns after it keep what they held:
        FA3 reads no further than ``cache_seqlens``)."""
        if self.width > page_table.shape[1]:
            raise RuntimeError(f"AKV: a row of {self.width} keys exceeds FA3's page table ({page_table.shape[1]} columns)")
        total = int(self.lens.sum())
        if total == 0:
            return
        device = page_table.device
        entry = torch.repeat_interleave(torch.arange(self.lens.size, device=device),
                                        (self.indptr[1:] - self.indptr[:-1]).long(), output_size=total)
        column = torch.arange(total, device=device) - self.indptr[entry].long()
        page_table[entry, column] = self.indices[:total].to(page_table.dtype)

    def table(self) -> torch.Tensor:
        """A page table of its own, ``[entries, width]`` int32."""
        page_table = torch.zeros((self.lens.size, self.width), dtype=torch.int32, device=self.indices.device)
        self.into(page_table)
        return page_table


def replays_context(backend: Any) -> bool:
    """Whether decode CUDA graphs on this attention backend replay batches with context requests:
    SGLang's FA3 backend (whose captured buffers :func:`fill_decode_graph` fills). Imports nothing:
    a backend of that class has loaded its module (which needs ``sgl_kernel``)."""
    module = sys.modules.get("sglang.srt.layers.attention.flashattention_backend")
    return module is not None and isinstance(backend, module.FlashAttentionBackend) and backend.fa_impl_ver == 3


def decode_rows(req_to_token: torch.Tensor, forward_batch: Any, bs: int) -> Rows:
    """Every visible column of each decoding request (the decoded token last); entries past the
    batch's requests (CUDA-graph padding) read their one column, as stock SGLang's do."""
    akv: AkvForward = forward_batch.akv
    lens = np.ones(bs, dtype=np.int64)
    lens[: akv.visible_prefix.size] = akv.visible_prefix + 1
    out = torch.empty(int(lens.sum()), dtype=torch.int32, device=req_to_token.device)
    lists = decode_kv_indices(req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                              padded_visibility(akv.visibility, bs), out=out, validate=False)
    return Rows(indptr=lists.kv_indptr, indices=lists.kv_indices, lens=lens)


def extend_rows(req_to_token: torch.Tensor, forward_batch: Any) -> Rows:
    """Each attention entry's visible prefix followed by its own slots
    (:class:`akv.system.adapter.extend_entries.ExtendEntries`)."""
    entries = forward_batch.akv.entries
    indptr, indices = entries.kv_lists(req_to_token, include_own=True, dtype=torch.int32)
    return Rows(indptr=indptr, indices=indices, lens=entries.n_prefix + entries.n_own)


def eager_metadata(backend: Any, forward_batch: Any, metadata: Any) -> Any:
    """``metadata`` (a fresh ``FlashAttentionMetadata``) filled for a forward that holds context
    requests: the visible rows and their lengths; at decode one query per request and FA3's
    scheduler metadata for those lengths, at extend the entries' query segments."""
    device = backend.req_to_token.device
    if forward_batch.forward_mode.is_decode_or_idle():
        bs = int(forward_batch.batch_size)
        rows = decode_rows(backend.req_to_token, forward_batch, bs)
        metadata.cu_seqlens_q = torch.arange(0, bs + 1, dtype=torch.int32, device=device)
        metadata.max_seq_len_q = 1
    else:
        entries = forward_batch.akv.entries
        rows = extend_rows(backend.req_to_token, forward_batch)
        metadata.cu_seqlens_q = entries.qo_indptr
        metadata.max_seq_len_q = int(entries.n_own.max())
    metadata.page_table = rows.table()
    metadata.cache_seqlens_int32 = to_device(rows.lens, device, torch.int32)
    metadata.cu_seqlens_k = rows.indptr
    metadata.max_seq_len_k = rows.width
    if forward_batch.forward_mode.is_decode_or_idle():
        metadata.scheduler_metadata = backend._compute_scheduler_metadata(
            rows.lens.size, rows.width, metadata.cache_seqlens_int32, metadata.cu_seqlens_q)
    return metadata


def fill_decode_graph(backend: Any, forward_batch: Any) -> None:
    """Before a decode CUDA-graph replay: the visible rows, their lengths and running sums written
    into the metadata buffers captured for the padded batch size, FA3's scheduler metadata
    recomputed for those lengths into its captured buffer, as stock SGLang's replay does for
    ``seq_lens``."""
    bs = int(forward_batch.batch_size)
    metadata = backend.decode_cuda_graph_metadata[bs]
    rows = decode_rows(backend.req_to_token, forward_batch, bs)
    rows.into(metadata.page_table)
    metadata.cache_seqlens_int32.copy_(to_device(rows.lens, metadata.cache_seqlens_int32.device, torch.int32))
    metadata.cu_seqlens_k.copy_(rows.indptr)
    metadata.max_seq_len_k = rows.width
    if backend._sched_meta_buf is not None and metadata.scheduler_metadata is not None:
        sched = backend._compute_scheduler_metadata(bs, rows.width, metadata.cache_seqlens_int32, metadata.cu_seqlens_q)
        if sched is not None:
            backend._sched_meta_buf[: sched.shape[0]] = sched
            backend._sched_meta_buf[sched.shape[0]:] = 0
    backend.forward_metadata = metadata
    backend.forward_metadata_spec_decode_expand = None


def check_model(model_config: Any, window: int | None, kv_cache_dtype: str) -> None:
    """ValueError naming the backends to use instead when FA3 cannot serve context requests on this
    model exactly: sliding-window layers (FA3 counts its window in listed keys, not positions, so
    after a Drop it would reach past the window), an FP8 KV cache (FA3 takes its scales per request,
    and a round has one entry per segment), and layers FA3 serves from tables of their own (MLA,
    cross-attention, chunked local attention)."""
    reasons = [
        (window is not None, "sliding-window layers (FA3's window counts listed keys, not positions)"),
        (kv_cache_dtype != "auto", f"kv_cache_dtype {kv_cache_dtype!r} (FA3 scales KV per request, not per entry)"),
        (getattr(getattr(model_config, "attention_arch", None), "name", "") == "MLA", "MLA attention"),
        (bool(getattr(model_config, "is_encoder_decoder", False)), "cross-attention layers"),
        (bool(getattr(model_config, "is_local_attention_model", False)), "chunked local attention"),
    ]
    others = "triton" if window is not None else "triton or flashinfer"
    for refused, what in reasons:
        if refused:
            raise ValueError(f"attention_backend {BACKEND!r} cannot serve context requests with {what}; serve "
                             f"this model with --attention-backend {others}")
