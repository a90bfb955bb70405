"""The demo's command line (``akv-demo``, or ``python examples/demo.py``): follow a chain of shipment
records with a tool-calling agent whose cache policy drops old records and repositions, and show
what the server reused, re-rotated and dropped.

    akv-demo --base-url http://127.0.0.1:30000 --model NAME --output runs/demo
    akv-demo --model-path models/smollm2 --output runs/demo --scripted   # embedded CPU server

Without --base-url the CPU reference server is started in-process on --model-path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from akv import cli
from akv.agent import BackendError
from akv_demo.artifacts import ArtifactError, check_output
from akv_demo.harness import DemoConfig, run_demo
from akv_demo.policies import POLICY_KINDS
from akv_demo.server_wait import ServerNotReady, wait_for_model


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("akv-demo", __doc__)
    parser.add_argument("--base-url", default=None,
                        help="OpenAI-compatible server (default: the embedded reference server)")
    parser.add_argument("--model", default=None, help="model name to send (default: the embedded server's)")
    parser.add_argument("--model-path", type=Path, default=None, help="model dir for the embedded reference server")
    parser.add_argument("--output", type=Path, required=True, help="new directory for the run's artifacts")
    parser.add_argument("--policy", choices=POLICY_KINDS, default="turn")
    parser.add_argument("--scripted", action="store_true",
                        help="the harness picks each tool call; the model's replies are still generated and recorded")
    parser.add_argument("--steps", type=int, default=6, help="records in the chain")
    parser.add_argument("--manifest-lines", type=int, default=12, help="manifest lines per record (record length)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="reply budget per step (a read_record call needs about 30)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per socket operation")
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for --base-url to come up (a server just started with '&')")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="model dir whose chat template the token policy counts with "
                             "(default: --model-path; else a character estimate)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    server = None
    base_url, model = args.base_url, args.model
    try:
        check_output(args.output)  # before loading anything: a model can take minutes to load
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if base_url is None:
        if args.model_path is None:
            parser.error("give --base-url, or --model-path to start the embedded reference server")
        from akv.system.reference_server import Engine, ReferenceServer

        print(f"starting the embedded reference server on {args.model_path} ...", flush=True)
        try:
            engine = Engine(args.model_path, name=model)
        except (ValueError, OSError) as exc:  # ModelDirError is a ValueError
            print(f"error: --model-path: {exc}", file=sys.stderr)
            return 2
        server = ReferenceServer(engine)
        server.start_in_background()
        base_url, model = server.url, engine.model_name
    elif model is None:
        parser.error("--model is required with --base-url")
    else:
        try:
            wait_for_model(base_url, model, args.wait, log=lambda line: print(line, flush=True))
        except ServerNotReady as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    config = DemoConfig(base_url=base_url, model=model, output=args.output, policy=args.policy,
                        scripted=args.scripted, steps=args.steps, manifest_lines=args.manifest_lines,
                        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        timeout_s=args.timeout, tokenizer_dir=args.tokenizer or args.model_path)
    try:
        result = run_demo(config, log=lambda line: print(line, flush=True))
    except ArtifactError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:
        print(f"error: the server failed a request ({type(exc).__name__}, HTTP {exc.status}): {exc} {exc.body}",
              file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    return 0 if result.chain_completed or not args.scripted else 1
