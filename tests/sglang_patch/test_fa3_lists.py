"""FA3 metadata for batches that hold context requests (``akv.system.adapter.fa3_lists``), checked
through a plain-torch model of FA3's ``flash_attn_with_kvcache`` against brute-force attention.

FA3 is a CUDA kernel, so :func:`fa3_with_kvcache` states what it computes from the metadata it is
given (paged KV at page size 1: ``page_table`` rows, ``cache_seqlens``, ``cu_seqlens_q``, the causal
mask aligned to the bottom right). Context requests come from the cache planner on compiled
conversations (drops, repositions, reuse and re-rotation across turns) and are executed on the
brute-force KV store of ``tests/cache/brute.py``: every slot holds a label (which token's KV, at
which position), and each label has random K/V vectors. The brute force says which labels each
query reads; its attention over exactly those keys is what FA3 must output, for extend forwards
(each segment, or a part of one, an entry of its own; plain requests beside them) and decode steps
(eager, and into the buffers a captured CUDA graph reads, padded as SGLang pads them).
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from akv.system.adapter import fa3_lists
from akv.system.adapter.batch_metadata import AkvForward
from akv.system.adapter.context_request import VISIBLE_ALWAYS, AkvRequest
from akv.system.adapter.extend_entries import EntryLists
from akv.system.cache.core import CacheCore
from akv.system.cache.pool import SlotPool
from akv.system.kernels import VisibleUntil
from tests.cache.brute import Interner, SimulatedKV, Trace, brute_layout
from tests.cache.conversations import Conversation, conversations

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
POOL = 300
WIDTH = 96  # req_to_token columns
PLAIN_BASE = 1000  # plain requests' slots (outside the planner's pool)
N_SLOTS = 1200
PAD = 2  # CUDA-graph padding entries


# ------------------------------------------------------------------ FA3 and the brute force ---


def fa3_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_seqlen_q: int) -> torch.Tensor:
    """What FA3's ``flash_attn_with_kvcache`` outputs for a paged cache of page size 1 (no new keys,
    causal, no window): sequence ``b``'s queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` attend to
    the keys at slots ``page_table[b, :cache_seqlens[b]]``; of ``n_q`` queries over ``n_k`` keys,
    query ``i`` sees the first ``n_k - n_q + i + 1`` (the causal mask aligned to the bottom right; a
    query that sees none outputs zeros). Asserts the argument shapes and dtypes the kernel needs."""
    batch = cache_seqlens.shape[0]
    assert page_table.dtype == cache_seqlens.dtype == cu_seqlens_q.dtype == torch.int32
    assert page_table.dim() == 2 and page_table.shape[0] == batch and cu_seqlens_q.shape == (batch + 1,)
    assert int(cu_seqlens_q[0]) == 0 and int(cu_seqlens_q[-1]) == q.shape[0] and k_cache.shape[1] == 1
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        lo, hi, n_k = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(cache_seqlens[b])
        assert 0 < hi - lo <= max_seqlen_q and 0 <= n_k <= page_table.shape[1]
        slots = page_table[b, :n_k].long()
        for i in range(hi - lo):
            seen = slots[: max(n_k - (hi - lo) + i + 1, 0)]
            if seen.numel():
                out[lo + i] = dense(q[lo + i], k_cache[seen, 0], v_cache[seen, 0])
    return out


def dense(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one query ``[Q_HEADS, d]`` over ``keys/values [n, KV_HEADS, d]``, float64."""
    group = Q_HEADS // KV_HEADS
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)


class Store:
    """The KV pool as FA3 reads it: the brute-force store's label per slot, random K/V per label;
    slots that hold nothing are NaN (a read of one poisons the output)."""

    def __init__(self, seed: int) -> None:
        self.kv = SimulatedKV()
        self.pool = SlotPool(POOL, on_free=self.kv.forget)
        self.core = CacheCore(self.pool)
        self.intern = Interner()
        self.generator = torch.Generator().manual_seed(seed)
        self.vectors: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}

    def label(self, slot: int, label: object) -> None:
        self.kv.content[slot] = label

    def vector(self, label: object) -> tuple[torch.Tensor, torch.Tensor]:
        if label not in self.vectors:
            self.vectors[label] = tuple(torch.randn(2, KV_HEADS, HEAD_DIM, generator=self.generator, dtype=torch.float64))
        return self.vectors[label]

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.full((N_SLOTS, 1, KV_HEADS, HEAD_DIM), math.nan, dtype=torch.float64)
        v = k.clone()
        for slot, label in self.kv.content.items():
            k[slot, 0], v[slot, 0] = self.vector(label)
        return k, v

    def expected(self, q: torch.Tensor, labels: list[object]) -> torch.Tensor:
        keys, values = zip(*(self.vector(label) for label in labels))
        return dense(q, torch.stack(keys), torch.stack(values))


