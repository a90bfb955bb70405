"""With no events the oracle is an ordinary causal LM: it must agree with transformers' own forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from akv.system.reference.model import ConfigError, ModelConfig, ReferenceModel
from akv.system.reference.oracle import run_oracle


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama"])
def test_oracle_without_events_equals_transformers(tiny_dirs: dict[str, Path], name: str) -> None:
    ids = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(7))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)
    result = run_oracle(ReferenceModel.from_pretrained(tiny_dirs[name]), ids)
    assert result.log_probs().shape == expected.shape
    torch.testing.assert_close(result.log_probs(), expected, atol=1e-4, rtol=0)
    assert expected.exp().max() > 0.2, "random weights must give peaked, not uniform, predictions"


def test_transformers_kv_cache_keys_equal_oracle_keys_rotated_at_birth(qwen3_dir: Path, qwen3: ReferenceModel) -> None:
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(8))
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        cache = hf(ids[None], use_cache=True).past_key_values
    result = run_oracle(qwen3, ids)
    for layer in range(qwen3.config.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
        hf_v = cache.layers[layer].values[0].transpose(0, 1)
        torch.testing.assert_close(result.keys_at(qwen3, layer, torch.arange(20)), hf_k, atol=1e-5, rtol=0)
        torch.testing.assert_close(result.v[layer], hf_v, atol=1e-5, rtol=0)


def _config(qwen3_dir: Path) -> dict:
    return json.loads((qwen3_dir / "config.json").read_text())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}},
         "rope_parameters must use rope_type 'default'"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures must be one of"),
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu', got 'gelu'"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"vocab_size": "512"}, "vocab_size must be a positive int, got '512'"),
        ({"use_sliding_window": True}, "use_sliding_window is not supported"),
        ({"rope_theta": -1.0}, "rope_theta must be a positive number, got -1.0"),
    ],
)
def test_unsupported_configs_are_rejected_by_name(qwen3_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**_config(qwen3_dir), **change})


def test_default_rope_scaling_entries_are_accepted(qwen3_dir: Path) -> None:
    config = ModelConfig.from_dict({**_config(qwen3_dir), "rope_scaling": {"rope_type": "default"}})
    assert config.rope_theta == _config(qwen3_dir)["rope_theta"]
    nested = {k: v for k, v in _config(qwen3_dir).items() if k != "rope_theta"}
    nested["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    assert ModelConfig.from_dict(nested).rope_theta == 5000.0


def test_missing_weights_are_named(qwen3_dir: Path) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(qwen3_dir / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ConfigError, match="model.layers.1.self_attn.k_norm.weight"):
        ReferenceModel(ModelConfig.from_dict(_config(qwen3_dir)), weights)


def test_out_of_range_token_ids_are_rejected(qwen3: ReferenceModel) -> None:
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, 512\), got 512"):
        run_oracle(qwen3, [1, 2, 512])
