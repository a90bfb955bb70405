"""The model folders the device checks serve, made here without downloading: the tiny Qwen3 and the
Qwen3-8B shape (devicekit's shapes), and FP32 copies of bf16 weights for SGLang's CPU path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from akv.system.models.tiny import make_tiny_model

TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0, "max_position_embeddings": 32768,
}
"""Head shapes as in devicekit's tiny model, whose kernels its jitcache already holds."""

QWEN3_8B_SHAPE: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False,
    "rope_theta": 1_000_000.0, "max_position_embeddings": 262144,
}

SHARD_BYTES = 4 << 30


def make_qwen3_8b_random(folder: Path, *, seed: int = 0, device: str | None = None,
                         log: Callable[[str], None] = print) -> Path:
    """The Qwen3-8B shape with random bf16 weights in 4 GiB shards, drawn on CUDA where there is one
    (about 16 GiB on disk): a model the server and the oracle load from the same files."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return make_tiny_model(folder, arch="qwen3", seed=seed, dtype="bfloat16", shard_bytes=SHARD_BYTES, device=device,
                           log=log, **QWEN3_8B_SHAPE)


def as_float32(folder: Path) -> None:
    """The same (bf16) weights stored as float32, for SGLang's FP32 CPU path (gpt-oss keeps the
    file's dtype in some layers)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    save_file({k: v.to(torch.float32) for k, v in load_file(path).items()}, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2) + "\n")