def serve_turns(store: Store, conv: Conversation, turns: list[int]):
    """The turns before the last admitted, executed on the brute-force store (which asserts every
    read of their plans) and published; the last one admitted: ``(program, plan, brute layout)``."""
    for turn in turns[:-1]:
        program = conv.program(turn)
        request = store.core.admit(program)
        store.kv.execute(request.plan, brute_layout(program, store.intern), store.pool)
        store.core.finish(request)
    program = conv.program(turns[-1])
    return program, store.core.admit(program).plan, brute_layout(program, store.intern)


def forwards(store: Store, plan, brute):
    """The plan's prefill run on the store forward by forward, as the patched server runs a round
    (every segment's births, then every copy, then attention): each forward's segments are yielded
    once their KV is in the store; then the copies generation reads. Every segment runs in one
    forward unless the plan writes a slot twice (copy slots recycled between stages, where the
    scheduler cuts rounds): then one forward per segment."""
    private = set(plan.fresh.tolist())
    writes = [s for seg in plan.segments for s in seg.slots.tolist()] + [d for j in plan.copies for d in j.dst.tolist()]
    groups = [list(plan.segments)] if len(writes) == len(set(writes)) else [[seg] for seg in plan.segments]
    for group in groups:
        for seg in group:
            for slot, t in zip(seg.slots.tolist(), range(seg.start, seg.end)):
                store.kv._write(slot, (brute.names[t], brute.birth[t]), store.pool, Trace(), private)
        for seg in group:
            store.kv._copy(seg.copies, brute, store.pool, Trace(), private)
        yield group
    store.kv._copy(plan.terminal.copies, brute, store.pool, Trace(), private)


# ------------------------------------------------------------------ batches ---


class Batch:
    """``req_to_token``, the visibility table, and per query what the brute force says it reads."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.req_to_token = torch.zeros((8, WIDTH), dtype=torch.int32)
        self.visibility = torch.full((9, WIDTH), VISIBLE_ALWAYS, dtype=torch.int32)
        self.next_slot = PLAIN_BASE
        self.rows = 0
        self.plain_row(1)  # row 0: where SGLang's CUDA-graph padding entries point

    def plain_row(self, n: int) -> int:
        """A plain request's row of ``n`` labelled columns."""
        row = self.rows % 8
        self.rows += 1
        for c in range(n):
            self.req_to_token[row, c] = self.next_slot
            self.store.label(self.next_slot, ("plain", row, c))
            self.next_slot += 1
        return row

    def column_labels(self, row: int, n: int) -> list[object]:
        return [self.store.kv.content[int(s)] for s in self.req_to_token[row, :n]]


def extend_forward(store: Store, segments, brute, chunk: int, plains: list[tuple[int, int]], plain_first: bool,
                   device: str = "cpu"):
    """An extend forward: the segments cut in parts of ``chunk`` queries (one entry each), plain
    requests ``(prefix, new)`` beside them; the forward batch and the labels each query reads."""
    batch = Batch(store)
    entries, expected = EntryLists(), []

    def add_plains() -> None:
        for n_prefix, n_new in plains:
            row = batch.plain_row(n_prefix + n_new)
            entries.plain(row, n_prefix, n_new)
            expected.extend(batch.column_labels(row, n_prefix + i + 1) for i in range(n_new))

    if plain_first:
        add_plains()
    for segment in segments:
        for part in segment.chunks(chunk):
            entries.context(part.prefix_slots, part.slots)
            expected.extend(sorted(brute.reads[t]) for t in range(part.start, part.end))
    if not plain_first:
        add_plains()
    built = entries.build(device)
    batch.req_to_token = batch.req_to_token.to(device)
    akv = AkvForward(positions=torch.zeros(0), visibility=None, visible_prefix=np.zeros(0, np.int64), copies=None,
                     entries=built)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode_or_idle=lambda: False), akv=akv)
    return batch, fb, expected


