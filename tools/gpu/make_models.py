"""Write the two model folders a GPU run serves: a tiny Qwen3 with random safetensors weights (the
oracle loads the very same file) and a Qwen3-8B-shaped folder without weights (``--load-format dummy``);
and, where asked, a Qwen3-8B-shaped folder with random bf16 weights (for the oracle at full size).

Usage: ``python tools/gpu/make_models.py --tiny DIR --qwen3-8b DIR [--qwen3-8b-random DIR]``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from akv import cli
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


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(None, __doc__.split("\n\n")[0])
    parser.add_argument("--tiny", type=Path, required=True)
    parser.add_argument("--qwen3-8b", type=Path, required=True)
    parser.add_argument("--qwen3-8b-random", type=Path, default=None, help="also the 8B shape with random weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    make_tiny_model(args.tiny, arch="qwen3", seed=args.seed, dtype="bfloat16", **TINY_SHAPE)
    make_tiny_model(args.qwen3_8b, arch="qwen3", seed=args.seed, dtype="bfloat16", weights=False, **QWEN3_8B_SHAPE)
    folders = [args.tiny, args.qwen3_8b]
    if args.qwen3_8b_random is not None:
        folders.append(make_qwen3_8b_random(args.qwen3_8b_random, seed=args.seed))
    for folder in folders:
        config = json.loads((folder / "config.json").read_text())
        print(f"{folder}: {config['architectures'][0]} layers={config['num_hidden_layers']} "
              f"hidden={config['hidden_size']} vocab={config['vocab_size']} "
              f"weights={'yes' if any(folder.glob('*.safetensors')) else 'dummy'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
