"""The MiniMax-M2 decoder for the oracle: RMSNorm over all q (and all k) heads at once before RoPE,
partial NeoX RoPE on the first ``rotary_dim`` dims of each head, and a sigmoid-routed MoE with a
routing bias that only chooses experts (weights are the unbiased scores, renormalised)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from akv.system.models.minimax_m2 import ARCHITECTURE, UnsupportedMiniMaxError, check_supported
from akv.system.reference.model import AttentionInputs, ConfigError, ModelConfig, ReferenceModel
from akv.system.reference.rope import rerotate, rotate


@dataclass(frozen=True)
class MiniMaxM2Config(ModelConfig):
    """``ModelConfig`` plus the rotated prefix of each head and the MoE routing shape
    (``intermediate_size`` is one expert's)."""

    rotary_dim: int
    num_experts: int
    top_k: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MiniMaxM2Config:
        """Validate an official-style MiniMax-M2 config.json; other MiniMax variants raise ``ConfigError``."""
        try:
            check_supported(raw)
        except UnsupportedMiniMaxError as exc:
            raise ConfigError(str(exc)) from exc
        if raw.get("architectures") != [ARCHITECTURE]:
            raise ConfigError(f"architectures must be [{ARCHITECTURE!r}], got {raw.get('architectures')!r}")
        expected = {"hidden_act": "silu", "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                    "use_routing_bias": True, "shared_intermediate_size": 0, "tie_word_embeddings": False}
        for name, value in expected.items():
            if raw.get(name, value) != value:
                raise ConfigError(f"{name} must be {value!r}, got {raw[name]!r}")
        heads, kv_heads = _positive(raw, "num_attention_heads"), _positive(raw, "num_key_value_heads")
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        head_dim = _positive(raw, "head_dim")
        experts, top_k = _positive(raw, "num_local_experts"), _positive(raw, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok ({top_k}) exceeds num_local_experts ({experts})")
        return cls(
            arch="minimax_m2",
            vocab_size=_positive(raw, "vocab_size"),
            hidden_size=_positive(raw, "hidden_size"),
            intermediate_size=_positive(raw, "intermediate_size"),
            num_layers=_positive(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            tie_word_embeddings=False,
            rotary_dim=_rotary_dim(raw, head_dim),
            num_experts=experts,
            top_k=top_k,
        )


def _positive(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _rope_theta(raw: dict[str, Any]) -> float:
    scaling = raw.get("rope_scaling")
    if scaling and (not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "default"):
        raise ConfigError(f"rope_scaling is not supported (plain RoPE only), got {scaling!r}")
    parameters = raw.get("rope_parameters") or {}
    if parameters and parameters.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters must use rope_type 'default', got {parameters!r}")
    theta = raw.get("rope_theta", parameters.get("rope_theta"))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int:
    """``rotary_dim`` (what SGLang rotates); a ``partial_rotary_factor`` (what transformers rotates)
    must agree with it."""
    factor = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if raw.get("rotary_dim") is None:
        if factor is None:
            raise ConfigError("rotary_dim is missing (and no partial_rotary_factor)")
        rotary_dim = int(head_dim * factor)
    else:
        rotary_dim = _positive(raw, "rotary_dim")
        if factor is not None and int(head_dim * factor) != rotary_dim:
            raise ConfigError(f"partial_rotary_factor {factor!r} rotates {int(head_dim * factor)} dims of head_dim "
                              f"{head_dim}, but rotary_dim is {rotary_dim}: transformers and SGLang would disagree")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    return rotary_dim


class MiniMaxM2Model(ReferenceModel):
    """``ReferenceModel`` with MiniMax-M2's per-layer QK norm, partial RoPE and MoE."""

    config: MiniMaxM2Config
    config_type = MiniMaxM2Config

    def _expected_names(self) -> list[str]:
        c = self.config
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "block_sparse_moe.gate.weight",
                     "block_sparse_moe.e_score_correction_bias"]
        per_layer += [f"block_sparse_moe.experts.{e}.{w}.weight"
                      for e in range(c.num_experts) for w in ("w1", "w2", "w3")]
        names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        return names + [f"model.layers.{i}.{n}" for i in range(c.num_layers) for n in per_layer]

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        """Projections of ``hidden``; q and k are each RMS-normalised over all their heads, then split."""
        c, p = self.config, f"model.layers.{layer}."
        x = self._rms_norm(hidden, p + "input_layernorm.weight")
        q = self._rms_norm(self._linear(x, p + "self_attn.q_proj"), p + "self_attn.q_norm.weight")
        k = self._rms_norm(self._linear(x, p + "self_attn.k_proj"), p + "self_attn.k_norm.weight")
        v = self._linear(x, p + "self_attn.v_proj")
        return AttentionInputs(q=q.view(-1, c.num_heads, c.head_dim), k=k.view(-1, c.num_kv_heads, c.head_dim),
                               v=v.view(-1, c.num_kv_heads, c.head_dim))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """NeoX RoPE of the first ``rotary_dim`` dims of each head; the rest pass through unchanged."""
        c = self.config
        return rotate(x, positions, theta=c.rope_theta, rotary_dim=c.rotary_dim, neox=True).to(self.dtype)

    def rerotate_keys(self, k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """``R(new) R(old)^-1`` on the first ``rotary_dim`` dims in FP32; the rest is returned unchanged."""
        c = self.config
        return rerotate(k, old_positions, new_positions, theta=c.rope_theta, rotary_dim=c.rotary_dim, neox=True)

    def routing_scores(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 ``sigmoid(gate x)`` per row and expert, and the same plus the routing bias (what chooses)."""
        p = f"model.layers.{layer}.block_sparse_moe."
        scores = torch.sigmoid(torch.nn.functional.linear(x, self._w[p + "gate.weight"]).to(torch.float32))
        return scores, scores + self._w[p + "e_score_correction_bias"].to(torch.float32)

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts by ``sigmoid(gate x) + bias`` and their weights ``sigmoid / sum`` (bias excluded)."""
        scores, biased = self.routing_scores(layer, x)
        chosen = torch.topk(biased, self.config.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        return chosen, (weights / weights.sum(dim=-1, keepdim=True)).to(self.dtype)

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The routed MoE block of ``layer``."""
        chosen, weights = self.route(layer, x)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            e = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
            h = x[rows]
            y = self._linear(torch.nn.functional.silu(self._linear(h, e + "w1")) * self._linear(h, e + "w3"), e + "w2")
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out
