"""MiniMax-M2 family (M2 / M2.1 / M2.5 / M2.7) model directories: a tiny random-weight model, and a
config-only shape for ``--load-format dummy`` whose attention and KV layout are the real model's.

Facts kept from the official config: every layer is full softmax attention; q/k RMSNorm over all
heads at once (``qk_norm_type: per_layer``) before RoPE; partial NeoX RoPE on the first
``rotary_dim`` dims of each head; sigmoid-routed MoE with ``e_score_correction_bias``, no shared
expert. The config carries both ``rotary_dim`` (which SGLang reads) and ``partial_rotary_factor``
(which transformers reads; it ignores ``rotary_dim`` and would rotate the whole head).

The real tokenizer (200,064 entries) is not on PyPI: the tokenizer here is a stand-in byte-level
BPE with the template's markers as added tokens. The chat template is the official one, fetched
from the llama-cpp-python sdist (``sdist_templates``). The older MiniMax models (Text-01, M1) mix in
lightning attention, whose layers keep a recurrent state instead of per-token KV: refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from akv.system.models.sdist_templates import official_template
from akv.system.models.tiny import build_tokenizer

ARCHITECTURE = "MiniMaxM2ForCausalLM"
MODEL_TYPE = "minimax_m2"
TEMPLATE_NAME = "MiniMax-M2.jinja"
BOS, ROLE, EOS = "]~!b[", "]~b]", "[e~["

# (content, special), as in the real tokenizer's added tokens; think and tool-call markers stay
# visible to the reasoning and tool parsers.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS, True),
    (ROLE, True),
    (EOS, True),
    ("<think>", False),
    ("</think>", False),
    ("<minimax:tool_call>", False),
    ("</minimax:tool_call>", False),
)

# Lightning-attention MiniMax models (transformers ``minimax``; MiniMax-Text-01, MiniMax-M1).
LIGHTNING_ARCHITECTURES = ("MiniMaxForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM")
LIGHTNING_MODEL_TYPES = ("minimax", "minimax_text_01", "minimax_m1")

FP8_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "float8_e4m3fn",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
}


class UnsupportedMiniMaxError(ValueError):
    """A MiniMax config that AKV cannot drop or reposition on."""


@dataclass(frozen=True)
class MiniMaxM2Shape:
    """Dimensions written to config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    num_local_experts: int
    num_experts_per_tok: int
    max_position_embeddings: int
    rope_theta: float = 5_000_000.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "rope_theta" and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"MiniMaxM2Shape.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"MiniMaxM2Shape.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"MiniMaxM2Shape.rotary_dim must be even and <= head_dim={self.head_dim}, "
                             f"got {self.rotary_dim}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"MiniMaxM2Shape.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"num_local_experts ({self.num_local_experts})")
        if self.vocab_size < 256 + len(ADDED_TOKENS):
            raise ValueError(f"MiniMaxM2Shape.vocab_size must be at least {256 + len(ADDED_TOKENS)}, "
                             f"got {self.vocab_size}")


# The published model: 62 layers, 48 q / 8 KV heads of 128, rotary_dim 64, 256 experts (top 8).
PUBLISHED = MiniMaxM2Shape(
    vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48,
    num_key_value_heads=8, head_dim=128, rotary_dim=64, num_local_experts=256, num_experts_per_tok=8,
    max_position_embeddings=196608,
)
# What one H200 holds in FP8: every layer and all attention/KV exactly as published, 64 experts.
DUMMY_62L_64E = replace(PUBLISHED, num_local_experts=64)
# Test-sized, with the published per-head layout (head_dim 128, rotary_dim 64).
TINY = MiniMaxM2Shape(
    vocab_size=512, hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=128, rotary_dim=64, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=32768,
)


def check_supported(config: Mapping[str, Any]) -> None:
    """Raise ``UnsupportedMiniMaxError`` for lightning-attention MiniMax configs (Text-01, M1) and for
    M2 configs with any non-softmax layer."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    lightning = [a for a in architectures if a in LIGHTNING_ARCHITECTURES]
    if lightning or model_type in LIGHTNING_MODEL_TYPES:
        raise UnsupportedMiniMaxError(
            f"architectures {architectures!r} (model_type {model_type!r}): the older MiniMax models "
            "(MiniMax-Text-01, MiniMax-M1) use lightning attention, whose layers keep a recurrent state "
            f"instead of per-token KV, so messages cannot be dropped or repositioned; only {ARCHITECTURE} "
            "(MiniMax-M2, M2.1, M2.5, M2.7) is supported"
        )
    kinds = config.get("attn_type_list")
    if kinds is not None and any(kind != 1 for kind in kinds):
        layer = next(i for i, kind in enumerate(kinds) if kind != 1)
        raise UnsupportedMiniMaxError(
            f"attn_type_list[{layer}] = {kinds[layer]!r}: only softmax attention layers (1) keep per-token KV "
            "that can be dropped or repositioned"
        )
    layer_types = config.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        layer = next(i for i, kind in enumerate(layer_types) if kind != "full_attention")
        raise UnsupportedMiniMaxError(
            f"layer_types[{layer}] = {layer_types[layer]!r}: only full_attention layers are supported"
        )


def model_config(shape: MiniMaxM2Shape, ids: Mapping[str, int], *, fp8: bool = False,
                 dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json in the official layout plus the keys transformers needs for partial RoPE."""
    factor = shape.rotary_dim / shape.head_dim
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "attn_type_list": [1] * shape.num_hidden_layers,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": shape.rope_theta,
        "rotary_dim": shape.rotary_dim,
        "partial_rotary_factor": factor,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta, "partial_rotary_factor": factor},
        "num_local_experts": shape.num_local_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "shared_intermediate_size": 0,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "use_mtp": False,
        "num_mtp_modules": 0,
        "mtp_transformer_layers": 1,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "torch_dtype": dtype,
    }
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION)
    return config


