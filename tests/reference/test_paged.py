"""forward_paged, driven the way a server drives it (slot pool, per-query lists, chunked prefill,
re-rotation on Repos), reproduces the oracle's logits and cached keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, OracleEvent, Repos, run_oracle
from akv.system.reference.paged import forward_paged
from akv.system.reference.rope import rerotate


class SlotServer:
    """A toy server: token ``t`` lives in slot ``t + offset``; drops shrink the visible list; Repos
    re-rotates the survivors' stored keys in place."""

    def __init__(self, model: ReferenceModel, n_slots: int, offset: int = 0):
        cfg = model.config
        self.model, self.offset = model, offset
        shape = (n_slots, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = [torch.full(shape, float("nan")) for _ in range(cfg.num_layers)]
        self.v_pool = [torch.full(shape, float("nan")) for _ in range(cfg.num_layers)]
        self.position: dict[int, int] = {}
        self.next_position = 0
        self.n_appended = 0

    def append(self, ids: list[int]) -> torch.Tensor:
        start, n = self.n_appended, len(ids)
        positions = torch.arange(self.next_position, self.next_position + n)
        visible = [s + self.offset for s in sorted(self.position)]
        lists = [visible + [self.offset + start + j for j in range(i + 1)] for i in range(n)]
        logits = forward_paged(
            self.model, torch.tensor(ids), positions, self.k_pool, self.v_pool,
            torch.arange(start, start + n) + self.offset,
            torch.tensor([0] + [len(x) for x in lists]).cumsum(0), torch.tensor([s for x in lists for s in x]),
        )
        for j in range(n):
            self.position[start + j] = self.next_position + j
        self.next_position += n
        self.n_appended += n
        return logits

    def apply(self, event: OracleEvent) -> None:
        if isinstance(event, Drop):
            for t in event.tokens:
                self.position.pop(t, None)
            return
        tokens = sorted(self.position)
        if tokens:
            slots = torch.tensor(tokens) + self.offset
            old = torch.tensor([self.position[t] for t in tokens])
            new = torch.arange(len(tokens))
            for pool in self.k_pool:
                pool[slots] = rerotate(pool[slots], old, new, theta=self.model.config.rope_theta)
        self.position = {t: i for i, t in enumerate(tokens)}
        self.next_position = len(tokens)


def serve(
    model: ReferenceModel, ids: list[int], events: list[OracleEvent], chunks: list[int]
) -> tuple[torch.Tensor, SlotServer]:
    """Append ``ids`` in chunks of the given sizes (cut at event boundaries), applying events in order."""
    server = SlotServer(model, len(ids))
    logits, remaining, sizes = [], list(events), list(chunks)
    while server.n_appended < len(ids) or remaining:
        if remaining and remaining[0].at == server.n_appended:
            server.apply(remaining.pop(0))
            continue
        limit = remaining[0].at if remaining else len(ids)
        size = min(sizes.pop(0) if sizes else len(ids), limit - server.n_appended)
        logits.append(server.append(ids[server.n_appended:server.n_appended + size]))
    return torch.cat(logits), server


def test_hand_built_program_through_the_pool_equals_oracle(qwen3: ReferenceModel) -> None:
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    events = [Drop(12, (2, 3, 4, 5)), Repos(12), Drop(25, tuple(range(13, 20))), Drop(33, (0, 1)), Repos(33)]
    logits, server = serve(qwen3, ids, events, chunks=[5, 1, 9, 4, 1, 1, 30])
    expected = run_oracle(qwen3, ids, events)
    torch.testing.assert_close(logits, expected.logits, atol=5e-5, rtol=0)
    for layer in range(qwen3.config.num_layers):
        kept, keys, values = expected.final_kv(qwen3, layer)
        assert kept.tolist() == [t for t in range(40) if t not in {0, 1, 2, 3, 4, 5} | set(range(13, 20))]
        torch.testing.assert_close(server.k_pool[layer][kept], keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(server.v_pool[layer][kept], values, atol=1e-5, rtol=0)
    assert server.next_position == expected.layout.next_position


@st.composite
def served_histories(draw: st.DrawFn) -> tuple[list[int], list[OracleEvent], list[int]]:
    n = draw(st.integers(1, 24))
    ids = draw(st.lists(st.integers(0, 511), min_size=n, max_size=n))
    events: list[OracleEvent] = []
    for at in sorted(draw(st.lists(st.integers(0, n), max_size=5))):
        hidden = tuple(draw(st.sets(st.integers(0, at - 1), max_size=at))) if at else ()
        events.append(Repos(at) if draw(st.booleans()) else Drop(at, hidden))
    chunks = draw(st.lists(st.integers(1, 8), max_size=10))
    return ids, events, chunks


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=served_histories())
def test_random_histories_and_chunkings_equal_oracle(qwen3: ReferenceModel, history: tuple) -> None:
    ids, events, chunks = history
    logits, _ = serve(qwen3, ids, events, chunks)
    torch.testing.assert_close(logits, run_oracle(qwen3, ids, events).logits, atol=5e-5, rtol=0)


def test_two_requests_batched_in_one_call_equal_separate_calls(qwen3: ReferenceModel) -> None:
    cfg = qwen3.config
    gen = torch.Generator().manual_seed(6)
    first, second = torch.randint(0, 512, (6,), generator=gen), torch.randint(0, 512, (4,), generator=gen)
    k_pool = [torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    v_pool = [torch.zeros(16, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    # request 1 in slots 0..5 at positions 0..5, request 2 in slots 10..13 at positions 0..3
    lists = [list(range(i + 1)) for i in range(6)] + [list(range(10, 10 + i + 1)) for i in range(4)]
    batched = forward_paged(
        qwen3, torch.cat((first, second)), torch.cat((torch.arange(6), torch.arange(4))), k_pool, v_pool,
        torch.cat((torch.arange(6), torch.arange(10, 14))),
        torch.tensor([0] + [len(x) for x in lists]).cumsum(0), torch.tensor([s for x in lists for s in x]),
    )
    torch.testing.assert_close(batched[:6], run_oracle(qwen3, first.tolist()).logits, atol=5e-5, rtol=0)
    torch.testing.assert_close(batched[6:], run_oracle(qwen3, second.tolist()).logits, atol=5e-5, rtol=0)


def _call(model: ReferenceModel, **overrides: object) -> torch.Tensor:
    cfg = model.config
    args: dict[str, object] = dict(
        token_ids=torch.tensor([1, 2]), positions=torch.tensor([0, 1]),
        k_pool=[torch.zeros(4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)],
        v_pool=[torch.zeros(4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)],
        out_slots=torch.tensor([0, 1]), kv_indptr=torch.tensor([0, 1, 3]), kv_indices=torch.tensor([0, 0, 1]),
    )
    args.update(overrides)
    return forward_paged(model, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"positions": torch.tensor([0])}, r"positions must have shape \(2,\), got \(1,\)"),
        ({"positions": torch.tensor([0, -1])}, "positions must be >= 0, got -1"),
        ({"out_slots": torch.tensor([0, 4])}, r"out_slots must be slots in \[0, 4\), got 4"),
        ({"out_slots": torch.tensor([1, 1])}, "out_slots must be distinct"),
        ({"kv_indptr": torch.tensor([0, 1])}, r"kv_indptr must have shape \(3,\)"),
        ({"kv_indptr": torch.tensor([0, 1, 2])}, "kv_indptr must start at 0 and end at len"),
        ({"kv_indptr": torch.tensor([0, 0, 3])}, "every query at least one slot, query 0 has 0"),
        ({"kv_indices": torch.tensor([0, 0, 9])}, r"kv_indices must be slots in \[0, 4\), got 9"),
        ({"kv_indices": torch.tensor([0, 1, 1])}, "must not list a slot twice"),
        ({"k_pool": []}, r"k_pool must hold one tensor per layer \(2\), got 0"),
        ({"v_pool": [torch.zeros(4, 1, 1), torch.zeros(4, 1, 1)]}, r"v_pool\[0\] must have shape"),
    ],
)
def test_bad_arguments_name_the_field(qwen3: ReferenceModel, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _call(qwen3, **overrides)


def test_only_listed_slots_are_read(qwen3: ReferenceModel) -> None:
    cfg = qwen3.config
    clean = _call(qwen3)
    poisoned_k = [torch.zeros(4, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    for pool in poisoned_k:
        pool[2:] = float("nan")  # unlisted slots hold garbage
    torch.testing.assert_close(_call(qwen3, k_pool=poisoned_k), clean, atol=0, rtol=0)
