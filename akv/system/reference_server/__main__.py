"""``python -m akv.system.reference_server --model PATH [--host H] [--port P]``."""

from __future__ import annotations

import sys

from akv import cli
from akv.system.reference_server.engine import DEFAULT_KV_SLOTS, Engine
from akv.system.reference_server.model_dir import ModelDirError
from akv.system.reference_server.server import DEFAULT_IO_TIMEOUT, ReferenceServer


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("akv-reference-server", "AKV CPU reference server (exact, slow; not for production); "
                                                "also python -m akv.system.reference_server")
    parser.add_argument("--model", required=True, help="HF model directory (safetensors + tokenizer.json)")
    parser.add_argument("--served-model-name", default=None, help="name clients send as 'model' (default: dir name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--kv-slots", type=int, default=DEFAULT_KV_SLOTS, help="KV cache capacity in tokens")
    parser.add_argument("--device", default="cpu", help="torch device of the weights and the KV cache (cpu, cuda)")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="at most this many prompt tokens per forward")
    parser.add_argument("--io-timeout", type=float, default=DEFAULT_IO_TIMEOUT,
                        help="seconds a socket read or write may wait before the client is dropped")
    parser.add_argument("--verbose", action="store_true", help="log every HTTP request")
    args = parser.parse_args(argv)
    if not args.io_timeout > 0:
        print(f"error: --io-timeout must be positive, got {args.io_timeout}", file=sys.stderr)
        return 2
    try:
        engine = Engine(args.model, name=args.served_model_name, kv_slots=args.kv_slots, device=args.device,
                        prefill_chunk=args.prefill_chunk)
    except (ModelDirError, ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = ReferenceServer(engine, args.host, args.port, verbose=args.verbose, io_timeout=args.io_timeout)
    print(f"AKV reference server: model {engine.model_name!r} at {server.url}/v1 (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
