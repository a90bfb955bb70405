"""YaRN rotary embedding (gpt-oss): per-dimension frequencies blended between interpolation and
extrapolation, and an attention factor ``mscale`` that multiplies cos and sin on queries and keys.

The angle stays ``position * inv_freq``, so a key ``m R(p) k`` is re-rotated exactly by the
*unscaled* ``R(p') R(p)^-1``; using the scaled cos/sin for both rotations would multiply it by m².
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from akv.system.reference.rope import apply_rotation


@dataclass(frozen=True)
class Yarn:
    """The ``rope_type: yarn`` parameters, with transformers' and SGLang's defaults."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise ValueError(f"Yarn.factor must be > 1, got {self.factor!r}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"Yarn.original_max_position_embeddings must be > 0, "
                             f"got {self.original_max_position_embeddings!r}")
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"Yarn.beta_fast must exceed beta_slow > 0, got {self.beta_fast!r}, {self.beta_slow!r}")

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> Yarn:
        """Read a ``rope_scaling`` / ``rope_parameters`` mapping whose ``rope_type`` is ``yarn``."""
        kind = params.get("rope_type", params.get("type"))
        if kind != "yarn":
            raise ValueError(f"rope_type must be 'yarn', got {kind!r}")
        for key in ("mscale", "mscale_all_dim"):
            if params.get(key):
                raise ValueError(f"yarn {key} is not supported (DeepSeek-style YaRN), got {params[key]!r}")
        original = params.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int):
            raise ValueError(f"yarn original_max_position_embeddings must be an int, got {original!r}")
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
            raise ValueError(f"yarn factor must be a number, got {factor!r}")
        attention = params.get("attention_factor")
        return cls(
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            attention_factor=None if attention is None else float(attention),
        )

    @property
    def mscale(self) -> float:
        """The factor on cos and sin: ``attention_factor``, else ``0.1 ln(factor) + 1``."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0

    def inv_frequencies(self, rotary_dim: int, theta: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[rotary_dim / 2]`` frequencies, computed in float64 and returned in ``dtype``."""
        if rotary_dim % 2 or rotary_dim <= 0:
            raise ValueError(f"rotary_dim must be even and > 0, got {rotary_dim}")
        low, high = self._correction_range(rotary_dim, theta)
        if low == high:
            high += 0.001
        half = rotary_dim // 2
        ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
        extrapolation = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
        interpolation = extrapolation / self.factor
        extrapolated = 1.0 - ramp
        return (interpolation * (1.0 - extrapolated) + extrapolation * extrapolated).to(dtype)

    def _correction_range(self, rotary_dim: int, theta: float) -> tuple[float, float]:
        def dim_of(rotations: float) -> float:
            return (rotary_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(theta)))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, rotary_dim - 1)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscaled cos/sin of the angles ``position * inv_freq`` (taken in float64), ``[*positions.shape, len]``."""
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float64)
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scale: float = 1.0,
    neox: bool = True,
) -> torch.Tensor:
    """``scale * R(positions) x`` for ``x[..., tokens, heads, head_dim]``; the first ``2 * len(inv_freq)``
    features rotate (and are scaled), the rest pass through. Angles are taken in float64; the result
    is float64 for float64 ``x``, else float32."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    rotary_dim = 2 * int(inv_freq.shape[0])
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"inv_freq covers {rotary_dim} features, more than head_dim {x.shape[-1]}")
    cos, sin = cos_sin(positions.to(x.device), inv_freq, work)
    return apply_rotation(x.to(work), (cos * scale)[..., None, :], (sin * scale)[..., None, :], neox=neox)


def rerotate(
    k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor, inv_freq: torch.Tensor, *,
    neox: bool = True,
) -> torch.Tensor:
    """``R(new) R(old)^-1 k`` with unscaled angles: a key stored as ``m R(old) k0`` becomes ``m R(new) k0``."""
    unrotated = rotate(k, -old_positions.to(torch.int64), inv_freq, neox=neox)
    return rotate(unrotated, new_positions, inv_freq, neox=neox)
