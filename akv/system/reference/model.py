"""A plain PyTorch decoder (Qwen3, Qwen2 and Llama layouts) exposed layer piece by layer piece, so the
oracle and the paged forward can schedule attention themselves."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from akv.system.reference.rope import rerotate, rotate

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}


class ConfigError(ValueError):
    """config.json or the weights describe a model this reference cannot compute exactly."""


@dataclass(frozen=True)
class ModelConfig:
    """What the reference needs from config.json."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Validate an HF config dict; unsupported features raise ``ConfigError`` naming the field."""
        architectures = raw.get("architectures")
        if not (isinstance(architectures, list) and len(architectures) == 1
                and architectures[0] in SUPPORTED_ARCHITECTURES):
            raise ConfigError(f"architectures must be one of {sorted(SUPPORTED_ARCHITECTURES)}, got {architectures!r}")
        arch = SUPPORTED_ARCHITECTURES[architectures[0]]
        _reject_rope_scaling(raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act must be 'silu', got {raw['hidden_act']!r}")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"use_sliding_window is not supported, got {raw['use_sliding_window']!r}")
        if arch == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
            raise ConfigError(f"llama attention_bias/mlp_bias are not supported, got "
                              f"{raw.get('attention_bias')!r}/{raw.get('mlp_bias')!r}")
        if arch == "qwen3" and raw.get("attention_bias"):
            raise ConfigError(f"qwen3 attention_bias is not supported, got {raw['attention_bias']!r}")
        if raw.get("pretraining_tp", 1) != 1:
            raise ConfigError(f"pretraining_tp must be 1, got {raw['pretraining_tp']!r}")
        num_heads = _positive_int(raw, "num_attention_heads")
        hidden = _positive_int(raw, "hidden_size")
        num_kv_heads = _positive_int(raw, "num_key_value_heads") if "num_key_value_heads" in raw else num_heads
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_attention_heads ({num_heads}) must be a multiple of "
                              f"num_key_value_heads ({num_kv_heads})")
        head_dim = hidden // num_heads if raw.get("head_dim") is None else _positive_int(raw, "head_dim")
        return cls(
            arch=arch,
            vocab_size=_positive_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_positive_int(raw, "intermediate_size"),
            num_layers=_positive_int(raw, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )


def _positive_int(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _reject_rope_scaling(raw: dict[str, Any]) -> None:
    scaling = raw.get("rope_scaling")
    if scaling and (not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "default"):
        raise ConfigError(f"rope_scaling is not supported (plain RoPE only), got {scaling!r}")
    parameters = raw.get("rope_parameters")
    if parameters and (not isinstance(parameters, dict) or parameters.get("rope_type", "default") != "default"):
        raise ConfigError(f"rope_parameters must use rope_type 'default', got {parameters!r}")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"partial_rotary_factor must be 1.0, got {raw['partial_rotary_factor']!r}")


def _rope_theta(raw: dict[str, Any]) -> float:
    theta = raw.get("rope_theta")
    if theta is None:
        theta = (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    return float(theta)


@dataclass(frozen=True)
class AttentionInputs:
    """One layer's projections for a block of tokens: ``q`` and ``k`` post-norm and un-rotated."""

    q: torch.Tensor  # [tokens, heads, head_dim]
    k: torch.Tensor  # [tokens, kv_heads, head_dim]
    v: torch.Tensor  # [tokens, kv_heads, head_dim]


def read_model_dir(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and every tensor of the ``*.safetensors`` files of an HF model directory."""
    from safetensors.torch import load_file

    root = Path(path)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {str(root)!r}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return config, weights


def embed_tokens(table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows of the embedding ``table`` for ``token_ids`` (1-D, each in range), on the table's device."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(ids.shape)}")
    vocab = table.shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)][0].item()
        raise ValueError(f"token_ids must be in [0, {vocab}), got {bad}")
    return table[ids.to(table.device)]


class ReferenceModel:
    """Weights plus the per-layer pieces of the forward pass, all computed in ``dtype`` on ``device``."""

    config_type: ClassVar[type] = ModelConfig
    """What :meth:`from_pretrained` reads config.json into (a subclass names its own)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self._w = {name: t.to(device=self.device, dtype=dtype) for name, t in weights.items()}
        missing = sorted(set(self._expected_names()) - set(self._w))
        if missing:
            raise ConfigError(f"weights are missing tensors for {config.arch}: {missing[:5]}")
        if config.tie_word_embeddings:
            self._w["lm_head.weight"] = self._w["model.embed_tokens.weight"]

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> ReferenceModel:
        """Load config.json and every ``*.safetensors`` file of an HF model directory onto ``device``."""
        raw, weights = read_model_dir(path)
        return cls(cls.config_type.from_dict(raw), weights, dtype, device)

    def _expected_names(self) -> list[str]:
        c = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not c.tie_word_embeddings:
            names.append("lm_head.weight")
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        if c.qkv_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if c.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        return names + [f"model.layers.{i}.{n}" for i in range(c.num_layers) for n in per_layer]

    def _rms_norm(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + self.config.rms_norm_eps) * self._w[weight]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self._w.get(name + ".bias")
        return torch.nn.functional.linear(x, self._w[name + ".weight"], bias)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` entering layer 0."""
        return embed_tokens(self._w["model.embed_tokens.weight"], token_ids)

    def attention_inputs(self, layer: int, hidden: torch.Tensor) -> AttentionInputs:
        """Projections of ``hidden`` for ``layer``; Qwen3 applies its q/k RMSNorm here, before RoPE."""
        c, p = self.config, f"model.layers.{layer}."
        x = self._rms_norm(hidden, p + "input_layernorm.weight")
        q = self._linear(x, p + "self_attn.q_proj").view(-1, c.num_heads, c.head_dim)
        k = self._linear(x, p + "self_attn.k_proj").view(-1, c.num_kv_heads, c.head_dim)
        v = self._linear(x, p + "self_attn.v_proj").view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = self._rms_norm(q, p + "self_attn.q_norm.weight")
            k = self._rms_norm(k, p + "self_attn.k_norm.weight")
        return AttentionInputs(q=q, k=k, v=v)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Neox RoPE of ``x[tokens, heads, head_dim]`` at ``positions[tokens]`` (FP32 formula)."""
        return rotate(x, positions, theta=self.config.rope_theta, neox=True).to(self.dtype)

    def attend(self, q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Softmax attention of queries ``[n, heads, d]`` over keys/values ``[m, kv_heads, d]`` where
        ``visible[n, m]`` is true; returns ``[n, heads * d]``. Every query must see at least one key."""
        if visible.shape != (q_rot.shape[0], k_rot.shape[0]):
            raise ValueError(f"visible must have shape {(q_rot.shape[0], k_rot.shape[0])}, got {tuple(visible.shape)}")
        empty = ~visible.any(dim=1)
        if bool(empty.any()):
            raise ValueError(f"query {int(empty.nonzero()[0])} sees no key")
        group = self.config.num_heads // self.config.num_kv_heads
        k = k_rot.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q_rot, k) * self.config.head_dim**-0.5
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v)
        return out.reshape(q_rot.shape[0], -1)

    def rerotate_keys(self, k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor) -> torch.Tensor:
        """``R(new) R(old)^-1 k`` for keys stored rotated at ``old_positions`` (FP32 formula)."""
        return rerotate(k, old_positions, new_positions, theta=self.config.rope_theta, neox=True)

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
        """``layer``'s attention for queries and keys at the given positions: every layer of these models
        reads all of its visible keys (the gpt-oss reference narrows sliding layers and adds sinks)."""
        return self.attend(q_rot, k_rot, v, visible)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, and the feed-forward block of ``layer`` (:meth:`_mlp`)."""
        p = f"model.layers.{layer}."
        hidden = hidden + self._linear(attention, p + "self_attn.o_proj")
        return hidden + self._mlp(layer, self._rms_norm(hidden, p + "post_attention_layernorm.weight"))

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP of ``layer`` on normalised ``x``."""
        p = f"model.layers.{layer}.mlp."
        gate = torch.nn.functional.silu(self._linear(x, p + "gate_proj"))
        return self._linear(gate * self._linear(x, p + "up_proj"), p + "down_proj")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: ``[tokens, vocab]``."""
        return torch.nn.functional.linear(self._rms_norm(hidden, "model.norm.weight"), self._w["lm_head.weight"])