def decode_forward(store: Store, program, plan, brute, generated: int, plains: list[int], device: str = "cpu"):
    """A decode step of the context request after ``generated`` tokens (the decoded one last), plain
    requests of the given lengths beside it; the forward batch and the labels each query reads."""
    batch = Batch(store)
    state = AkvRequest(program)
    row, n = batch.rows, program.n_tokens
    batch.rows += 1
    stale = [s for s, label in store.kv.content.items() if s < PLAIN_BASE and label not in brute.terminal.values()]
    for c in range(n):  # dropped columns keep a slot that holds other KV, as SGLang's row does
        batch.req_to_token[row, c] = stale[c % len(stale)] if stale else N_SLOTS - 1
    batch.req_to_token[row, torch.tensor(plan.terminal.tokens)] = torch.tensor(plan.terminal.slots, dtype=torch.int32)
    for j in range(generated):
        batch.req_to_token[row, n + j] = batch.next_slot
        store.label(batch.next_slot, ("generated", j))
        batch.next_slot += 1
    seq_len = n + generated
    batch.visibility[row + 1] = torch.from_numpy(state.visibility_row(WIDTH).astype(np.int32))
    expected = [sorted(brute.terminal.values()) + [("generated", j) for j in range(generated)]]
    rows, seq_lens, vis_rows, queries, prefix = [row], [seq_len], [row + 1], [seq_len - 1], [state.visible_before(seq_len - 1)]
    for length in plains:
        plain = batch.plain_row(length)
        rows.append(plain)
        seq_lens.append(length)
        vis_rows.append(0)
        queries.append(length - 1)
        prefix.append(length - 1)
        expected.append(batch.column_labels(plain, length))
    batch.req_to_token = batch.req_to_token.to(device)
    visibility = VisibleUntil(visible_until=batch.visibility.to(device), rows=torch.tensor(vis_rows, device=device),
                              query_index=torch.tensor(queries, device=device))
    akv = AkvForward(positions=torch.zeros(len(rows)), visibility=visibility, visible_prefix=np.asarray(prefix),
                     copies=None)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_decode_or_idle=lambda: True), akv=akv, batch_size=len(rows),
                         req_pool_indices=torch.tensor(rows, device=device), seq_lens=torch.tensor(seq_lens, device=device))
    return batch, fb, expected


# ------------------------------------------------------------------ backend stand-in ---


class Backend:
    """The parts of SGLang's ``FlashAttentionBackend`` the module uses; records scheduler-metadata calls."""

    def __init__(self, req_to_token: torch.Tensor, graph_bs: int | None = None) -> None:
        self.req_to_token = req_to_token
        self.scheduled: list[tuple[int, int, list[int], list[int]]] = []
        self._sched_meta_buf = torch.full((16,), -7, dtype=torch.int32)
        self.decode_cuda_graph_metadata = {}
        if graph_bs is not None:  # buffers as init_cuda_graph_state makes them, holding an earlier replay's values
            self.decode_cuda_graph_metadata[graph_bs] = SimpleNamespace(
                page_table=torch.full((graph_bs + 3, WIDTH), 5, dtype=torch.int32)[:graph_bs],
                cache_seqlens_int32=torch.full((graph_bs + 3,), 50, dtype=torch.int32)[:graph_bs],
                cu_seqlens_q=torch.arange(graph_bs + 4, dtype=torch.int32)[: graph_bs + 1],
                cu_seqlens_k=torch.full((graph_bs + 4,), 9, dtype=torch.int32)[: graph_bs + 1],
                scheduler_metadata=self._sched_meta_buf[:9], max_seq_len_q=1, max_seq_len_k=0)

    def _compute_scheduler_metadata(self, batch_size, max_seq_len_k, cache_seqlens, cu_seqlens_q):
        self.scheduled.append((batch_size, max_seq_len_k, cache_seqlens.tolist(), cu_seqlens_q.tolist()))
        return torch.arange(100, 105, dtype=torch.int32)


def served(store: Store, metadata, q: torch.Tensor) -> torch.Tensor:
    k, v = store.caches()
    return fa3_with_kvcache(q, k, v, metadata.page_table, metadata.cache_seqlens_int32, metadata.cu_seqlens_q,
                            metadata.max_seq_len_q)


