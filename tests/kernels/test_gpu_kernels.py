"""The kernels at real sizes on the H200: Qwen3-8B-shaped caches (36 layers, 8 KV heads, head_dim 128,
bf16), and FlashInfer's paged wrappers reading the visible index lists.

bf16 round-off: the kernel may fuse multiply-adds that the PyTorch reference rounds separately, so
bf16 keys are compared within one bf16 ulp of the reference plus 1e-5: both sides compute in FP32 from
the same inputs (absolute error ~1e-6 for unit-scale keys), and for results near zero that error is
larger than their own bf16 ulp."""

from __future__ import annotations

import math

import pytest
import torch

from akv.system.kernels.kv_indices import KeepMask, decode_kv_indices, extend_kv_indices, visible_kv_indices
from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import rerotate_kv
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from akv.system.reference.rope import rerotate, rotate

pytestmark = pytest.mark.gpu

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 36, 8, 32, 128
QWEN3 = RopeSpec(theta=1_000_000.0, head_dim=HEAD_DIM, rotary_dim=HEAD_DIM)


def within_bf16_ulp(actual: torch.Tensor, expected: torch.Tensor, fp32_slack: float = 1e-5) -> bool:
    exp = expected.float()
    ulp = torch.ldexp(torch.ones_like(exp), torch.frexp(exp).exponent - 8)
    return bool(((actual.float() - exp).abs() <= ulp + fp32_slack).all())


