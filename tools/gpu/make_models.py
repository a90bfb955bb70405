"""Write the two model folders a GPU run serves: a tiny Qwen3 with random safetensors weights (the
oracle loads the very same file) and a Qwen3-8B-shaped folder without weights (``--load-format dummy``);
and, where asked, a Qwen3-8B-shaped folder with random bf16 weights (for the oracle at full size).

Usage: ``python tools/gpu/make_models.py --tiny DIR --qwen3-8b DIR [--qwen3-8b-random DIR]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from akv import cli  # noqa: E402
from akv.system.models.tiny import make_tiny_model  # noqa: E402
from bench.harness.models import QWEN3_8B_SHAPE, TINY_SHAPE, make_qwen3_8b_random  # noqa: E402


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
