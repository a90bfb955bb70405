"""YaRN (gpt-oss) re-rotation: exact with unscaled angles, keys keep their norm, and SGLang's scaled
``cos_sin_cache`` is turned into the unscaled table (reusing it as is scales keys by mscale²)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from akv.system.kernels.layer_buffers import LayerBuffers
from akv.system.kernels.rerotate import rerotate_kv
from akv.system.kernels.rerotate_reference import rerotate_kv_reference
from akv.system.kernels.rope_spec import RopeSpec, RopeTable
from akv.system.reference import yarn
from akv.system.reference.yarn import Yarn

GPT_OSS_YARN = Yarn(factor=32.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
MSCALE = 0.1 * math.log(32.0) + 1.0


def _keys_and_positions(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(n, 2, 64, generator=gen, dtype=torch.float64)
    old = torch.randint(0, 131072, (n,), generator=gen)
    new = torch.randint(0, 131072, (n,), generator=gen)
    return raw, old, new


def test_spec_from_the_gpt_oss_config_has_transformers_frequencies_and_factor() -> None:
    config = GptOssConfig()
    spec = RopeSpec.from_config(config)
    assert spec == RopeSpec(theta=150000.0, head_dim=64, rotary_dim=64, neox=True, yarn=GPT_OSS_YARN)
    config_json = {"head_dim": 64, "rope_theta": 150000, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
        "rope_type": "yarn", "truncate": False}}
    assert RopeSpec.from_config(config_json) == spec
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None)
    torch.testing.assert_close(GPT_OSS_YARN.inv_frequencies(64, 150000.0), inv_freq, rtol=2e-7, atol=0)
    assert GPT_OSS_YARN.mscale == attention_factor == pytest.approx(MSCALE, abs=1e-15)


def test_rerotation_with_unscaled_angles_equals_direct_rotation_in_fp64() -> None:
    """A stored key m R(p) k re-rotated by R(p') R(p)^-1 is m R(p') k, and keeps its norm."""
    inv_freq = GPT_OSS_YARN.inv_frequencies(64, 150000.0, dtype=torch.float64)
    raw, old, new = _keys_and_positions(1000, seed=1)
    stored = yarn.rotate(raw, old, inv_freq, scale=MSCALE)
    moved = yarn.rerotate(stored, old, new, inv_freq)
    direct = yarn.rotate(raw, new, inv_freq, scale=MSCALE)
    assert moved.dtype == torch.float64
    assert float((moved - direct).abs().max()) < 1e-12
    norms = moved.norm(dim=-1) / stored.norm(dim=-1)
    assert float((norms - 1.0).abs().max()) < 1e-12
    assert float((stored.norm(dim=-1) / raw.norm(dim=-1) - MSCALE).abs().max()) < 1e-12


def test_reusing_the_scaled_angles_for_both_rotations_scales_keys_by_mscale_squared() -> None:
    """The failure from_sglang prevents: R(p)^-1 and R(p') both carrying mscale."""
    inv_freq = GPT_OSS_YARN.inv_frequencies(64, 150000.0, dtype=torch.float64)
    raw, old, new = _keys_and_positions(50, seed=2)
    stored = yarn.rotate(raw, old, inv_freq, scale=MSCALE)
    wrong = yarn.rotate(yarn.rotate(stored, -old, inv_freq, scale=MSCALE), new, inv_freq, scale=MSCALE)
    ratio = wrong.norm(dim=-1) / stored.norm(dim=-1)
    torch.testing.assert_close(ratio, torch.full_like(ratio, MSCALE**2), atol=1e-12, rtol=0)


class YaRNScalingRotaryEmbedding:
    """Stands in for SGLang's YaRN module: same attributes, cache built as its
    ``_compute_cos_sin_cache`` does (float32 angles, cos and sin times mscale)."""

    def __init__(self, max_position: int) -> None:
        self.head_size, self.rotary_dim, self.base, self.is_neox_style = 64, 64, 150000, True
        self.max_position_embeddings, self.scaling_factor = 4096, 32.0
        self.beta_fast, self.beta_slow, self.truncate, self.extrapolation_factor = 32, 1, False, 1
        self.mscale = float(0.1 * math.log(32.0) + 1.0)
        inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(), None)
        freqs = torch.einsum("i,j -> ij", torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.cos_sin_cache = torch.cat((freqs.cos() * self.mscale, freqs.sin() * self.mscale), dim=-1)


def test_sglang_yarn_table_is_divided_by_mscale() -> None:
    module = YaRNScalingRotaryEmbedding(4096)
    rope = RopeTable.from_sglang(module)
    assert rope.spec == RopeSpec(theta=150000.0, head_dim=64, rotary_dim=64, neox=True,
                                 yarn=Yarn(32.0, 4096, 32.0, 1.0, truncate=False, attention_factor=MSCALE))
    cos, sin = rope.table[:, :32], rope.table[:, 32:]
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), atol=1e-6, rtol=0)
    scaled = module.cos_sin_cache[:, :32] ** 2 + module.cos_sin_cache[:, 32:] ** 2
    torch.testing.assert_close(scaled, torch.full_like(scaled, MSCALE**2), atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.table[:64], RopeTable.build(rope.spec, 64).table, atol=1e-5, rtol=0)
    module.extrapolation_factor = 2
    with pytest.raises(ValueError, match="extrapolation_factor must be 1, got 2"):
        RopeTable.from_sglang(module)


def test_kernel_rerotates_gpt_oss_keys_to_their_new_positions(device: torch.device) -> None:
    """Keys as the cache stores them (m R(p) k, fp32) re-rotated by the Triton kernel and by the
    PyTorch reference equal the keys rotated straight to the new positions, norms unchanged."""
    spec = RopeSpec(theta=150000.0, head_dim=64, rotary_dim=64, neox=True, yarn=GPT_OSS_YARN)
    inv_freq = GPT_OSS_YARN.inv_frequencies(64, 150000.0)
    raw = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(3))
    old = torch.tensor([131071, 50000, 17, 0, 99999, 4095])
    new = torch.tensor([0, 49999, 40000, 131000, 3, 4095])
    stored = yarn.rotate(raw, old, inv_freq, scale=MSCALE)
    expected = yarn.rotate(raw, new, inv_freq, scale=MSCALE)
    rope = RopeTable.build(spec, 131072, device)
    for run in ("kernel", "reference"):
        k = torch.zeros(12, 2, 64)
        k[:6] = stored
        k, v = k.to(device), torch.zeros(12, 2, 64, device=device)
        args = (LayerBuffers.of([k]), LayerBuffers.of([v]), torch.arange(6, device=device),
                torch.arange(6, 12, device=device), old.to(device), new.to(device))
        if run == "kernel":
            rerotate_kv(*args, rope)
        else:
            rerotate_kv_reference(*args, spec)
        torch.testing.assert_close(k[6:12].cpu(), expected, atol=2e-5, rtol=0)
        torch.testing.assert_close(k[6:12].norm(dim=-1).cpu(), stored.norm(dim=-1), atol=2e-5, rtol=0)