def assert_attention(store: Store, metadata, expected: list[list[object]], seed: int) -> torch.Tensor:
    """FA3's output over the metadata equals the brute force's attention for every query; the labels
    each query reads through the page table are exactly the brute force's."""
    q = torch.randn(len(expected), Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    bounds = metadata.cu_seqlens_q.tolist()
    for b in range(len(bounds) - 1):
        n_q, n_k = bounds[b + 1] - bounds[b], int(metadata.cache_seqlens_int32[b])
        for i in range(n_q):
            read = [store.kv.content.get(int(s)) for s in metadata.page_table[b, : n_k - n_q + i + 1]]
            assert sorted(read, key=repr) == sorted(expected[bounds[b] + i], key=repr), f"query {bounds[b] + i}"
    out = served(store, metadata, q)
    want = torch.stack([store.expected(q[i], labels) for i, labels in enumerate(expected)])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-9)
    return out


# ------------------------------------------------------------------ tests ---

MESSAGES = ((1, 2, 0), (2, 2), (0, 1, 1, 2), (1,), (2, 0, 2), (1, 1))
AGENT = Conversation(MESSAGES, {2: (1,), 4: (0, 3)}, (2, 4))
DROPS = Conversation(MESSAGES, {2: (1,), 4: (0, 3)}, ())


@pytest.mark.parametrize(("conv", "turns", "chunk", "per_forward"), [
    (DROPS, [5], 100, 3),  # cold: three stages, one forward
    (DROPS, [5], 2, 3),
    (AGENT, [5], 3, 1),  # cold with repositions: copy slots recycled, a forward per segment
    (AGENT, [1, 3, 5], 3, 2),  # reuse and re-rotated copies of earlier turns' KV
    (AGENT, [0, 2, 4, 5], 1, 1),
])
def test_extend_entries_read_exactly_what_the_brute_force_reads(conv, turns, chunk, per_forward) -> None:
    """Drops and repositions, cold and after earlier turns, the segments of a forward in parts of
    ``chunk`` queries (each an entry), beside plain requests (one with a cached prefix)."""
    store = Store(0)
    program, plan, brute = serve_turns(store, conv, turns)
    for segments in forwards(store, plan, brute):
        assert len(segments) == per_forward
        batch, fb, expected = extend_forward(store, segments, brute, chunk, [(3, 2), (0, 4)], plain_first=True)
        metadata = fa3_lists.eager_metadata(Backend(batch.req_to_token), fb, SimpleNamespace())
        assert metadata.max_seq_len_q == int(fb.akv.entries.n_own.max())
        assert metadata.cu_seqlens_k.tolist() == [0, *np.cumsum(metadata.cache_seqlens_int32.tolist()).tolist()]
        assert_attention(store, metadata, expected, seed=1)


@pytest.mark.parametrize("turns", [[5], [1, 3, 5], [0, 2, 4, 5]])
def test_decode_reads_every_visible_column_eagerly_and_from_the_graph_buffers(turns: list[int]) -> None:
    store = Store(1)
    program, plan, brute = serve_turns(store, AGENT, turns)
    for _ in forwards(store, plan, brute):
        pass
    batch, fb, expected = decode_forward(store, program, plan, brute, generated=3, plains=[4, 1])
    lens = [len(x) for x in expected]

    backend = Backend(batch.req_to_token)
    metadata = fa3_lists.eager_metadata(backend, fb, SimpleNamespace())
    eager = assert_attention(store, metadata, expected, seed=2)
    assert metadata.max_seq_len_q == 1 and metadata.max_seq_len_k == max(lens)
    assert backend.scheduled == [(3, max(lens), lens, [0, 1, 2, 3])]
    assert metadata.scheduler_metadata.tolist() == [100, 101, 102, 103, 104]

    bs = len(expected) + PAD  # SGLang pads the batch: rows 0, seq_lens 1
    graph = SimpleNamespace(**{**vars(fb), "batch_size": bs,
                               "req_pool_indices": torch.cat([fb.req_pool_indices, torch.zeros(PAD, dtype=torch.int64)]),
                               "seq_lens": torch.cat([fb.seq_lens, torch.ones(PAD, dtype=torch.int64)])})
    backend = Backend(batch.req_to_token, graph_bs=bs)
    captured = backend.decode_cuda_graph_metadata[bs]
    buffers = {name: getattr(captured, name).data_ptr() for name in ("page_table", "cache_seqlens_int32", "cu_seqlens_k")}
    fa3_lists.fill_decode_graph(backend, graph)
    assert backend.forward_metadata is captured
    assert {name: getattr(captured, name).data_ptr() for name in buffers} == buffers, "not filled in place"
    assert captured.cache_seqlens_int32.tolist() == lens + [1] * PAD
    assert captured.page_table[len(expected):, 0].tolist() == [int(batch.req_to_token[0, 0])] * PAD
    assert captured.cu_seqlens_k.tolist() == [0, *np.cumsum(lens + [1] * PAD).tolist()]
    padding = [[store.kv.content[int(batch.req_to_token[0, 0])]]] * PAD  # their outputs are dropped
    out = assert_attention(store, captured, expected + padding, seed=2)
    torch.testing.assert_close(out[: len(expected)], eager, rtol=0, atol=0)
    assert backend.scheduled == [(bs, max(lens), lens + [1] * PAD, list(range(bs + 1)))]
    assert backend._sched_meta_buf.tolist() == [100, 101, 102, 103, 104] + [0] * 11


