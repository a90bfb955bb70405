"""RoPE parameters a re-rotation needs, read from a model config, and the FP32 cos/sin table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from akv.system.reference import yarn as yarn_rope
from akv.system.reference.rope import cos_sin
from akv.system.reference.yarn import Yarn

_UNSCALED_ROPE_TYPES = (None, "default")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: ``theta``, rotated prefix ``rotary_dim`` of a ``head_dim`` head, NeoX (rotate
    halves) or GPT-J (rotate even/odd pairs) style, plain or with ``yarn`` frequencies. The angles are
    always unscaled: YaRN's ``mscale`` is already in the stored keys, and a re-rotation keeps it."""

    theta: float
    head_dim: int
    rotary_dim: int
    neox: bool = True
    yarn: Yarn | None = None

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError(f"RopeSpec.theta must be > 0, got {self.theta}")
        if self.head_dim <= 0:
            raise ValueError(f"RopeSpec.head_dim must be > 0, got {self.head_dim}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"RopeSpec.rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )

    @classmethod
    def from_config(cls, config: Any, *, neox: bool = True) -> RopeSpec:
        """Read a Hugging Face model config (object or ``config.json`` mapping). YaRN is read; other
        scaled RoPE variants (llama3, linear, dynamic, ...) are rejected: they need their own angles."""
        get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        params = get("rope_parameters") or {}
        scaling = get("rope_scaling")
        yarn = None
        for field, value in (("rope_parameters", params), ("rope_scaling", scaling)):
            rope_type = None if not value else value.get("rope_type", value.get("type"))
            if rope_type == "yarn":
                yarn = yarn or Yarn.from_parameters(value)
            elif rope_type not in _UNSCALED_ROPE_TYPES:
                raise ValueError(
                    f"config.{field} selects scaled RoPE {rope_type!r}; only unscaled RoPE and YaRN can be re-rotated"
                )
        theta = params.get("rope_theta", get("rope_theta"))
        if theta is None:
            raise ValueError("config has no rope_theta (neither top-level nor in rope_parameters)")
        head_dim = get("head_dim") or get("hidden_size") // get("num_attention_heads")
        factor = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
        # MiniMax-M2 configs name ``rotary_dim``, which SGLang honours (transformers reads only the factor).
        rotary_dim = get("rotary_dim") or int(head_dim * factor)
        return cls(theta=float(theta), head_dim=int(head_dim), rotary_dim=int(rotary_dim), neox=neox, yarn=yarn)

    def cos_sin_table(self, max_position: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """FP32 ``[max_position, rotary_dim]`` table ``cat(cos, sin)`` of the reference angles (the layout
        of SGLang's ``RotaryEmbedding.cos_sin_cache``)."""
        if max_position <= 0:
            raise ValueError(f"max_position must be > 0, got {max_position}")
        positions = torch.arange(max_position, dtype=torch.int64)
        if self.yarn is None:
            cos, sin = cos_sin(positions, self.rotary_dim, self.theta)
        else:
            cos, sin = yarn_rope.cos_sin(positions, self.yarn.inv_frequencies(self.rotary_dim, self.theta))
        return torch.cat((cos, sin), dim=-1).to(device)


@dataclass(frozen=True)
class RopeTable:
    """A ``RopeSpec`` with its FP32 ``[max_position, rotary_dim]`` cos|sin table on the kernel's device."""

    spec: RopeSpec
    table: torch.Tensor

    def __post_init__(self) -> None:
        if self.table.dtype != torch.float32:
            raise ValueError(f"RopeTable.table must be float32, got {self.table.dtype}")
        if self.table.dim() != 2 or self.table.shape[1] != self.spec.rotary_dim or self.table.stride(1) != 1:
            raise ValueError(
                f"RopeTable.table must be [max_position, rotary_dim={self.spec.rotary_dim}] with a contiguous "
                f"last dimension, got shape {tuple(self.table.shape)} strides {self.table.stride()}"
            )

    @classmethod
    def build(cls, spec: RopeSpec, max_position: int, device: torch.device | str = "cpu") -> RopeTable:
        """Table of the reference angles (``akv.system.reference.rope``) for positions ``< max_position``."""
        return cls(spec=spec, table=spec.cos_sin_table(max_position, device))

    @classmethod
    def from_sglang(cls, rotary_emb: Any) -> RopeTable:
        """Reuse an SGLang ``RotaryEmbedding``'s own ``cos_sin_cache``, so re-rotated keys match the keys
        that model computes. A ``YaRNScalingRotaryEmbedding``'s cache holds ``mscale * cos|sin``; it is
        divided by ``mscale`` (re-rotating with it would scale keys by mscale²). Other subclasses (the
        other scaled variants) are rejected."""
        kind = type(rotary_emb).__name__
        if kind == "YaRNScalingRotaryEmbedding":
            return cls._from_sglang_yarn(rotary_emb)
        if kind != "RotaryEmbedding":
            raise ValueError(f"rotary_emb is a {kind}; only the unscaled RotaryEmbedding and YaRN can be re-rotated")
        spec = RopeSpec(
            theta=float(rotary_emb.base),
            head_dim=int(rotary_emb.head_size),
            rotary_dim=int(rotary_emb.rotary_dim),
            neox=bool(rotary_emb.is_neox_style),
        )
        return cls(spec=spec, table=rotary_emb.cos_sin_cache)

    @classmethod
    def _from_sglang_yarn(cls, rotary_emb: Any) -> RopeTable:
        if float(rotary_emb.extrapolation_factor) != 1.0:
            raise ValueError(f"rotary_emb.extrapolation_factor must be 1, got {rotary_emb.extrapolation_factor!r}")
        yarn = Yarn(
            factor=float(rotary_emb.scaling_factor),
            original_max_position_embeddings=int(rotary_emb.max_position_embeddings),
            beta_fast=float(rotary_emb.beta_fast),
            beta_slow=float(rotary_emb.beta_slow),
            truncate=bool(rotary_emb.truncate),
            attention_factor=float(rotary_emb.mscale),
        )
        spec = RopeSpec(
            theta=float(rotary_emb.base),
            head_dim=int(rotary_emb.head_size),
            rotary_dim=int(rotary_emb.rotary_dim),
            neox=bool(rotary_emb.is_neox_style),
            yarn=yarn,
        )
        table = (rotary_emb.cos_sin_cache.to(torch.float64) / yarn.mscale).to(torch.float32)
        return cls(spec=spec, table=table)

    @property
    def max_position(self) -> int:
        return int(self.table.shape[0])
