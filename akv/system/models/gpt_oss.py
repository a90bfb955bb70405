"""gpt-oss model directories: a tiny random-weight model, and the 20b / 120b shapes as config only
(for SGLang's ``--load-format dummy``).

Every directory gets the real ``o200k_harmony`` tokenizer (:mod:`akv.system.models.o200k`) and
OpenAI's chat template, taken from the llama.cpp copy vendored in the ``llama-cpp-python`` sdist
(``models/templates/openai-gpt-oss-120b.jinja``; both sizes share it). Weights use the Hugging Face
``GptOssForCausalLM`` tensor names that SGLang's unquantized loader reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from akv.system.models.o200k import VOCAB_SIZE, build_harmony_tokenizer
from akv.system.models.pypi_files import PinnedFile, pinned_path

CHAT_TEMPLATE = PinnedFile(
    package="llama-cpp-python",
    version="0.3.36",
    dist_filename="llama_cpp_python-0.3.36.tar.gz",
    dist_sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja",
    sha256="a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
    sdist=True,
)

STARTOFTEXT, ENDOFTEXT, RETURN, CALL = 199998, 199999, 200002, 200012
DTYPES = ("bfloat16", "float32")
MAX_RANDOM_PARAMETERS = 200_000_000
MXFP4 = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False}


@dataclass(frozen=True)
class GptOssShape:
    """Dimensions written to config.json; even layers use the sliding window."""

    num_hidden_layers: int
    num_local_experts: int
    num_experts_per_tok: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 64
    sliding_window: int = 128

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GptOssShape.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"GptOssShape.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(f"GptOssShape.num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                             f"num_local_experts ({self.num_local_experts})")
        if self.head_dim % 2:
            raise ValueError(f"GptOssShape.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def n_parameters(self) -> int:
        """Parameter count of the unquantized model (embeddings and LM head included)."""
        h, i, e = self.hidden_size, self.intermediate_size, self.num_local_experts
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = (h * q + q) + (q * h + h) + 2 * (h * kv + kv) + self.num_attention_heads
        experts = e * (h * 2 * i + 2 * i + i * h + h) + e * h + e
        return 2 * VOCAB_SIZE * h + h + self.num_hidden_layers * (attention + experts + 2 * h)


SHAPES: dict[str, GptOssShape] = {
    "tiny": GptOssShape(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, hidden_size=64,
                        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2),
    "20b": GptOssShape(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4, hidden_size=2880,
                       intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8),
    "120b": GptOssShape(num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4, hidden_size=2880,
                        intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8),
}


def chat_template(cache_dir: Path | None = None) -> str:
    """OpenAI's gpt-oss chat template (fetched from PyPI once, then read from the cache)."""
    return pinned_path(CHAT_TEMPLATE, cache_dir).read_text(encoding="utf-8")


def model_config(shape: GptOssShape, *, dtype: str = "bfloat16", mxfp4: bool = False) -> dict[str, Any]:
    """config.json in the layout of the published gpt-oss checkpoints."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    config: dict[str, Any] = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "attention_bias": True,
        "attention_dropout": 0.0,
        "bos_token_id": STARTOFTEXT,
        "eos_token_id": RETURN,
        "pad_token_id": ENDOFTEXT,
        "experts_per_token": shape.num_experts_per_tok,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "num_local_experts": shape.num_local_experts,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "initial_context_length": YARN["original_max_position_embeddings"],
        "initializer_range": 0.02,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(shape.num_hidden_layers)],
        "max_position_embeddings": 131072,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_scaling": dict(YARN),
        "rope_theta": 150000.0,
        "router_aux_loss_coef": 0.9,
        "sliding_window": shape.sliding_window,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }
    if mxfp4:
        config["quantization_config"] = dict(MXFP4)
    return config


def make_gpt_oss_model(
    out_dir: str | Path,
    *,
    shape: str | GptOssShape = "tiny",
    weights: bool = True,
    seed: int = 0,
    dtype: str = "bfloat16",
    mxfp4: bool = False,
    sliding_window: int | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Write config.json, generation_config.json, tokenizer files, chat_template.jinja and (with
    ``weights``) model.safetensors into ``out_dir``; return it. ``sliding_window`` overrides the shape's."""
    dims = SHAPES[shape] if isinstance(shape, str) else shape
    if sliding_window is not None:
        dims = replace(dims, sliding_window=sliding_window)
    if weights and mxfp4:
        raise ValueError("mxfp4 is for config-only directories (weights=False); random weights are unquantized")
    if weights and dims.n_parameters > MAX_RANDOM_PARAMETERS:
        raise ValueError(f"shape has {dims.n_parameters:,} parameters; random weights are written only up to "
                         f"{MAX_RANDOM_PARAMETERS:,} (use weights=False and --load-format dummy)")
    config = model_config(dims, dtype=dtype, mxfp4=mxfp4)
    template = chat_template(cache_dir)
    tokenizer = build_harmony_tokenizer(cache_dir=cache_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "bos_token_id": STARTOFTEXT, "eos_token_id": [RETURN, ENDOFTEXT, CALL], "pad_token_id": ENDOFTEXT,
        "do_sample": False,
    })
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    })
    _write_json(out / "special_tokens_map.json", {
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
    })
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    if weights:
        _write_weights(out / "model.safetensors", dims, seed, dtype)
    return out


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _write_weights(path: Path, shape: GptOssShape, seed: int, dtype: str) -> None:
    """Matrices ~ N(0, 1/fan_in) (expert gate/up x3, so the SwiGLU clamp at 7 is reached; LM head x6,
    so predictions over the 201k vocabulary are peaked), norms
    1 + N(0, 0.1^2), biases N(0, 0.1^2), sinks N(0, 1): attention, routing and logits far from uniform."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, n_exp = shape.hidden_size, shape.intermediate_size, shape.num_local_experts
    n_q, n_kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim

    def normal(*size: int, std: float) -> torch.Tensor:
        return std * torch.randn(*size, generator=gen)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, hidden, std=0.25)}
    for layer in range(shape.num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = 1.0 + normal(hidden, std=0.1)
        for name, rows, cols in (("q", n_q, hidden), ("k", n_kv, hidden), ("v", n_kv, hidden), ("o", hidden, n_q)):
            tensors[p + f"self_attn.{name}_proj.weight"] = normal(rows, cols, std=cols**-0.5)
            tensors[p + f"self_attn.{name}_proj.bias"] = normal(rows, std=0.1)
        tensors[p + "self_attn.sinks"] = normal(shape.num_attention_heads, std=1.0)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + normal(hidden, std=0.1)
        tensors[p + "mlp.router.weight"] = normal(n_exp, hidden, std=hidden**-0.5)
        tensors[p + "mlp.router.bias"] = normal(n_exp, std=0.1)
        tensors[p + "mlp.experts.gate_up_proj"] = normal(n_exp, hidden, 2 * inter, std=3.0 * hidden**-0.5)
        tensors[p + "mlp.experts.gate_up_proj_bias"] = normal(n_exp, 2 * inter, std=0.1)
        tensors[p + "mlp.experts.down_proj"] = normal(n_exp, inter, hidden, std=inter**-0.5)
        tensors[p + "mlp.experts.down_proj_bias"] = normal(n_exp, hidden, std=0.1)
    tensors["model.norm.weight"] = 1.0 + normal(hidden, std=0.1)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, hidden, std=6.0 * hidden**-0.5)
    target = torch.float32 if dtype == "float32" else torch.bfloat16
    save_file({name: t.to(target).contiguous() for name, t in tensors.items()}, str(path), metadata={"format": "pt"})