@settings(max_examples=40, deadline=None)
@given(conversations(max_messages=6), st.data())
def test_random_conversations_read_what_the_brute_force_reads(conv: Conversation, data: st.DataObject) -> None:
    """Random histories of drops and repositions, served turn by turn: the last turn's extend forward
    (random parts, random plain requests beside it) and a decode step after it, eager and replayed."""
    last = conv.n_turns - 1
    turns = sorted(data.draw(st.sets(st.integers(0, last - 1), max_size=3))) + [last]
    store = Store(data.draw(st.integers(0, 99)))
    program, plan, brute = serve_turns(store, conv, turns)
    for segments in forwards(store, plan, brute):
        plains = data.draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), max_size=2))
        batch, fb, expected = extend_forward(store, segments, brute, data.draw(st.integers(1, 6)), plains,
                                             data.draw(st.booleans()))
        assert_attention(store, fa3_lists.eager_metadata(Backend(batch.req_to_token), fb, SimpleNamespace()),
                         expected, seed=3)
    generated = data.draw(st.integers(1, 3))
    batch, fb, expected = decode_forward(store, program, plan, brute, generated,
                                         data.draw(st.lists(st.integers(1, 6), max_size=2)))
    assert_attention(store, fa3_lists.eager_metadata(Backend(batch.req_to_token), fb, SimpleNamespace()),
                     expected, seed=4)


def test_a_row_longer_than_the_captured_page_table_is_refused() -> None:
    rows = fa3_lists.Rows(indptr=torch.tensor([0, 5], dtype=torch.int32), indices=torch.arange(5, dtype=torch.int32),
                          lens=np.array([5]))
    with pytest.raises(RuntimeError, match="a row of 5 keys exceeds FA3's page table \\(4 columns\\)"):
        rows.into(torch.zeros((1, 4), dtype=torch.int32))


@pytest.mark.parametrize(("window", "dtype", "config", "says"), [
    (128, "auto", {}, "sliding-window layers"),
    (None, "fp8_e4m3", {}, "kv_cache_dtype 'fp8_e4m3'"),
    (None, "auto", {"attention_arch": SimpleNamespace(name="MLA")}, "MLA attention"),
    (None, "auto", {"is_encoder_decoder": True}, "cross-attention layers"),
    (None, "auto", {"is_local_attention_model": True}, "chunked local attention"),
])
def test_models_fa3_cannot_serve_exactly_are_refused_at_launch(window, dtype, config, says) -> None:
    base = {"attention_arch": SimpleNamespace(name="MHA"), "is_encoder_decoder": False, "is_local_attention_model": False}
    fa3_lists.check_model(SimpleNamespace(**base), None, "auto")
    with pytest.raises(ValueError) as info:
        fa3_lists.check_model(SimpleNamespace(**{**base, **config}), window, dtype)
    others = "triton" if window is not None else "triton or flashinfer"
    assert str(info.value).startswith(f"attention_backend 'fa3' cannot serve context requests with {says}")
    assert str(info.value).endswith(f"; serve this model with --attention-backend {others}")


def test_decode_graphs_replay_context_batches_on_sglang_s_fa3_backend_only(monkeypatch) -> None:
    """Checked without importing SGLang's FA3 module (it needs ``sgl_kernel``): a stand-in module."""
    name = "sglang.srt.layers.attention.flashattention_backend"
    fa3_class = type("FlashAttentionBackend", (), {"fa_impl_ver": 3})
    fa4 = type("FlashAttentionBackend", (fa3_class,), {"fa_impl_ver": 4})()
    monkeypatch.delitem(sys.modules, name, raising=False)
    assert not fa3_lists.replays_context(fa3_class())
    monkeypatch.setitem(sys.modules, name, SimpleNamespace(FlashAttentionBackend=fa3_class))
    assert fa3_lists.replays_context(fa3_class()) and not fa3_lists.replays_context(fa4)
    assert not fa3_lists.replays_context(SimpleNamespace(fa_impl_ver=3))


