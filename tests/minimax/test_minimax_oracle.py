"""The MiniMax-M2 reference decoder equals transformers' forward (FP32, corrected config), and cached
keys re-rotate on their 64 rotated dims only, bit-copying the other 64."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import rerotate_kv
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from akv.system.reference.minimax_m2 import MiniMaxM2Config, MiniMaxM2Model
from akv.system.reference.model import ConfigError
from akv.system.reference.oracle import run_oracle

N = 40


def _ids(seed: int, n: int = N) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _hf(minimax_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(minimax_dir, dtype=torch.float32, attn_implementation="eager")


def test_oracle_without_events_equals_transformers(minimax_dir: Path, minimax: MiniMaxM2Model) -> None:
    ids = _ids(7)
    with torch.no_grad():
        expected = torch.log_softmax(_hf(minimax_dir)(ids[None]).logits[0].float(), dim=-1)
    result = run_oracle(minimax, ids)
    torch.testing.assert_close(result.log_probs(), expected, atol=1e-4, rtol=0)
    assert expected.exp().max() > 0.2, "random weights must give peaked, not uniform, predictions"


def test_routing_uses_every_expert_and_the_bias_changes_choices(minimax: MiniMaxM2Model) -> None:
    hidden = minimax.embed(_ids(3))
    x = minimax._rms_norm(hidden, "model.layers.0.post_attention_layernorm.weight")
    chosen, weights = minimax.route(0, x)
    assert set(chosen.flatten().tolist()) == set(range(8))
    torch.testing.assert_close(weights.sum(-1), torch.ones(N))
    scores = torch.sigmoid(x @ minimax._w["model.layers.0.block_sparse_moe.gate.weight"].T)
    unbiased = torch.topk(scores, 2, dim=-1).indices
    assert (chosen.sort().values != unbiased.sort().values).any(), "the routing bias must matter in this model"


def test_transformers_cache_keys_are_rotated_on_the_first_64_dims_only(minimax_dir: Path,
                                                                      minimax: MiniMaxM2Model) -> None:
    ids = _ids(8, 24)
    with torch.no_grad():
        cache = _hf(minimax_dir)(ids[None], use_cache=True).past_key_values
    result = run_oracle(minimax, ids)
    for layer in range(minimax.config.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
        torch.testing.assert_close(result.keys_at(minimax, layer, torch.arange(24)), hf_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(result.raw_k[layer][..., 64:], hf_k[..., 64:], atol=1e-5, rtol=0)
        torch.testing.assert_close(result.v[layer], cache.layers[layer].values[0].transpose(0, 1), atol=1e-5, rtol=0)


def _cached(minimax_dir: Path, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """transformers' KV cache as per-layer ``[slots, kv_heads, head_dim]`` pools (slot = token)."""
    with torch.no_grad():
        cache = _hf(minimax_dir)(ids[None], use_cache=True).past_key_values
    return ([layer.keys[0].transpose(0, 1).contiguous() for layer in cache.layers],
            [layer.values[0].transpose(0, 1).contiguous() for layer in cache.layers])


# Reposition survivors 5..29 of 30 cached tokens (written at 0..29) into slots 30..54 at positions 0..24.
SRC, DST = torch.arange(5, 30), torch.arange(30, 55)
OLD, NEW = SRC.clone(), torch.arange(25)


