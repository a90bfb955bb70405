"""The gpt-oss reference model: equal to transformers' own GptOss forward without events (FP32), and
its attention pieces (sinks, sliding window) checked on a hand-worked example."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from akv.system.reference.gpt_oss import GptOssConfig, GptOssReferenceModel
from akv.system.reference.model import ConfigError
from akv.system.reference.oracle import run_oracle
from tests.gpt_oss.conftest import WINDOW

N_TOKENS = 48


@pytest.fixture(scope="module")
def hf_model(gpt_oss_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gpt_oss_dir), dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def reference(gpt_oss_dir: Path) -> GptOssReferenceModel:
    return GptOssReferenceModel.from_pretrained(gpt_oss_dir)


def _ids() -> torch.Tensor:
    return torch.randint(0, 201088, (N_TOKENS,), generator=torch.Generator().manual_seed(11))


def test_oracle_without_events_equals_transformers(hf_model: torch.nn.Module,
                                                   reference: GptOssReferenceModel) -> None:
    ids = _ids()
    gate_up: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x, experts = args[0], module.gate_up_proj
        gate_up.append(torch.einsum("th,ehi->tei", x, experts) + module.gate_up_proj_bias)

    hooks = [layer.mlp.experts.register_forward_pre_hook(record, with_kwargs=True) for layer in hf_model.model.layers]
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(ids[None]).logits[0].float(), dim=-1)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(run_oracle(reference, ids).log_probs(), expected, atol=1e-4, rtol=0)
    assert expected.exp().max() > 0.2, "random weights must give peaked, not uniform, predictions"
    assert any(bool((g > 7.0).any()) for g in gate_up), "the SwiGLU clamp must be reached"


def test_the_window_and_the_sinks_change_the_result(gpt_oss_dir: Path, reference: GptOssReferenceModel) -> None:
    """Guards the comparison above: a model without either gives clearly different predictions."""
    ids = _ids()
    base = run_oracle(reference, ids).log_probs()
    raw = json.loads((gpt_oss_dir / "config.json").read_text())
    full = GptOssReferenceModel(GptOssConfig.from_dict({**raw, "layer_types": ["full_attention"] * 4}),
                                _weights(gpt_oss_dir))
    no_sinks = GptOssReferenceModel(GptOssConfig.from_dict(raw), {
        name: torch.full_like(t, -1e4) if name.endswith("sinks") else t for name, t in _weights(gpt_oss_dir).items()})
    for other in (full, no_sinks):
        assert (run_oracle(other, ids).log_probs() - base)[WINDOW:].abs().max() > 0.1


def _weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(root / "model.safetensors"))


def test_transformers_kv_cache_equals_oracle_keys_rotated_at_birth(hf_model: torch.nn.Module,
                                                                   reference: GptOssReferenceModel) -> None:
    """The stored key is mscale * R(p) k (YaRN's factor included), as transformers and SGLang cache it."""
    ids = _ids()
    with torch.no_grad():
        cache = hf_model(ids[None], use_cache=True).past_key_values
    result = run_oracle(reference, ids)
    for layer in range(reference.config.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)
        hf_v = cache.layers[layer].values[0].transpose(0, 1)
        kept = hf_k.shape[0]  # a sliding layer's cache keeps only the last window - 1 keys
        assert kept == (N_TOKENS if layer % 2 else WINDOW - 1)
        ours = result.keys_at(reference, layer, torch.arange(N_TOKENS))[-kept:]
        torch.testing.assert_close(ours, hf_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(result.v[layer][-kept:], hf_v, atol=1e-5, rtol=0)


def _unit_model(window: int, sink: float) -> GptOssReferenceModel:
    """One sliding and one full layer, one head of dimension 2; only the sinks matter here."""
    raw = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2, "vocab_size": 4, "hidden_size": 2,
           "intermediate_size": 2, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 2,
           "rope_theta": 10000.0, "sliding_window": window, "layer_types": ["sliding_attention", "full_attention"],
           "num_local_experts": 1, "num_experts_per_tok": 1}
    config = GptOssConfig.from_dict(raw)
    shapes = {"input_layernorm.weight": (2,), "post_attention_layernorm.weight": (2,), "self_attn.sinks": (1,),
              "mlp.router.weight": (1, 2), "mlp.router.bias": (1,), "mlp.experts.gate_up_proj": (1, 2, 4),
              "mlp.experts.gate_up_proj_bias": (1, 4), "mlp.experts.down_proj": (1, 2, 2),
              "mlp.experts.down_proj_bias": (1, 2)}
    shapes |= {f"self_attn.{p}_proj.{kind}": (2, 2) if kind == "weight" else (2,) for p in "qkvo"
               for kind in ("weight", "bias")}
    weights = {f"model.layers.{i}.{name}": torch.full(shape, sink) if name.endswith("sinks") else torch.zeros(shape)
               for i in range(2) for name, shape in shapes.items()}
    weights |= {"model.embed_tokens.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2),
                "lm_head.weight": torch.zeros(4, 2)}
    return GptOssReferenceModel(config, weights)


def test_sink_joins_the_denominator_and_the_window_is_positional() -> None:
    """Scores 0, 0 and ln 2 for keys at positions 3, 4, 5, a sink of logit 0, query at 5, window 2."""
    model = _unit_model(window=2, sink=0.0)
    q = torch.tensor([[[math.sqrt(2.0), 0.0]]])
    k = torch.tensor([[[0.0, 0.0]], [[0.0, 0.0]], [[math.log(2.0), 0.0]]])
    v = torch.tensor([[[9.0, 9.0]], [[1.0, 0.0]], [[0.0, 1.0]]])
    visible = torch.ones(1, 3, dtype=torch.bool)
    positions = (torch.tensor([5]), torch.tensor([3, 4, 5]))
    # Sliding layer: key 3 is not > 5 - 2; weights e^0 : e^ln2 over 1 + 2 + e^0 (the sink).
    sliding = model.attend_layer(0, q, k, v, visible, *positions)
    torch.testing.assert_close(sliding, torch.tensor([[1 / 4, 2 / 4]]))
    # Full layer: all three keys, denominator 1 + 1 + 2 + 1.
    full = model.attend_layer(1, q, k, v, visible, *positions)
    torch.testing.assert_close(full, torch.tensor([[9 / 5 + 1 / 5, 9 / 5 + 2 / 5]]))
    # A hidden key leaves the sink in place: only key 5 and the sink remain.
    only_last = model.attend_layer(1, q, k, v, torch.tensor([[False, False, True]]), *positions)
    torch.testing.assert_close(only_last, torch.tensor([[0.0, 2 / 3]]))
    with pytest.raises(ValueError, match="key_positions must be >= 0 on sliding layer 0"):
        model.attend_layer(0, q, k, v, visible, positions[0], torch.tensor([-1, -1, -1]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures must be"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config is not supported"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must list 4 of"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type must be 'yarn' or 'default'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 32.0}}, "original_max_position_embeddings must be an int"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_local_experts \(4\)"),
        ({"attention_bias": False}, "attention_bias must be true"),
    ],
)
def test_unsupported_configs_are_rejected_by_name(gpt_oss_dir: Path, change: dict, message: str) -> None:
    raw = json.loads((gpt_oss_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        GptOssConfig.from_dict({**raw, **change})
