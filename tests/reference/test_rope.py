"""RoPE: the rotation is the complex-number formula, and re-rotating stored keys is exact in FP32."""

from __future__ import annotations

import math

import pytest
import torch

from akv.system.reference.model import ReferenceModel
from akv.system.reference.oracle import Drop, Repos, run_oracle
from akv.system.reference.rope import rerotate, rotate


def _complex_rotation(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox layout: feature ``i`` and ``i + d/2`` form the complex number turned by ``pos * theta^(-2i/d)``,
    the frequency rounded to float32 as in HF's ``inv_freq`` buffer."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for i in range(half):
            frequency = torch.tensor(theta ** (-2 * i / x.shape[-1]), dtype=torch.float32).item()
            angle = positions[t].item() * frequency
            z = torch.complex(x[t, ..., i].double(), x[t, ..., i + half].double())
            z = z * complex(math.cos(angle), math.sin(angle))
            out[t, ..., i], out[t, ..., i + half] = z.real, z.imag
    return out


def test_rotate_is_the_complex_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 8, generator=gen)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    expected = _complex_rotation(x, positions, 10000.0)
    torch.testing.assert_close(rotate(x, positions, theta=10000.0).double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(rotate(x, torch.zeros(5, dtype=torch.int64), theta=10000.0), x)


@pytest.mark.parametrize("theta", [10000.0, 1_000_000.0])
def test_rerotation_equals_rotation_at_the_new_position(theta: float) -> None:
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(64, 2, 128, generator=gen)
    old = torch.randint(0, 32768, (64,), generator=gen)
    new = torch.randint(0, 32768, (64,), generator=gen)
    stored = rotate(raw, old, theta=theta)
    moved = rerotate(stored, old, new, theta=theta)
    torch.testing.assert_close(moved, rotate(raw, new, theta=theta), atol=2e-6, rtol=0)
    assert (moved - stored).abs().max() > 0.1, "positions moved, so the keys must change"


def test_cached_keys_rerotated_after_repos_equal_keys_at_the_new_positions(qwen3: ReferenceModel) -> None:
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(2))
    result = run_oracle(qwen3, ids, [Drop(at=20, tokens=tuple(range(3, 11))), Repos(at=20)])
    layout = result.layout
    survivors = layout.keep[:20].nonzero().flatten()
    assert layout.final_position[survivors].tolist() == list(range(12))
    for layer in range(qwen3.config.num_layers):
        stored = result.keys_at(qwen3, layer, layout.birth_position)[survivors]
        moved = rerotate(stored, layout.birth_position[survivors], layout.final_position[survivors],
                         theta=qwen3.config.rope_theta)
        direct = result.keys_at(qwen3, layer, layout.final_position.clamp(min=0))[survivors]
        torch.testing.assert_close(moved, direct, atol=1e-6, rtol=0)
