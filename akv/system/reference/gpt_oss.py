"""gpt-oss as a plain PyTorch decoder, layer piece by layer piece, for the oracle (same interface as
:class:`akv.system.reference.model.ReferenceModel`).

What differs from the Qwen/Llama reference: q/k/v/o biases; YaRN RoPE whose ``mscale`` multiplies
cos and sin on queries and keys (a stored key is ``m R(p) k``); one learned *sink* logit per query
head that joins the softmax denominator and belongs to no token, so no drop can remove it; sliding
window layers; an MoE block (softmax over the top-k router logits, clamped SwiGLU experts).

Sliding-window contract: on a sliding layer a query at position ``p`` reads the visible keys whose
*current* position is greater than ``p - sliding_window``. Without events this is transformers' and
SGLang's window; after a reposition it is the last ``sliding_window`` visible keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from akv.system.reference.model import ConfigError, ReferenceModel
from akv.system.reference.rope import inv_frequencies
from akv.system.reference.yarn import Yarn, rerotate, rotate

LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU_ALPHA = 1.702


@dataclass(frozen=True)
class GptOssConfig:
    """What the reference needs from a gpt-oss config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    yarn: Yarn | None
    sliding_window: int
    layer_types: tuple[str, ...]
    num_experts: int
    experts_per_token: int
    swiglu_limit: float
    tie_word_embeddings: bool = False

    @property
    def arch(self) -> str:
        return "gpt_oss"

    @property
    def qk_norm(self) -> bool:
        """gpt-oss has no q/k RMSNorm (its projections have biases instead)."""
        return False

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GptOssConfig:
        """Validate a gpt-oss config dict; unsupported features raise ``ConfigError`` naming the field."""
        if raw.get("architectures") != ["GptOssForCausalLM"]:
            raise ConfigError(f"architectures must be ['GptOssForCausalLM'], got {raw.get('architectures')!r}")
        if raw.get("quantization_config"):
            raise ConfigError(f"quantization_config is not supported (unquantized weights only), "
                              f"got {raw['quantization_config']!r}")
        if raw.get("attention_bias", True) is not True:
            raise ConfigError(f"attention_bias must be true, got {raw['attention_bias']!r}")
        num_layers = _positive_int(raw, "num_hidden_layers")
        layer_types = tuple(raw.get("layer_types") or ())
        if len(layer_types) != num_layers or any(t not in LAYER_TYPES for t in layer_types):
            raise ConfigError(f"layer_types must list {num_layers} of {LAYER_TYPES}, got {raw.get('layer_types')!r}")
        num_heads, num_kv_heads = _positive_int(raw, "num_attention_heads"), _positive_int(raw, "num_key_value_heads")
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_attention_heads ({num_heads}) must be a multiple of "
                              f"num_key_value_heads ({num_kv_heads})")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", rope.get("rope_theta"))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ConfigError(f"rope_type must be 'yarn' or 'default', got {kind!r}")
        try:
            yarn = Yarn.from_parameters(rope) if kind == "yarn" else None
        except ValueError as exc:
            raise ConfigError(f"rope_scaling: {exc}") from exc
        experts = _positive_int(raw, "num_local_experts")
        top_k = _positive_int(raw, "num_experts_per_tok")
        if top_k > experts:
            raise ConfigError(f"num_experts_per_tok ({top_k}) exceeds num_local_experts ({experts})")
        limit = raw.get("swiglu_limit", 7.0)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
            raise ConfigError(f"swiglu_limit must be a positive number, got {limit!r}")
        return cls(
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=_positive_int(raw, "hidden_size"),
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_positive_int(raw, "head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta),
            yarn=yarn,
            sliding_window=_positive_int(raw, "sliding_window"),
            layer_types=layer_types,
            num_experts=experts,
            experts_per_token=top_k,
            swiglu_limit=float(limit),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


def _positive_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


class GptOssReferenceModel(ReferenceModel):
    """Weights plus the per-layer pieces of the gpt-oss forward pass, computed in ``dtype``."""

    config: GptOssConfig
    config_type = GptOssConfig

    def __init__(self, config: GptOssConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__(config, weights, dtype, device)
        yarn = config.yarn
        self.inv_freq = (yarn.inv_frequencies(config.head_dim, config.rope_theta) if yarn is not None else
                         inv_frequencies(config.head_dim, config.rope_theta))
        self.mscale = yarn.mscale if yarn is not None else 1.0

    def _expected_names(self) -> list[str]:
        c = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks",
                     "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj",
                     "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj", "mlp.experts.down_proj_bias"]
        per_layer += [f"self_attn.{p}_proj.{kind}" for p in "qkvo" for kind in ("weight", "bias")]
        return names + [f"model.layers.{i}.{n}" for i in range(c.num_layers) for n in per_layer]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``mscale * R(positions) x`` with the YaRN frequencies (NeoX halves), as the cache stores keys."""
        return rotate(x, positions, self.inv_freq, scale=self.mscale, neox=True).to(self.dtype)

    def rerotate_keys(self, k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """``R(new) R(old)^-1 k`` with unscaled angles: a stored ``m R(old) k0`` becomes ``m R(new) k0``."""
        return rerotate(k, old_positions, new_positions, self.inv_freq, neox=True)

    def attend_layer(
        self,
        layer: int,
        q_rot: torch.Tensor,
        k_rot: torch.Tensor,
        v: torch.Tensor,
        visible: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of ``layer``'s queries ``[n, heads, d]`` over keys/values ``[m, kv_heads, d]`` where
        ``visible[n, m]`` holds, narrowed on a sliding layer to keys whose position is greater than
        ``query position - sliding_window``; the head's sink logit joins every softmax denominator."""
        n, m = q_rot.shape[0], k_rot.shape[0]
        if visible.shape != (n, m):
            raise ValueError(f"visible must have shape {(n, m)}, got {tuple(visible.shape)}")
        if query_positions.shape != (n,) or key_positions.shape != (m,):
            raise ValueError(f"positions must have shapes ({n},) and ({m},), got "
                             f"{tuple(query_positions.shape)} and {tuple(key_positions.shape)}")
        window = self.config.window(layer)
        if window is not None:
            if bool((key_positions < 0).any()):
                raise ValueError(f"key_positions must be >= 0 on sliding layer {layer} (each key's position "
                                 f"decides whether it is in the window), got {int(key_positions.min())}")
            visible = visible & (key_positions[None, :] > query_positions[:, None] - window)
        empty = ~visible.any(dim=1)
        if bool(empty.any()):
            raise ValueError(f"query {int(empty.nonzero()[0])} sees no key")
        group = self.config.num_heads // self.config.num_kv_heads
        k = k_rot.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q_rot, k) * self.config.head_dim**-0.5
        scores = scores.masked_fill(~visible[None], float("-inf"))
        sinks = self._w[f"model.layers.{layer}.self_attn.sinks"].view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :m]
        return torch.einsum("hnm,mhd->nhd", probs, v).reshape(n, -1)

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The MoE block: each token: softmax over its top-k router logits weights the chosen experts' outputs."""
        c, p = self.config, f"model.layers.{layer}.mlp."
        logits = self._linear(x, p + "router")
        top_values, top_experts = torch.topk(logits, c.experts_per_token, dim=-1)
        weights = torch.softmax(top_values, dim=-1)
        gate_up_w, gate_up_b = self._w[p + "experts.gate_up_proj"], self._w[p + "experts.gate_up_proj_bias"]
        down_w, down_b = self._w[p + "experts.down_proj"], self._w[p + "experts.down_proj_bias"]
        out = torch.zeros_like(x)
        for expert in range(c.num_experts):
            token, slot = (top_experts == expert).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate_up = x[token] @ gate_up_w[expert] + gate_up_b[expert]
            gate = gate_up[:, 0::2].clamp(max=c.swiglu_limit)
            up = gate_up[:, 1::2].clamp(-c.swiglu_limit, c.swiglu_limit)
            activated = (up + 1) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)
            expert_out = activated @ down_w[expert] + down_b[expert]
            out.index_add_(0, token, expert_out * weights[token, slot, None])
        return out