def make_minimax_m2_tiny(out_dir: str | Path, *, seed: int = 0, shape: MiniMaxM2Shape = TINY,
                         dtype: Literal["float32", "bfloat16"] = "float32") -> Path:
    """Write a random-weight MiniMax-M2 model directory (config, tokenizer, template, safetensors)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    out = _write_common(out_dir, shape, fp8=False, dtype=dtype)
    _write_weights(out / "model.safetensors", shape, seed, dtype)
    return out


def make_minimax_m2_dummy(out_dir: str | Path, *, shape: MiniMaxM2Shape = DUMMY_62L_64E, fp8: bool = True) -> Path:
    """Write a config-only directory (no weights) for ``--load-format dummy``; FP8 block-quantized
    like the published checkpoint unless ``fp8`` is false."""
    return _write_common(out_dir, shape, fp8=fp8, dtype="bfloat16")


def _write_common(out_dir: str | Path, shape: MiniMaxM2Shape, *, fp8: bool, dtype: str) -> Path:
    template = official_template(TEMPLATE_NAME)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size, ADDED_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    ids = {content: tokenizer.token_to_id(content) for content, _ in ADDED_TOKENS}
    config = model_config(shape, ids, fp8=fp8, dtype=dtype)
    check_supported(config)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "do_sample": False})
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids, shape.max_position_embeddings, template))
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "unk_token": None})
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


def _tokenizer_config(ids: Mapping[str, int], max_length: int, template: str) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_decoder": {
            str(ids[content]): {"content": content, "special": special, "normalized": False,
                                "lstrip": False, "rstrip": False, "single_word": False}
            for content, special in ADDED_TOKENS
        },
        "chat_template": template,
    }


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_weights(path: Path, shape: MiniMaxM2Shape, seed: int, dtype: str) -> None:
    """Checkpoint tensor names (``block_sparse_moe.experts.N.w1/w2/w3``, which SGLang and transformers
    both load); matrices ~ N(0, 1/fan_in), embeddings N(0, 0.25^2), norms 1 + N(0, 0.1^2), routing
    bias N(0, 0.1^2) (kept float32, as published)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = shape.hidden_size, shape.intermediate_size
    n_q, n_kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def around_one(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": 0.25 * torch.randn(shape.vocab_size, hidden,
                                                                                        generator=gen)}
    biases: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = around_one(hidden)
        tensors[p + "self_attn.q_proj.weight"] = matrix(n_q, hidden)
        tensors[p + "self_attn.k_proj.weight"] = matrix(n_kv, hidden)
        tensors[p + "self_attn.v_proj.weight"] = matrix(n_kv, hidden)
        tensors[p + "self_attn.q_norm.weight"] = around_one(n_q)
        tensors[p + "self_attn.k_norm.weight"] = around_one(n_kv)
        tensors[p + "self_attn.o_proj.weight"] = matrix(hidden, n_q)
        tensors[p + "post_attention_layernorm.weight"] = around_one(hidden)
        tensors[p + "block_sparse_moe.gate.weight"] = matrix(shape.num_local_experts, hidden)
        biases[p + "block_sparse_moe.e_score_correction_bias"] = 0.1 * torch.randn(shape.num_local_experts,
                                                                                   generator=gen)
        for expert in range(shape.num_local_experts):
            e = f"{p}block_sparse_moe.experts.{expert}."
            tensors[e + "w1.weight"] = matrix(inter, hidden)
            tensors[e + "w3.weight"] = matrix(inter, hidden)
            tensors[e + "w2.weight"] = matrix(hidden, inter)
    tensors["model.norm.weight"] = around_one(hidden)
    tensors["lm_head.weight"] = 2.0 * matrix(shape.vocab_size, hidden)
    target = torch.float32 if dtype == "float32" else torch.bfloat16
    out = {name: t.to(target).contiguous() for name, t in tensors.items()}
    out.update({name: t.contiguous() for name, t in biases.items()})
    save_file(out, str(path), metadata={"format": "pt"})