@pytest.mark.parametrize("n_copies", [1024, 32768])
@pytest.mark.parametrize("moved", [True, False])
def test_rerotation_matches_reference_on_a_qwen3_8b_cache(n_copies, moved):
    gen = torch.Generator(device="cuda").manual_seed(n_copies)
    slots = 3 * n_copies + 1
    k = [torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
    v = [torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
    src = torch.randperm(2 * n_copies, device="cuda", generator=gen)[:n_copies].sort().values + 1
    dst = torch.arange(2 * n_copies + 1, slots, device="cuda") if moved else src
    old = src + 100
    new = torch.arange(n_copies, device="cuda")
    new[::7] = old[::7]
    k_ref, v_ref = [t.clone() for t in k], [t.clone() for t in v]
    rerotate_kv(LayerBuffers.of(k), LayerBuffers.of(v), src, dst, old, new, RopeTable.build(QWEN3, 262144, "cuda"))
    rerotate_kv_reference(LayerBuffers.of(k_ref), LayerBuffers.of(v_ref), src, dst, old, new, QWEN3)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert within_bf16_ulp(k[layer], k_ref[layer]), f"layer {layer}"
        assert torch.equal(k[layer][dst[::7]], k_ref[layer][dst[::7]])
        assert torch.equal(v[layer], v_ref[layer])


def test_rerotation_of_256k_tokens_spot_checked_on_three_layers():
    """262144 survivors of 524288 slots move into the dropped half (77 GB of K and V); layers 0, 17
    and 35 are checked against the reference applied to their saved source rows."""
    n, checked = 262144, (0, 17, 35)
    gen = torch.Generator(device="cuda").manual_seed(5)
    slots = 2 * n + 1
    k = [torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
    v = [torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
    order = torch.randperm(2 * n, device="cuda", generator=gen) + 1
    src, dst = order[:n].sort().values, order[n:].sort().values
    old, new = src.clone(), torch.arange(n, device="cuda")
    saved = {layer: (k[layer][src].clone(), v[layer][src].clone()) for layer in checked}
    rerotate_kv(LayerBuffers.of(k), LayerBuffers.of(v), src, dst, old, new, RopeTable.build(QWEN3, slots, "cuda"))
    for layer, (k_src, v_src) in saved.items():
        expected = rerotate(k_src, old, new, theta=QWEN3.theta).bfloat16()
        assert within_bf16_ulp(k[layer][dst], expected), f"layer {layer}"
        assert torch.equal(v[layer][dst], v_src)


def test_fp32_rerotation_equals_direct_rotation_at_large_positions():
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 65536
    raw = torch.randn(n, KV_HEADS, HEAD_DIM, device="cuda", generator=gen)
    old = torch.randint(0, 262144, (n,), device="cuda", generator=gen)
    new = torch.randint(0, 262144, (n,), device="cuda", generator=gen)
    k = torch.zeros(2 * n, KV_HEADS, HEAD_DIM, device="cuda")
    k[:n] = rotate(raw, old, theta=QWEN3.theta)
    v = torch.zeros_like(k)
    rerotate_kv(LayerBuffers.of([k]), LayerBuffers.of([v]), torch.arange(n, device="cuda"),
                torch.arange(n, 2 * n, device="cuda"), old, new, RopeTable.build(QWEN3, 262144, "cuda"))
    torch.testing.assert_close(k[n:], rotate(raw, new, theta=QWEN3.theta), atol=1e-5, rtol=0)


def test_visible_lists_for_a_large_decode_batch():
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows, width = 32, 131072
    req_to_token = torch.randint(1, 2**30, (rows + 1, width), device="cuda", dtype=torch.int32, generator=gen)
    keep = torch.rand(rows + 1, width, device="cuda", generator=gen) < 0.5
    pool_rows = torch.randperm(rows, device="cuda", generator=gen) + 1
    seq_lens = torch.randint(1, width + 1, (rows,), device="cuda", generator=gen)
    lists = decode_kv_indices(req_to_token, pool_rows, seq_lens, KeepMask(keep, pool_rows))
    for i in range(rows):
        row, n = int(pool_rows[i]), int(seq_lens[i])
        visible = keep[row, :n].clone()
        visible[n - 1] = True
        expected = req_to_token[row, :n][visible]
        got = lists.kv_indices[int(lists.kv_indptr[i]) : int(lists.kv_indptr[i + 1])]
        assert torch.equal(got, expected), f"entry {i}"


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None = None) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        allowed = torch.arange(k.shape[0], device=q.device)[None, :] <= causal_offset + torch.arange(q.shape[0], device=q.device)[:, None]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf)


def test_flashinfer_decode_reads_exactly_the_visible_slots():
    flashinfer = pytest.importorskip("flashinfer")
    gen = torch.Generator(device="cuda").manual_seed(2)
    batch, width, slots = 4, 4096, 20000
    k_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    v_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    req_to_token = torch.randperm(slots - 1, device="cuda", generator=gen)[: batch * width].view(batch, width).int() + 1
    keep = torch.rand(batch, width, device="cuda", generator=gen) < 0.5
    rows = torch.arange(batch, device="cuda")
    seq_lens = torch.tensor([4096, 1000, 3, 2500], device="cuda")
    lists = decode_kv_indices(req_to_token, rows, seq_lens, KeepMask(keep, rows))
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda"), "NHD", use_tensor_cores=True
    )
    wrapper.plan(lists.kv_indptr, lists.kv_indices, lists.kv_last_page_len, Q_HEADS, KV_HEADS, HEAD_DIM, 1,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = wrapper.run(q, (k_pool.view(slots, 1, KV_HEADS, HEAD_DIM), v_pool.view(slots, 1, KV_HEADS, HEAD_DIM)))
    for i in range(batch):
        n = int(seq_lens[i])
        visible = keep[i, :n].clone()
        visible[n - 1] = True
        slot_ids = req_to_token[i, :n][visible].long()
        expected = dense(q[i : i + 1], k_pool[slot_ids], v_pool[slot_ids])[0]
        torch.testing.assert_close(out[i].float(), expected, atol=2e-2, rtol=2e-2)


def test_flashinfer_paged_prefill_runs_segments_with_their_own_visibility():
    flashinfer = pytest.importorskip("flashinfer")
    gen = torch.Generator(device="cuda").manual_seed(3)
    width, slots = 3000, 8000
    k_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    v_pool = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    req_to_token = torch.randperm(slots - 1, device="cuda", generator=gen)[:width].view(1, width).int() + 1
    prefix, extend = torch.tensor([1000, 1600], device="cuda"), torch.tensor([600, 300], device="cuda")
    keep = torch.ones(2, width, dtype=torch.bool, device="cuda")
    keep[1, 100:700] = False
    meta = extend_kv_indices(req_to_token, torch.zeros(2, dtype=torch.int64, device="cuda"), prefix, extend,
                             KeepMask(keep, torch.arange(2, device="cuda")), include_extend=True)
    q = torch.randn(int(extend.sum()), Q_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda"), "NHD"
    )
    wrapper.plan(meta.qo_indptr, meta.kv.kv_indptr, meta.kv.kv_indices, meta.kv.kv_last_page_len, Q_HEADS,
                 KV_HEADS, HEAD_DIM, 1, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = wrapper.run(q, (k_pool.view(slots, 1, KV_HEADS, HEAD_DIM), v_pool.view(slots, 1, KV_HEADS, HEAD_DIM)))
    start = 0
    for i in range(2):
        p, e = int(prefix[i]), int(extend[i])
        cols = [c for c in range(p) if bool(keep[i, c])] + list(range(p, p + e))
        slot_ids = req_to_token[0, cols].long()
        expected = dense(q[start : start + e], k_pool[slot_ids], v_pool[slot_ids], causal_offset=len(cols) - e)
        torch.testing.assert_close(out[start : start + e].float(), expected, atol=2e-2, rtol=2e-2)
        start += e


def test_all_visible_lists_equal_the_stock_fill():
    """With nothing hidden, the lists are SGLang's stock ``req_to_token[row, :seq_len]`` fill."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    req_to_token = torch.randint(1, 2**30, (9, 50000), device="cuda", dtype=torch.int32, generator=gen)
    rows = torch.tensor([3, 8, 1], device="cuda")
    seq_lens = torch.tensor([50000, 1, 777], device="cuda")
    lists = visible_kv_indices(req_to_token, rows, seq_lens, None)
    expected = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), seq_lens.tolist())])
    assert torch.equal(lists.kv_indices, expected)
