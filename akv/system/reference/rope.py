"""Rotary position embedding, the plain FP32 formula every kernel and the oracle agree with."""

from __future__ import annotations

import torch


def inv_frequencies(rotary_dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / rotary_dim)`` for ``i < rotary_dim / 2``, float32."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    return (theta ** (-exponents)).to(torch.float32)


def cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles ``position * inv_freq`` as float32 cos/sin of shape ``[*positions.shape, rotary_dim // 2]``."""
    inv_freq = inv_frequencies(rotary_dim, theta).to(device=positions.device, dtype=torch.float64)
    angles = positions.to(torch.float64)[..., None] * inv_freq
    return torch.cos(angles).to(torch.float32), torch.sin(angles).to(torch.float32)


def rotate(
    x: torch.Tensor,
    positions: torch.Tensor,
    *,
    theta: float,
    rotary_dim: int | None = None,
    neox: bool = True,
) -> torch.Tensor:
    """Rotate ``x[..., tokens, heads, head_dim]`` to ``positions[tokens]`` in FP32 (negative positions
    rotate backwards), on ``x``'s device. Only the first ``rotary_dim`` features rotate; the rest pass through."""
    head_dim = x.shape[-1]
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    cos, sin = cos_sin(positions.to(x.device), rotary_dim, theta)
    return apply_rotation(x.to(torch.float32), cos[..., None, :], sin[..., None, :], neox=neox)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, neox: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of ``x`` by the given per-pair cos/sin (already
    broadcastable over heads; NeoX halves or GPT-J interleaved pairs); the rest pass through."""
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if neox:
        a, b = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


def rerotate(
    k: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    *,
    theta: float,
    rotary_dim: int | None = None,
    neox: bool = True,
) -> torch.Tensor:
    """``R(new) R(old)^-1 k`` in FP32: a key stored rotated at ``old`` becomes the key at ``new``."""
    unrotated = rotate(k, -old_positions.to(torch.int64), theta=theta, rotary_dim=rotary_dim, neox=neox)
    return rotate(unrotated, new_positions, theta=theta, rotary_dim=rotary_dim, neox=neox)