# ------------------------------------------------------------------ on the GPU: FA3 itself ---

GPU_HEAD_DIM = 128  # a head size FA3 is built for


def fa3_kernel(q, k_cache, v_cache, metadata) -> torch.Tensor:
    """SGLang's FA3 kernel (``sgl_kernel``) as the patched backend calls it, bf16."""
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    bf16 = lambda t: t.to(device="cuda", dtype=torch.bfloat16)  # noqa: E731
    cuda = lambda t: t.to("cuda")  # noqa: E731
    return flash_attn_with_kvcache(
        q=bf16(q), k_cache=bf16(k_cache), v_cache=bf16(v_cache), page_table=cuda(metadata.page_table),
        cache_seqlens=cuda(metadata.cache_seqlens_int32), cu_seqlens_q=cuda(metadata.cu_seqlens_q),
        cu_seqlens_k_new=cuda(metadata.cu_seqlens_k) if metadata.max_seq_len_q > 1 else None,  # as at extend / decode
        max_seqlen_q=metadata.max_seq_len_q,
        softmax_scale=1 / math.sqrt(q.shape[-1]), causal=True).double().cpu()


@pytest.mark.gpu
def test_the_model_of_fa3_is_what_fa3_computes() -> None:
    """The CPU tests' model of ``flash_attn_with_kvcache`` against the kernel: random rows of random
    slots (page size 1), decode (one query each) and varlen queries over longer rows (the causal mask
    aligned to the end of each row), GQA; the model over the same bf16-rounded inputs in float64."""
    g = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).bfloat16().double()  # noqa: E731
    k, v = rnd(N_SLOTS, 1, KV_HEADS, GPU_HEAD_DIM), rnd(N_SLOTS, 1, KV_HEADS, GPU_HEAD_DIM)
    for n_q in ([1, 1, 1, 1], [3, 1, 7, 2, 5]):
        n_k = [q + int(torch.randint(0, 300, (1,), generator=g)) for q in n_q]
        table = torch.randint(0, N_SLOTS, (len(n_q), max(n_k) + 5), generator=g, dtype=torch.int32)
        metadata = SimpleNamespace(page_table=table, cache_seqlens_int32=torch.tensor(n_k, dtype=torch.int32),
                                   cu_seqlens_q=torch.tensor(np.cumsum([0, *n_q]), dtype=torch.int32),
                                   cu_seqlens_k=torch.tensor(np.cumsum([0, *n_k]), dtype=torch.int32),
                                   max_seq_len_q=max(n_q))
        q = rnd(sum(n_q), Q_HEADS, GPU_HEAD_DIM)
        want = fa3_with_kvcache(q, k, v, table, metadata.cache_seqlens_int32, metadata.cu_seqlens_q, max(n_q))
        torch.testing.assert_close(fa3_kernel(q, k, v, metadata), want, rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("turns", [[5], [1, 3, 5]])
def test_fa3_over_the_module_s_metadata_reads_what_the_brute_force_reads(turns: list[int], monkeypatch) -> None:
    """Extend forwards and a decode step with their metadata built on the GPU, FA3's kernel over it,
    against the brute force's attention (bf16 tolerance; slots that hold nothing are zeros here)."""
    monkeypatch.setattr(sys.modules[__name__], "HEAD_DIM", GPU_HEAD_DIM)
    store = Store(3)
    program, plan, brute = serve_turns(store, AGENT, turns)

    def check(batch: Batch, fb: SimpleNamespace, expected: list[list[object]], seed: int) -> None:
        k, v = (t.nan_to_num(0.0).bfloat16().double() for t in store.caches())
        metadata = fa3_lists.eager_metadata(Backend(batch.req_to_token), fb, SimpleNamespace())
        q = torch.randn(len(expected), Q_HEADS, GPU_HEAD_DIM, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64).bfloat16().double()
        want = torch.stack([store.expected(q[i], labels) for i, labels in enumerate(expected)])
        torch.testing.assert_close(fa3_kernel(q, k, v, metadata), want, rtol=0, atol=3e-2)

    for segments in forwards(store, plan, brute):  # each forward against the KV as it holds then
        check(*extend_forward(store, segments, brute, 2, [(3, 2)], plain_first=False, device="cuda"), seed=5)
    check(*decode_forward(store, program, plan, brute, 3, [4], device="cuda"), seed=6)
