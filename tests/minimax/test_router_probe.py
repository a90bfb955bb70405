"""bench/router_ties.py's probe: the gaps it records are the biased router scores' k-th minus
(k+1)-th, computed here from the weights; a swap changes one row of one call, as asked."""

from __future__ import annotations


import torch

from akv.system.reference.minimax_m2 import MiniMaxM2Model

from bench.router_ties import RouterProbe, token_gaps


def _inputs(minimax: MiniMaxM2Model, layer: int) -> torch.Tensor:
    hidden = minimax.embed(torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(5)))
    return minimax._rms_norm(hidden, f"model.layers.{layer}.post_attention_layernorm.weight")


def _biased(minimax: MiniMaxM2Model, layer: int, x: torch.Tensor) -> torch.Tensor:
    p = f"model.layers.{layer}.block_sparse_moe."
    return torch.sigmoid(x @ minimax._w[p + "gate.weight"].T) + minimax._w[p + "e_score_correction_bias"]


def test_probe_records_the_last_rows_gap_and_swaps_only_the_asked_call(minimax: MiniMaxM2Model) -> None:
    k = minimax.config.top_k
    original = minimax.route
    x0, x1 = _inputs(minimax, 0), _inputs(minimax, 1)
    want0, want1 = original(0, x0), original(1, x1)
    probe = RouterProbe(minimax)
    try:
        probe.swap_at = 1
        got0, got1 = minimax.route(0, x0), minimax.route(1, x1)
    finally:
        minimax.route = original
    for (layer, gap), x in zip(probe.calls, (x0, x1)):
        ranked = _biased(minimax, layer, x)[-1].sort(descending=True).values
        assert abs(gap - float(ranked[k - 1] - ranked[k])) < 1e-6
    assert [layer for layer, _ in probe.calls] == [0, 1]
    assert torch.equal(got0[0], want0[0]) and torch.equal(got0[1], want0[1])
    order = _biased(minimax, 1, x1)[-1].argsort(descending=True).tolist()
    assert got1[0][-1].tolist() == order[: k - 1] + [order[k]]
    assert torch.equal(got1[0][:-1], want1[0][:-1])
    torch.testing.assert_close(got1[1].sum(-1), torch.ones(x1.shape[0]))


def test_token_gaps_take_the_prefills_last_forward_then_one_forward_per_decode_step() -> None:
    calls = [(0, 9.0), (1, 9.0), (0, 0.1), (1, 0.2), (0, 0.3), (1, 0.4)]  # two prefill forwards, one decode
    assert token_gaps(calls, 2, 2) == [[0.1, 0.2], [0.3, 0.4]]
