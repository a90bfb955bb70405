"""FlashInfer plans for a batch that holds context requests (the patched ``flashinfer_backend.py``).

At page size 1 FlashInfer's paged KV is SGLang's ``kv_indptr`` / ``kv_indices`` pair, so each entry
gets the visible slots the triton backend reads (:mod:`akv.system.adapter.batch_metadata`):
decode lists every visible column (written into the captured wrapper's own buffers under CUDA
graphs); extend uses paged prefill with one query segment per attention entry (a plain request, or
one segment's part of a context request's round), each over its visible prefix followed by its own
keys, whose causal mask FlashInfer aligns to the end of each list. Sizes come from the host counts, so no plan
reads the device back. Context batches need a single-wrapper FlashInfer backend (no sliding-window
or cross-attention wrappers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from akv.system.adapter.batch_metadata import AkvForward
from akv.system.kernels import VisibleUntil, decode_kv_indices


@dataclass(frozen=True)
class GivenLists:
    """Ready-made decode lists, in the place FlashInfer's decode updater takes them from
    (``spec_info.kv_indptr`` / ``spec_info.kv_indices``)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


def replays_context(backend: Any) -> bool:
    """Whether decode CUDA graphs on this attention backend can replay batches with context
    requests: a single-wrapper FlashInfer backend (whose lists :func:`decode_inputs` fills)."""
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    return isinstance(backend, FlashInferAttnBackend) and backend.num_wrappers == 1


def decode_inputs(backend: Any, forward_batch: Any, wrappers: list[Any], spec_info: Any,
                  seq_lens_cpu: torch.Tensor | None) -> tuple[Any, torch.Tensor | None]:
    """``(spec_info, seq_lens_cpu)`` for the decode updater: unchanged for an all-plain batch; else
    the visible lists and the visible key counts (what FlashInfer's host-side plan reads). Under a
    CUDA graph the batch is padded: padding entries read their one column, as stock SGLang's do."""
    akv: AkvForward | None = getattr(forward_batch, "akv", None)
    if akv is None:
        return spec_info, seq_lens_cpu
    bs = int(forward_batch.batch_size)
    kv_lens = np.ones(bs, dtype=np.int64)
    kv_lens[: akv.visible_prefix.size] = akv.visible_prefix + 1
    wrapper = wrappers[0]
    req_to_token = backend.indices_updater_decode.req_to_token
    if wrapper.is_cuda_graph_enabled:
        out = wrapper._paged_kv_indices_buf
        if int(kv_lens.sum()) > out.shape[0]:
            raise RuntimeError(f"AKV: {int(kv_lens.sum())} visible keys exceed the CUDA-graph index buffer ({out.shape[0]})")
    else:
        out = torch.empty(int(kv_lens.sum()), dtype=torch.int32, device=req_to_token.device)
    lists = decode_kv_indices(req_to_token, forward_batch.req_pool_indices[:bs], forward_batch.seq_lens[:bs],
                              padded_visibility(akv.visibility, bs), out=out, validate=False)
    indptr = backend.kv_indptr[0][: bs + 1]
    indptr.copy_(lists.kv_indptr)
    return GivenLists(indptr, lists.kv_indices), torch.from_numpy(kv_lens)


def plan_extend(backend: Any, forward_batch: Any) -> None:
    """Plan the paged prefill wrapper over each entry's visible prefix and its own keys
    (:class:`akv.system.adapter.batch_metadata.ExtendEntries`)."""
    entries = forward_batch.akv.entries
    updater = backend.indices_updater_prefill
    kv_indptr, kv_indices = entries.kv_lists(updater.req_to_token, include_own=True, dtype=torch.int32)
    last_page_len = torch.ones(entries.rows.size, dtype=torch.int32, device=kv_indices.device)
    backend.prefill_wrappers_paged[0].begin_forward(
        entries.qo_indptr, kv_indptr, kv_indices, last_page_len,
        updater.num_qo_heads, updater.num_kv_heads, updater.head_dim, 1,
        q_data_type=updater.q_data_type, kv_data_type=updater.data_type, custom_mask=None, non_blocking=True,
    )


def padded_visibility(visibility: VisibleUntil, bs: int) -> VisibleUntil:
    """The visibility of a CUDA-graph batch padded to ``bs`` entries: padding entries on row 0 (every
    column visible)."""
    missing = bs - visibility.rows.shape[0]
    if missing == 0:
        return visibility
    pad = torch.zeros(missing, dtype=visibility.rows.dtype, device=visibility.rows.device)
    return VisibleUntil(visible_until=visibility.visible_until, rows=torch.cat([visibility.rows, pad]),
                        query_index=torch.cat([visibility.query_index, pad]))
