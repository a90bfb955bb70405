"""Test-side probe: FlashInfer's plans and FA3's metadata for every context forward the CPU
scheduler runs.

FlashInfer and FA3 are CUDA-only, so :mod:`akv.system.adapter.flashinfer_lists` runs here against
stand-in wrappers that record what they are planned with, and :mod:`akv.system.adapter.fa3_lists`
against a stand-in backend, for the very forward batches the triton backend serves (whose lists the
oracle checks end to end). For each batch the FlashInfer lists and FA3's page-table rows must equal
the triton backend's: decode the same visible columns, eagerly and into padded CUDA-graph buffers;
extend each entry's visible prefix followed by its own slots (the forward's new slots, in query
order), with query segments that cut every request's queries.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from akv.system.adapter import batch_metadata, fa3_lists, flashinfer_lists

STATS: dict[str, Any] = {"decode": 0, "extend": 0, "fa3_decode": 0, "fa3_extend": 0, "mismatches": []}
_PAD = 2


class RecordingWrapper:
    """Stands in for a FlashInfer wrapper: keeps the arguments of its last plan."""

    def __init__(self, graph_buffer: torch.Tensor | None = None) -> None:
        self.is_cuda_graph_enabled = graph_buffer is not None
        self._paged_kv_indices_buf = graph_buffer
        self.planned: tuple | None = None

    def begin_forward(self, *args: Any, **kwargs: Any) -> None:
        self.planned = args


def install() -> None:
    served = batch_metadata.triton_kv_lists

    def probing(forward_batch: Any, req_to_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indptr, indices = served(forward_batch, req_to_token)
        lists = _split(indptr, indices)
        if forward_batch.forward_mode.is_decode_or_idle():
            _check_decode(forward_batch, req_to_token, lists)
            _check_fa3_decode(forward_batch, req_to_token, lists)
        else:
            _check_extend(forward_batch, req_to_token, lists)
            _check_fa3_extend(forward_batch, req_to_token, lists)
        return indptr, indices

    batch_metadata.triton_kv_lists = probing


def report() -> dict[str, Any]:
    return {**STATS, "mismatches": STATS["mismatches"][:5], "n_mismatches": len(STATS["mismatches"])}


def reset() -> None:
    """Counts start from zero again (the driver's next part)."""
    STATS.update(decode=0, extend=0, fa3_decode=0, fa3_extend=0, mismatches=[])


def _mismatch(kind: str, what: str, got: Any, expected: Any) -> None:
    STATS["mismatches"].append({"kind": kind, "what": what, "got": str(got)[:300], "expected": str(expected)[:300]})


def _backend(req_to_token: torch.Tensor, bs: int) -> SimpleNamespace:
    updater = SimpleNamespace(req_to_token=req_to_token, kv_last_page_len=torch.ones(bs, dtype=torch.int32),
                              num_qo_heads=4, num_kv_heads=2, head_dim=16, q_data_type=torch.float32,
                              data_type=torch.float32)
    return SimpleNamespace(indices_updater_decode=updater, indices_updater_prefill=updater,
                           kv_indptr=[torch.zeros(bs + 1, dtype=torch.int32)],
                           prefill_wrappers_paged=[RecordingWrapper()])


def _split(indptr: torch.Tensor, indices: torch.Tensor) -> list[list[int]]:
    return [indices[int(indptr[i]):int(indptr[i + 1])].tolist() for i in range(indptr.numel() - 1)]


def _check_decode(fb: Any, req_to_token: torch.Tensor, expected: list[list[int]]) -> None:
    STATS["decode"] += 1
    bs = len(expected)
    eager = SimpleNamespace(batch_size=bs, req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens, akv=fb.akv)
    given, kv_lens = flashinfer_lists.decode_inputs(_backend(req_to_token, bs), eager, [RecordingWrapper()], None, None)
    if _split(given.kv_indptr, given.kv_indices) != expected:
        _mismatch("decode", "eager lists", _split(given.kv_indptr, given.kv_indices), expected)
    if kv_lens.tolist() != [len(x) for x in expected]:
        _mismatch("decode", "host counts", kv_lens.tolist(), [len(x) for x in expected])

    padded_bs = bs + _PAD
    pad = torch.zeros(_PAD, dtype=fb.req_pool_indices.dtype)
    graph = SimpleNamespace(
        batch_size=padded_bs, akv=fb.akv,
        req_pool_indices=torch.cat([fb.req_pool_indices, pad]),
        seq_lens=torch.cat([fb.seq_lens, torch.ones(_PAD, dtype=fb.seq_lens.dtype)]),
    )
    buffer = torch.full((sum(map(len, expected)) + _PAD + 64,), -1, dtype=torch.int32)
    backend = _backend(req_to_token, padded_bs)
    given, kv_lens = flashinfer_lists.decode_inputs(backend, graph, [RecordingWrapper(buffer)], None, None)
    padding = [[int(req_to_token[0, 0])]] * _PAD
    if given.kv_indices.data_ptr() != buffer.data_ptr() or given.kv_indptr.data_ptr() != backend.kv_indptr[0].data_ptr():
        _mismatch("decode", "graph lists not in the captured buffers", None, None)
    if _split(given.kv_indptr, buffer) != expected + padding:
        _mismatch("decode", "graph lists", _split(given.kv_indptr, buffer), expected + padding)
    if kv_lens.tolist() != [len(x) for x in expected] + [1] * _PAD:
        _mismatch("decode", "graph host counts", kv_lens.tolist(), [len(x) for x in expected])


def _check_extend(fb: Any, req_to_token: torch.Tensor, prefixes: list[list[int]]) -> None:
    STATS["extend"] += 1
    n = len(prefixes)
    backend = _backend(req_to_token, n)
    flashinfer_lists.plan_extend(backend, fb)
    qo_indptr, kv_indptr, kv_indices, last_page_len, *_ = backend.prefill_wrappers_paged[0].planned
    bounds = qo_indptr.tolist()
    request_bounds = [0]
    for m in fb.extend_seq_lens_cpu:
        request_bounds.append(request_bounds[-1] + int(m))
    if len(bounds) != n + 1 or not set(request_bounds) <= set(bounds) or bounds != sorted(set(bounds)):
        _mismatch("extend", "qo_indptr (entries must cut the requests' queries)", bounds, request_bounds)
        return
    own = [fb.out_cache_loc[bounds[i] : bounds[i + 1]].tolist() for i in range(n)]
    expected = [p + o for p, o in zip(prefixes, own)]
    if _split(kv_indptr, kv_indices) != expected:
        _mismatch("extend", "paged lists", _split(kv_indptr, kv_indices), expected)
    if int(kv_indices.numel()) != sum(map(len, expected)) or last_page_len.tolist() != [1] * n:
        _mismatch("extend", "sizes", (kv_indices.numel(), last_page_len.tolist()), sum(map(len, expected)))


def _fa3_rows(metadata: Any, n: int) -> list[list[int]]:
    return [metadata.page_table[i, : int(metadata.cache_seqlens_int32[i])].tolist() for i in range(n)]


def _fa3_backend(req_to_token: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(req_to_token=req_to_token, _sched_meta_buf=None, _compute_scheduler_metadata=lambda *_: None)


def _check_fa3_decode(fb: Any, req_to_token: torch.Tensor, expected: list[list[int]]) -> None:
    STATS["fa3_decode"] += 1
    bs = len(expected)
    eager = SimpleNamespace(forward_mode=fb.forward_mode, batch_size=bs, req_pool_indices=fb.req_pool_indices,
                            seq_lens=fb.seq_lens, akv=fb.akv)
    metadata = fa3_lists.eager_metadata(_fa3_backend(req_to_token), eager, SimpleNamespace())
    if _fa3_rows(metadata, bs) != expected or metadata.cu_seqlens_q.tolist() != list(range(bs + 1)):
        _mismatch("fa3 decode", "eager rows", _fa3_rows(metadata, bs), expected)

    padded_bs = bs + _PAD
    graph = SimpleNamespace(
        batch_size=padded_bs, akv=fb.akv,
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(_PAD, dtype=fb.req_pool_indices.dtype)]),
        seq_lens=torch.cat([fb.seq_lens, torch.ones(_PAD, dtype=fb.seq_lens.dtype)]),
    )
    captured = SimpleNamespace(page_table=torch.full((padded_bs, req_to_token.shape[1]), -1, dtype=torch.int32),
                               cache_seqlens_int32=torch.zeros(padded_bs, dtype=torch.int32),
                               cu_seqlens_q=torch.arange(padded_bs + 1, dtype=torch.int32),
                               cu_seqlens_k=torch.zeros(padded_bs + 1, dtype=torch.int32), scheduler_metadata=None)
    backend = _fa3_backend(req_to_token)
    backend.decode_cuda_graph_metadata = {padded_bs: captured}
    fa3_lists.fill_decode_graph(backend, graph)
    padding = [[int(req_to_token[0, 0])]] * _PAD
    if _fa3_rows(captured, padded_bs) != expected + padding or backend.forward_metadata is not captured:
        _mismatch("fa3 decode", "graph rows", _fa3_rows(captured, padded_bs), expected + padding)


def _check_fa3_extend(fb: Any, req_to_token: torch.Tensor, prefixes: list[list[int]]) -> None:
    STATS["fa3_extend"] += 1
    metadata = fa3_lists.eager_metadata(_fa3_backend(req_to_token), fb, SimpleNamespace())
    bounds = metadata.cu_seqlens_q.tolist()
    own = [fb.out_cache_loc[bounds[i] : bounds[i + 1]].tolist() for i in range(len(prefixes))]
    expected = [p + o for p, o in zip(prefixes, own)]
    if len(bounds) != len(prefixes) + 1 or _fa3_rows(metadata, len(prefixes)) != expected:
        _mismatch("fa3 extend", "rows", _fa3_rows(metadata, len(prefixes)), expected)
    if metadata.max_seq_len_q != max(b - a for a, b in zip(bounds, bounds[1:])):
        _mismatch("fa3 extend", "max_seq_len_q", metadata.max_seq_len_q, bounds)
