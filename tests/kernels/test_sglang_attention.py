"""SGLang 0.5.16's own triton decode and extend attention kernels, fed visible-subset KV lists built
by ``akv.system.kernels.kv_indices``, equal a dense softmax over exactly the visible keys.

On CPU this needs an SGLang source (``AKV_SGLANG_WHEEL=/path/sglang-0.5.16-*.whl`` or
``AKV_SGLANG_DIR``); on the H200 the installed SGLang is used."""

from __future__ import annotations

import math

import pytest
import sglang_attention_loader
import torch

from akv.system.kernels.kv_indices import KeepMask, decode_kv_indices, extend_kv_indices

# SGLang's kernels compute with -inf for fully masked blocks; numpy warns about it under the interpreter.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

KV_HEADS, Q_HEADS, HEAD_DIM = 2, 4, 32
# fp32 under the interpreter; bf16 (what SGLang serves) on CUDA, hence the looser bound there. The
# dense reference runs in float64 on the same rounded values.
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32
TOLERANCE = {"atol": 3e-2, "rtol": 3e-2} if torch.cuda.is_available() else {"atol": 2e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def sglang():
    kernels = sglang_attention_loader.load()
    if kernels is None:
        pytest.skip("no SGLang source: set AKV_SGLANG_WHEEL to the sglang-0.5.16 wheel (or AKV_SGLANG_DIR)")
    return kernels


@pytest.fixture(autouse=True)
def scalar_loop_bounds(monkeypatch):
    """Triton 3.6's interpreter turns a loaded scalar into a 1-element array, which numpy >= 2.4 refuses
    to convert with ``int()``; SGLang's kernels use such scalars as ``range`` bounds."""
    if torch.cuda.is_available():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal_from: int | None = None) -> torch.Tensor:
    """``q [n, Q_HEADS, d]`` over ``keys/values [m, KV_HEADS, d]`` in float64; with ``causal_from``,
    query ``i`` sees keys ``< causal_from + i + 1``."""
    group = Q_HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    if causal_from is not None:
        allowed = torch.arange(k.shape[0])[None, :] < causal_from + torch.arange(q.shape[0])[:, None] + 1
        scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def make_pool(n_slots: int, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n_slots, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    v = torch.randn(n_slots, KV_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    return k.to(device), v.to(device)


def test_decode_attention_reads_only_visible_slots(sglang, device):
    gen = torch.Generator().manual_seed(1)
    seq_lens = torch.tensor([23, 9, 40])
    width, n_slots = 48, 200
    k_pool, v_pool = make_pool(n_slots, device, seed=2)
    req_to_token = torch.randperm(n_slots - 1, generator=gen)[: 3 * width].add(1).view(3, width).int()
    keep = torch.rand(3, width, generator=gen) < 0.5
    rows = torch.tensor([2, 0, 1])
    q = torch.randn(3, Q_HEADS, HEAD_DIM, generator=gen).to(DTYPE)

    lists = decode_kv_indices(
        req_to_token.to(device), rows.to(device), seq_lens.to(device), KeepMask(keep.to(device), rows.to(device)),
        index_dtype=torch.int64,
    )
    max_splits = 4
    out = torch.empty(3, Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    sglang.decode_attention_fwd(
        q.to(device), k_pool, v_pool, out, lists.kv_indptr, lists.kv_indices,
        torch.empty(3, Q_HEADS, max_splits, HEAD_DIM, device=device),
        torch.empty(3, Q_HEADS, max_splits, device=device),
        torch.full((3,), max_splits, dtype=torch.int32, device=device), max_splits,
        1.0 / math.sqrt(HEAD_DIM), 1.0, 1.0,
    )
    for i in range(3):
        row, n = int(rows[i]), int(seq_lens[i])
        cols = [c for c in range(n) if keep[row, c] or c == n - 1]
        slots = req_to_token[row, cols].long()
        expected = dense_attention(q[i : i + 1], k_pool.cpu()[slots], v_pool.cpu()[slots])[0]
        torch.testing.assert_close(out[i].cpu().double(), expected, **TOLERANCE)


def test_extend_attention_segments_see_their_own_stage(sglang, device):
    """Two segments of one request in one extend call: the second segment sees fewer prefix tokens
    (a drop happened between them) and attends causally within itself."""
    gen = torch.Generator().manual_seed(3)
    width, n_slots = 40, 120
    k_pool, v_pool = make_pool(n_slots, device, seed=4)
    req_to_token = (torch.randperm(n_slots - 1, generator=gen)[:width] + 1).view(1, width).int()
    prefix_lens, extend_lens = torch.tensor([10, 17]), torch.tensor([7, 5])
    keep = torch.ones(2, width, dtype=torch.bool)
    keep[1, 2:6] = False
    keep[1, 12:14] = False
    rows = torch.tensor([0, 0])

    q = torch.randn(int(extend_lens.sum()), Q_HEADS, HEAD_DIM, generator=gen).to(DTYPE)
    meta = extend_kv_indices(
        req_to_token.to(device), rows.to(device), prefix_lens.to(device), extend_lens.to(device),
        KeepMask(keep.to(device), torch.arange(2, device=device)), include_extend=False, index_dtype=torch.int64,
    )
    k_extend = torch.cat([k_pool.cpu()[req_to_token[0, p : p + e].long()] for p, e in zip(prefix_lens, extend_lens)])
    v_extend = torch.cat([v_pool.cpu()[req_to_token[0, p : p + e].long()] for p, e in zip(prefix_lens, extend_lens)])
    out = torch.empty_like(q).to(device)
    sglang.extend_attention_fwd(
        q.to(device), k_extend.to(device), v_extend.to(device), out, k_pool, v_pool,
        meta.qo_indptr, meta.kv.kv_indptr, meta.kv.kv_indices, None, True, None, int(extend_lens.max()), 1.0, 1.0,
    )
    start = 0
    for i in range(2):
        p, e = int(prefix_lens[i]), int(extend_lens[i])
        cols = [c for c in range(p) if keep[i, c]] + list(range(p, p + e))
        slots = req_to_token[0, cols].long()
        expected = dense_attention(q[start : start + e], k_pool.cpu()[slots], v_pool.cpu()[slots], causal_from=len(cols) - e)
        torch.testing.assert_close(out[start : start + e].cpu().double(), expected, **TOLERANCE)
        start += e
