"""Consequences of DESIGN.md §1 the whole system relies on, checked on the oracle."""

from __future__ import annotations

import torch

from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, OracleResult, Repos, run_oracle
from akv.system.reference.paged import forward_paged

TIGHT = 5e-5  # FP32 rounding of differently shaped blocks; logits are O(10)
CLEARLY_DIFFERENT = 1e-2


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, B, C, D = _tokens(1, 6), _tokens(2, 5), _tokens(3, 7), _tokens(4, 3)


def _span(result: OracleResult, start: int, end: int, layer: int) -> torch.Tensor:
    """Everything the cache holds and the model emits for tokens ``start:end`` at ``layer``."""
    return torch.cat((result.raw_k[layer][start:end].flatten(1), result.v[layer][start:end].flatten(1)), dim=1)


def _max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max())


def test_figure5_three_orderings(qwen3: ReferenceModel) -> None:
    a, b, c = len(A), len(B), len(C)
    drop_after_c = run_oracle(qwen3, A + B + C + D, [Drop(a + b + c, tuple(range(a)))])
    drop_before_c = run_oracle(qwen3, A + B + C + D, [Drop(a + b, tuple(range(a)))])
    never_had_a = run_oracle(qwen3, B + C + D)
    last = qwen3.config.num_layers - 1

    # "compute C then drop A" and "drop A then compute C": same B ...
    for layer in range(qwen3.config.num_layers):
        assert _max_diff(_span(drop_after_c, a, a + b, layer), _span(drop_before_c, a, a + b, layer)) < TIGHT
    assert _max_diff(drop_after_c.logits[a:a + b], drop_before_c.logits[a:a + b]) < TIGHT
    # ... but different C: one saw A, the other did not.
    c_seen_a, c_unseen_a = _span(drop_after_c, a + b, a + b + c, last), _span(drop_before_c, a + b, a + b + c, last)
    assert _max_diff(c_seen_a, c_unseen_a) > CLEARLY_DIFFERENT
    assert _max_diff(drop_after_c.logits[a + b:a + b + c], drop_before_c.logits[a + b:a + b + c]) > CLEARLY_DIFFERENT

    # "never had A": B differs too. Layer-0 K/V depend on the token alone, deeper ones on its history.
    assert _max_diff(_span(never_had_a, 0, b, 0), _span(drop_after_c, a, a + b, 0)) < TIGHT
    assert _max_diff(_span(never_had_a, 0, b, last), _span(drop_after_c, a, a + b, last)) > CLEARLY_DIFFERENT
    assert _max_diff(never_had_a.logits[:b], drop_after_c.logits[a:a + b]) > CLEARLY_DIFFERENT


def test_dropping_is_not_forgetting(qwen3: ReferenceModel) -> None:
    a, b, c = len(A), len(B), len(C)
    dropped = run_oracle(qwen3, A + B + C + D, [Drop(a + b + c, tuple(range(a)))])
    never_had_a = run_oracle(qwen3, B + C + D)
    # D attends to neither A in both runs, yet B and C carry A's information into D.
    assert _max_diff(dropped.logits[a + b + c:], never_had_a.logits[b + c:]) > CLEARLY_DIFFERENT


def test_drop_after_the_last_token_changes_nothing_computed(qwen3: ReferenceModel) -> None:
    plain = run_oracle(qwen3, A + B)
    dropped = run_oracle(qwen3, A + B, [Drop(len(A + B), tuple(range(len(A)))), Repos(len(A + B))])
    assert torch.equal(plain.logits, dropped.logits)
    assert dropped.layout.next_position == len(B)


def test_repos_without_drop_is_a_no_op(qwen3: ReferenceModel) -> None:
    plain = run_oracle(qwen3, A + B + C)
    repositioned = run_oracle(qwen3, A + B + C, [Repos(len(A)), Repos(len(A + B))])
    assert _max_diff(plain.logits, repositioned.logits) < TIGHT
    assert repositioned.layout.birth_position.tolist() == list(range(len(A + B + C)))


def test_compacting_a_dropped_prefix_keeps_relative_distances(qwen3: ReferenceModel) -> None:
    # RoPE scores depend on position differences only; removing a prefix shifts every survivor equally.
    at = len(A + B)
    shifted = run_oracle(qwen3, A + B + C, [Drop(at, tuple(range(len(A))))])
    compacted = run_oracle(qwen3, A + B + C, [Drop(at, tuple(range(len(A)))), Repos(at)])
    assert compacted.layout.birth_position[at:].tolist() == list(range(len(B), len(B + C)))
    assert _max_diff(shifted.logits[at:], compacted.logits[at:]) < 1e-4


def test_compacting_a_hole_changes_what_follows(qwen3: ReferenceModel) -> None:
    # B | A | D, drop A: compaction pulls B closer to C, so C's attention scores change.
    tokens = B + A + D + C
    hole = tuple(range(len(B), len(B + A)))
    at = len(B + A + D)
    kept_positions = run_oracle(qwen3, tokens, [Drop(at, hole)])
    compacted = run_oracle(qwen3, tokens, [Drop(at, hole), Repos(at)])
    assert _max_diff(kept_positions.logits[at:], compacted.logits[at:]) > CLEARLY_DIFFERENT


def test_repos_then_append_equals_a_fresh_run_over_compacted_survivors(qwen3: ReferenceModel) -> None:
    # Survivors keep the hidden states they computed with A visible; only their positions change.
    tokens, hole, at = B + A + D, tuple(range(len(B), len(B + A))), len(B + A + D)
    oracle = run_oracle(qwen3, tokens + C, [Drop(at, hole), Repos(at)])

    history = run_oracle(qwen3, tokens)  # no events: the survivors' K/V as computed before the drop
    survivors = torch.tensor([t for t in range(at) if t not in hole])
    r, c = survivors.numel(), len(C)
    cfg = qwen3.config
    k_pool = [torch.zeros(r + c, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    v_pool = [torch.zeros(r + c, cfg.num_kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    for layer in range(cfg.num_layers):
        k_pool[layer][:r] = qwen3.rotate(history.raw_k[layer][survivors], torch.arange(r))
        v_pool[layer][:r] = history.v[layer][survivors]
    lists = [list(range(r + i + 1)) for i in range(c)]
    fresh = forward_paged(
        qwen3, torch.tensor(C), torch.arange(r, r + c), k_pool, v_pool, torch.arange(r, r + c),
        torch.tensor([0] + [len(x) for x in lists]).cumsum(0), torch.tensor([s for x in lists for s in x]),
    )
    assert _max_diff(oracle.logits[at:], fresh) < TIGHT
    assert oracle.layout.birth_position[at:].tolist() == list(range(r, r + c))
