"""On the H200: the tiny random Qwen3 served by the patched server in every execution configuration
at once (triton, FlashInfer and FA3 attention, decode CUDA graphs on and off, the overlap scheduler on
and off, forced retraction), each against the exact CPU reference server (FP32) on the same weights.

Every configuration gets the same traffic: one agent conversation turn by turn (plain turns, then
turns with ``drop_message`` / ``reposition``, with plain probes in between), then four other
conversations at once, so context and plain requests share prefill and decode batches (padded
CUDA-graph batches included). Per configuration, as in ``akv_served_check.py``: context requests
within 1.5x the largest log-prob error of its plain requests, greedy tokens equal wherever the
reference's top-2 margin exceeds that bound, usage equal to the reference's; SGLang's strict memory
checks (busy and idle) stay on; the AKV Prometheus counters count the context requests sent. Across
configurations: the largest log-prob difference between any two on the plain requests, and on the
context requests.

Run by ``tools/gpu/run.sh`` as an ``AKV_BENCH`` script (``SKIP_SERVER=1`` is fine: it starts its own
servers); writes ``$AKV_BENCH_OUT/akv_config_matrix.json``; exits 1 if a check fails. The FA3
configurations beside FlashInfer's alone (FA3 needs compute capability 8.x or 9.x)::

    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_MATRIX_CONFIGS="fa3-eager fa3-graphs-overlap flashinfer-graphs-overlap" AKV_BENCH="bench/akv_config_matrix.py" bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from akv import cli  # noqa: E402
from bench.harness import client, oracle, results, servers  # noqa: E402
from bench.harness.oracle import RATIO, compare, requests  # noqa: E402

CONFIGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "triton-eager": (["--attention-backend", "triton", "--disable-cuda-graph", "--disable-overlap-schedule"], {}),
    "flashinfer-eager": (["--attention-backend", "flashinfer", "--disable-cuda-graph", "--disable-overlap-schedule"], {}),
    "flashinfer-graphs-overlap": (["--attention-backend", "flashinfer"], {}),
    "flashinfer-graphs-overlap-retract": (["--attention-backend", "flashinfer"], {"SGLANG_TEST_RETRACT": "1"}),
    "triton-graphs-overlap": (["--attention-backend", "triton"], {}),
    "fa3-eager": (["--attention-backend", "fa3", "--disable-cuda-graph", "--disable-overlap-schedule"], {}),
    "fa3-graphs-overlap": (["--attention-backend", "fa3"], {}),
}
COMMON = ["--dtype", "bfloat16", "--tool-call-parser", "qwen", "--enable-cache-report",
          "--enable-metrics", "--max-total-tokens", "65536", "--mem-fraction-static", "0.08",
          "--cuda-graph-max-bs", "8", "--sampling-backend", "pytorch"]
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
N_CONCURRENT = 4


def conversation(seed: int) -> list[tuple[str, dict[str, Any]]]:
    """``akv_served_check``'s conversation under its own system prompt (its own KV)."""
    out = []
    for name, body in requests():
        messages = [dict(m) for m in body["messages"]]
        messages[0]["content"] = f"[run {seed}] " + messages[0]["content"]
        out.append((f"c{seed}/{name}", {**body, "messages": messages}))
    return out