def _pools(minimax_dir: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    k, v = _cached(minimax_dir, _ids(9, 30))
    pad = [torch.zeros(25, *k[0].shape[1:])] * len(k)
    return [torch.cat((a, b)) for a, b in zip(k, pad)], [torch.cat((a, b)) for a, b in zip(v, pad)]


def test_reference_rerotation_of_cached_keys_equals_keys_at_the_new_positions(minimax_dir: Path,
                                                                              minimax: MiniMaxM2Model) -> None:
    k, v = _pools(minimax_dir)
    before_k, before_v = [t.clone() for t in k], [t.clone() for t in v]
    spec = RopeSpec.from_config(json.loads((minimax_dir / "config.json").read_text()))
    assert spec.rotary_dim == 64
    rerotate_kv_reference(LayerBuffers.of(k), LayerBuffers.of(v), SRC, DST, OLD, NEW, spec)
    oracle = run_oracle(minimax, _ids(9, 30))
    for layer in range(minimax.config.num_layers):
        expected = oracle.keys_at(minimax, layer, torch.arange(30))
        torch.testing.assert_close(k[layer][:30], before_k[layer][:30], atol=0, rtol=0)
        torch.testing.assert_close(k[layer][DST], minimax.rotate(oracle.raw_k[layer][SRC], NEW), atol=2e-5, rtol=0)
        assert torch.equal(k[layer][DST][..., 64:], before_k[layer][SRC][..., 64:]), "unrotated half is a bit copy"
        assert torch.equal(v[layer][DST], before_v[layer][SRC])
        torch.testing.assert_close(before_k[layer][:30], expected, atol=1e-5, rtol=0)


def test_full_head_rerotation_would_corrupt_the_unrotated_half(minimax_dir: Path) -> None:
    k, v = _pools(minimax_dir)
    wrong = RopeSpec(theta=5e6, head_dim=128, rotary_dim=128)
    before = k[0][SRC].clone()
    rerotate_kv_reference(LayerBuffers.of(k), LayerBuffers.of(v), SRC, DST, OLD, NEW, wrong)
    assert (k[0][DST][..., 64:] - before[..., 64:]).abs().max() > 1e-3


def test_triton_kernel_equals_the_reference_on_the_minimax_layout(minimax_dir: Path, device: torch.device) -> None:
    k_ref, v_ref = _pools(minimax_dir)
    k_kernel, v_kernel = [t.clone().to(device) for t in k_ref], [t.clone().to(device) for t in v_ref]
    spec = RopeSpec.from_config(json.loads((minimax_dir / "config.json").read_text()))
    rerotate_kv_reference(LayerBuffers.of(k_ref), LayerBuffers.of(v_ref), SRC, DST, OLD, NEW, spec)
    index = [t.to(device) for t in (SRC, DST, OLD, NEW)]
    rerotate_kv(LayerBuffers.of(k_kernel), LayerBuffers.of(v_kernel), *index, RopeTable.build(spec, 64, device))
    for got, want in zip(k_kernel, k_ref):
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
        assert torch.equal(got.cpu()[DST][..., 64:], want[DST][..., 64:])
    for got, want in zip(v_kernel, v_ref):
        assert torch.equal(got.cpu(), want)


def _config(minimax_dir: Path) -> dict:
    return json.loads((minimax_dir / "config.json").read_text())


def test_official_config_without_the_factor_rotates_rotary_dim(minimax_dir: Path) -> None:
    official = {k: v for k, v in _config(minimax_dir).items() if k not in ("partial_rotary_factor", "rope_parameters")}
    assert MiniMaxM2Config.from_dict(official).rotary_dim == 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"partial_rotary_factor": 1.0, "rope_parameters": None}, "transformers and SGLang would disagree"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type must be 'per_layer', got 'per_head'"),
        ({"shared_intermediate_size": 512}, "shared_intermediate_size must be 0, got 512"),
        ({"scoring_func": "softmax"}, "scoring_func must be 'sigmoid'"),
        ({"architectures": ["MiniMaxText01ForCausalLM"]}, "lightning attention"),
        ({"attn_type_list": [0, 1]}, r"attn_type_list\[0\] = 0"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_local_experts \(8\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling is not supported"),
        ({"rotary_dim": 130, "partial_rotary_factor": None, "rope_parameters": None}, "rotary_dim must be even"),
    ],
)
def test_unsupported_configs_are_rejected_by_name(minimax_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MiniMaxM2Config.from_dict({**_config(minimax_dir), **change})


def test_missing_expert_weights_are_named(minimax_dir: Path) -> None:
    weights = load_file(str(minimax_dir / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.7.w2.weight"]
    with pytest.raises(ConfigError, match="model.layers.1.block_sparse_moe.experts.7.w2.weight"):
        MiniMaxM2Model(MiniMaxM2Config.from_dict(_config(minimax_dir)), weights)
