"""On the H200, with the patched server up on the tiny random Qwen3 (``SGLANG_BASE_URL``, bf16):
the same chat requests, plain and with ``drop_message``/``reposition``, go to it and to the exact
CPU reference server (FP32, the oracle's arithmetic) started here on the same weights.

Per request: the served token log-probs against the reference's (until the first differing token),
the reference's top-2 margin wherever the tokens differ, and the usage. SGLang's CUDA RMSNorm has
no FP32 path, so the bound is measured, not assumed: context requests must stay within 1.5x the
largest error of the plain requests in the same run, greedy tokens must agree wherever the
reference's top-2 margin exceeds that error, and usage must equal the reference server's.

Run by ``tools/gpu/run.sh`` with ``AKV_BENCH_LIVE=bench/akv_served_check.py``. Writes
``$AKV_BENCH_OUT/akv_served_check.json``; exits 1 if a check fails. Each environment variable
has a flag instead (``--help``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli  # noqa: E402
from bench.harness import oracle, results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(None, __doc__.split("\n\n")[0])
    env = os.environ.get
    parser.add_argument("--base-url", default=env("SGLANG_BASE_URL"), required=env("SGLANG_BASE_URL") is None,
                        help="the patched server under test (default: $SGLANG_BASE_URL)")
    parser.add_argument("--model", type=Path, default=env("AKV_TINY_MODEL"), required=env("AKV_TINY_MODEL") is None,
                        help="the tiny model's folder, for the reference server (default: $AKV_TINY_MODEL)")
    parser.add_argument("--out-dir", type=Path, default=Path(env("AKV_BENCH_OUT", ".")),
                        help="folder for akv_served_check.json (default: $AKV_BENCH_OUT, else .)")
    args = parser.parse_args(argv)
    url, model, out_dir = args.base_url, Path(args.model), args.out_dir
    results.refuse_existing(parser, out_dir / "akv_served_check.json")
    report = results.header("bench/akv_served_check.py", argv)
    started = time.time()
    with oracle.reference_server(model, kv_slots=16384) as reference:
        rows = oracle.serve_pairs(url, reference.url, oracle.requests(), lambda line: print(line, flush=True))
    result = oracle.verdict(rows)
    report.update(**result, requests=rows, seconds=round(time.time() - started, 1))
    results.write(report, out_dir / "akv_served_check.json", indent=2)
    print(json.dumps(result, indent=2))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