def serve_traffic(url: str, traffic: list[list[tuple[str, dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """The first conversation alone, then the others concurrently (each in its own order)."""
    replies = {name: client.chat(url, body) for name, body in traffic[0]}

    def run(conv: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        return {name: client.chat(url, body) for name, body in conv}

    with ThreadPoolExecutor(len(traffic) - 1) as pool:
        for part in pool.map(run, traffic[1:]):
            replies.update(part)
    return replies


def check_config(name: str, replies: dict, reference: dict, n_context: int, metrics_count: float) -> dict[str, Any]:
    rows = {key: compare(replies[key], reference[key]) for key in reference}
    plain_error = max(r["error"] for key, r in rows.items() if "/plain" in key)
    bound = RATIO * plain_error
    failures = []
    for key, row in rows.items():
        if "/context" in key and row["error"] > bound:
            failures.append(f"{key}: log-prob error {row['error']:.3f} > {RATIO} x plain {plain_error:.3f}")
        if row["margin_at_split"] is not None and row["margin_at_split"] > bound:
            failures.append(f"{key}: tokens differ where the reference's margin {row['margin_at_split']:.3f} > {bound:.3f}")
        if "/context" in key and row["usage"].get("prompt_tokens_details") != row["reference_usage"].get("prompt_tokens_details"):
            failures.append(f"{key}: usage {row['usage'].get('prompt_tokens_details')} != "
                            f"reference {row['reference_usage'].get('prompt_tokens_details')}")
    if metrics_count != n_context:
        failures.append(f"sglang:akv_context_requests_total {metrics_count} != {n_context} context requests sent")
    context_error = max(r["error"] for key, r in rows.items() if "/context" in key)
    return {"plain_max_logprob_error": plain_error, "context_max_logprob_error": context_error, "bound": bound,
            "context_requests_counted": metrics_count, "failures": failures,
            "tokens_agreeing": sum(r["agree"] for r in rows.values()), "tokens": sum(r["n"] for r in rows.values())}


def cross_config(replies: dict[str, dict[str, dict]]) -> dict[str, float]:
    """Largest log-prob difference between two configurations over their common greedy prefix."""
    worst = {"plain": 0.0, "context": 0.0}
    names = list(replies)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for key in replies[a]:
                kind = "context" if "/context" in key else "plain"
                worst[kind] = max(worst[kind], compare(replies[a][key], replies[b][key])["error"])
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(None, __doc__.split("\n\n")[0])
    env = os.environ.get
    parser.add_argument("--model", type=Path, default=env("AKV_TINY_MODEL"), required=env("AKV_TINY_MODEL") is None,
                        help="the tiny model's folder (default: $AKV_TINY_MODEL)")
    parser.add_argument("--out-dir", type=Path, default=Path(env("AKV_BENCH_OUT", ".")),
                        help="folder for akv_config_matrix.json and the server logs (default: $AKV_BENCH_OUT, else .)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=env("AKV_MATRIX_CONFIGS", " ".join(CONFIGS)).split(),
                        help="configurations to run (default: $AKV_MATRIX_CONFIGS, else all)")
    args = parser.parse_args(argv)
    model, out, chosen = Path(args.model), args.out_dir / "akv_config_matrix.json", args.configs
    results.refuse_existing(parser, out)
    started = time.time()
    env = {**os.environ, **STRICT}

    def start(name: str) -> servers.Server:
        return servers.launch(name, "akv.system.launch_server", model, [*COMMON, *CONFIGS[name][0]],
                              {**env, **CONFIGS[name][1]}, 30100 + chosen.index(name),
                              out.parent / f"server-matrix-{name}.log")

    # the eager configurations first (they compile the JIT kernels once), the others once those are up
    first = [n for n in chosen if n.endswith("-eager")] or chosen[:1]
    running = {name: start(name) for name in first}
    traffic = [conversation(seed) for seed in range(1 + N_CONCURRENT)]
    n_context = sum("/context" in name for conv in traffic for name, _ in conv)
    report: dict[str, Any] = {**results.header("bench/akv_config_matrix.py", argv), "server_args": COMMON,
                              "configs": {n: CONFIGS[n][0] + [f"{k}={v}" for k, v in CONFIGS[n][1].items()]
                                          for n in chosen}}
    try:
        with oracle.reference_server(model, kv_slots=32768) as reference_server:
            reference = {name: client.chat(reference_server.url, body) for conv in traffic for name, body in conv}
            report["reference_s"] = round(time.time() - started, 1)
            print(f"reference: {len(reference)} requests in {report['reference_s']} s", flush=True)
            replies, outcome = {}, {}
            for name in first:
                with contextlib.suppress(Exception):  # a server that does not come up is reported below
                    running[name].wait(max(60.0, 420 - (time.time() - started)))
            running.update({name: start(name) for name in chosen if name not in running})
            for name in chosen:
                server = running[name]
                try:
                    server.wait(max(60.0, 480 - (time.time() - started)))
                    t = time.time()
                    replies[name] = serve_traffic(server.url, traffic)
                    outcome[name] = check_config(name, replies[name], reference, n_context,
                                                 client.read_metrics(server.url, 30).get("akv_context_requests_total", 0.0))
                    outcome[name]["seconds"] = round(time.time() - t, 1)
                except Exception as exc:  # noqa: BLE001 - a configuration that fails is reported, the rest still run
                    outcome[name] = {"failures": [f"{type(exc).__name__}: {exc}"]}
                print(name, json.dumps(outcome[name])[:700], flush=True)
            report["results"] = outcome
            report["cross_config_max_logprob_difference"] = cross_config(replies)
    finally:
        for server in running.values():
            server.stop()
        report["total_s"] = round(time.time() - started, 1)
        results.write(report, out, indent=2)
    failures = [f for r in report.get("results", {}).values() for f in r["failures"]]
    print(json.dumps({"cross": report.get("cross_config_max_logprob_difference"), "failures": failures[:20]}, indent=2))
    return 1 if failures or len(report.get("results", {})) < len(chosen) else 0


if __name__ == "__main__":
    sys.exit(main())
