"""Reading RoPE parameters from model configs, refusing scaled RoPE, and the cos|sin table."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config

from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from akv.system.reference.yarn import Yarn


def test_qwen3_config_object_and_json_mapping():
    config = Qwen3Config(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    assert RopeSpec.from_config(config) == RopeSpec(theta=1e6, head_dim=128, rotary_dim=128, neox=True)
    legacy_json = {"rope_theta": 5e5, "hidden_size": 512, "num_attention_heads": 8, "rope_scaling": None,
                   "partial_rotary_factor": 0.5}
    assert RopeSpec.from_config(legacy_json, neox=False) == RopeSpec(theta=5e5, head_dim=64, rotary_dim=32, neox=False)


@pytest.mark.parametrize(
    ("config", "field", "kind"),
    [
        ({"rope_theta": 1e4, "head_dim": 64, "rope_scaling": {"type": "linear", "factor": 4.0}}, "rope_scaling",
         "linear"),
        ({"head_dim": 64, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters", "llama3"),
    ],
)
def test_scaled_rope_is_rejected(config, field, kind):
    with pytest.raises(ValueError, match=f"config.{field} selects scaled RoPE '{kind}'"):
        RopeSpec.from_config(config)


def test_yarn_from_transformers_is_read():
    config = Qwen3Config(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert RopeSpec.from_config(config).yarn == Yarn(factor=4.0, original_max_position_embeddings=32768)


def test_bad_spec_fields():
    with pytest.raises(ValueError, match="rotary_dim must be even and in \\(0, head_dim=8\\], got 9"):
        RopeSpec(theta=1e4, head_dim=8, rotary_dim=9)
    with pytest.raises(ValueError, match="theta must be > 0, got 0"):
        RopeSpec(theta=0, head_dim=8, rotary_dim=8)
    with pytest.raises(ValueError, match="no rope_theta"):
        RopeSpec.from_config({"head_dim": 8})


def test_table_holds_cos_then_sin_of_position_times_frequency():
    spec = RopeSpec(theta=10000.0, head_dim=8, rotary_dim=6)
    table = RopeTable.build(spec, 50).table
    for position in (0, 1, 49):
        for i in range(3):
            angle = position * 10000.0 ** (-2 * i / 6)
            assert table[position, i].item() == pytest.approx(math.cos(angle), abs=1e-7)
            assert table[position, 3 + i].item() == pytest.approx(math.sin(angle), abs=1e-7)
    assert table.shape == (50, 6) and table.dtype == torch.float32


class RotaryEmbedding:
    """Stands in for SGLang's unscaled rotary module (same attribute names)."""

    def __init__(self, cache: torch.Tensor) -> None:
        self.base, self.head_size, self.rotary_dim, self.is_neox_style = 10000, 8, 8, True
        self.cos_sin_cache = cache


class DynamicNTKScalingRotaryEmbedding(RotaryEmbedding):
    pass


def test_sglang_rotary_module_table_is_reused_and_scaled_modules_refused():
    cache = torch.rand(20, 8)
    rope = RopeTable.from_sglang(RotaryEmbedding(cache))
    assert rope.table is cache and rope.spec == RopeSpec(theta=10000.0, head_dim=8, rotary_dim=8, neox=True)
    with pytest.raises(ValueError, match="rotary_emb is a DynamicNTKScalingRotaryEmbedding"):
        RopeTable.from_sglang(DynamicNTKScalingRotaryEmbedding(cache))
