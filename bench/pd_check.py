"""On one GPU: a PD pair over Mooncake TCP against a single server (issue #34). A patched prefill server
and a patched decode server (``--disaggregation-mode prefill|decode``, ``mooncake_tcp``, ``--mem-fraction-static
0.4`` each, triton by default) and a single patched server on the tiny Qwen3 (bf16), SGLang's strict idle
and busy memory checks on. Every request goes to the single server, then to the pair directly (both
servers at once with one bootstrap room, as a router sends it and as tests/sglang_cpu/test_pd_pair.py
does): the record-chain matrix (``bench.harness.oracle.requests``) and the CPU pair test's turns
(a drop with a reposition, a drop alone, a later drop, a streamed drop, a repeat, a reposition at the
last message and its repeat).

Checks (``failures`` in the report): the decode server's greedy tokens and log-probs against the single
server's within ``bench.harness.oracle.verdict`` (the bound set by the plain requests of this run: bf16
noise between two servers), usage equal, the streamed turn's text equal; after the run both PD servers
alive, idle, and after ``/flush_cache`` no token held (``/v1/loads``) -- a leaked slot would also have
stopped a scheduler through the strict checks. Per context request the report prints the live KV the
decode server should receive: kept tokens (``prompt_tokens - drop_skipped_tokens`` of its usage) times
the model's KV bytes per token; neither SGLang 0.5.16 nor Mooncake's Python engine counts the bytes sent
per request, so ``sent_bytes`` says so. The engine's own account is kept: with ``MC_TE_METRIC=1`` the
prefill server logs the MiB it moved each second (``engine_metric_lines``); with requests seconds
apart, as on the CPU, each transfer is one line, in request order.

Device call (tools/gpu/pd_kit.sh prints it; carry [".devkit/site-py312.tar.xz", ".devkit/MANIFEST.txt",
".devkit/overlay", ".devkit-pd"], timeout_s 600)::

    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH=bench/pd_check.py bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt

The engine comes from ``.devkit-pd/mooncake-cp312.tar.xz`` (unpacked into ``--work``); a missing shared
library is named before any server starts. The report is ``$AKV_BENCH_OUT/pd_check.json``, copied to ``$OUT``.

CPU dry run (the same flow on the CPU pair: FP32 tiny Qwen3, the CPU flags of bench/harness/servers.py,
Mooncake prepared by tests/sglang_cpu/mooncake_cpu.py; every token must agree)::

    python bench/pd_check.py --dry-run [--work DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from bench.harness import client, oracle, results, servers  # noqa: E402

STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
MESSAGES = [
    {"role": "system", "content": "You follow record chains."},
    {"role": "user", "content": "Read record A and follow it."},
    {"role": "assistant", "content": "Reading A."},
    {"role": "user", "content": "Record A: shipment 7 left the depot; see record B for the next leg."},
    {"role": "assistant", "content": "Reading B."},
    {"role": "user", "content": "Record B: the shipment arrived; the chain ends here."},
]
PAIR_TURNS = [
    ("plain", {}),
    ("drop-and-repos", {"drop_message": {"4": [3]}, "reposition": [4]}),
    ("drop-only", {"drop_message": {"4": [3]}}),
    ("later-drop", {"drop_message": {"4": [3], "5": [1, 2]}, "reposition": [4]}),
    ("drop-only-streamed", {"drop_message": {"4": [3]}, "stream": True, "stream_options": {"include_usage": True}}),
    ("drop-and-repos-again", {"drop_message": {"4": [3]}, "reposition": [4]}),
    # anchored at the last message: re-rotations just before the generation prompt's tokens
    ("repos-at-the-end", {"drop_message": {"5": [3]}, "reposition": [5]}),
    ("repos-at-the-end-again", {"drop_message": {"5": [3]}, "reposition": [5]}),
]
"""The turns of the matrix's record chain; tests/sglang_cpu/test_pd_pair.py serves the same ones."""
USAGE = ("prompt_tokens", "completion_tokens", "prompt_tokens_details")
"""The usage fields a streamed turn must report as the single server does."""
ENGINE_METRICS = {"MC_TE_METRIC": "1", "MC_TE_METRIC_INTERVAL_SECONDS": "1"}
"""Mooncake's engine logs its transfer throughput every second (the report keeps those lines: the
engine's only account of bytes moved, per interval, not per request)."""
CPU_BOUND_FLOOR = 1e-3
"""FP32 on the CPU: the bound never below this (the plain requests' errors are noise-level)."""
BOOTSTRAP_PORT = 8998
"""The prefill server's bootstrap port on the GPU node (a free one on the shared CPU machine)."""


DRY_WORDS = (6, 4, 8, 4, 6, 4, 8, 4)
"""The dry run's tool results (fields per turn) and no tool list: the interpreted triton kernels take
seconds per hundred prompt tokens on the CPU, and the ~350-token tool block would be most of them."""


def matrix(dry_run: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(name, body) in serving order: oracle's record chain (shorter and without tools in the dry run),
    then the pair test's turns (``plain-`` and ``context-`` names, as the verdict reads them)."""
    if dry_run:
        out = [(name, {k: v for k, v in body.items() if k != "tools"}) for name, body in oracle.requests(DRY_WORDS)]
    else:
        out = list(oracle.requests())
    for name, fields in PAIR_TURNS:
        out.append((f"plain-pair-{name}" if not fields else f"context-pair-{name}", {"messages": MESSAGES, **fields}))
    return out


def pd_chat(prefill: str, decode: str, bootstrap: int, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` to both servers at once with one bootstrap room; the decode server's reply (the prefill
    server's must succeed too)."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
            "bootstrap_room": random.randrange(1, 2**62)}
    replies: dict[str, Any] = {}

    def send(name: str, url: str) -> None:
        try:
            replies[name] = streamed(url, body) if body.get("stream") else client.chat(url, body)
        except Exception as exc:  # noqa: BLE001 - reported below with the server's name
            replies[name] = exc

    threads = [threading.Thread(target=send, args=item) for item in (("prefill", prefill), ("decode", decode))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ("prefill", "decode"):
        if isinstance(replies[name], Exception):
            raise RuntimeError(f"the {name} server: {replies[name]!r}"[:2000])
    return replies["decode"]


def streamed(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed greedy request: its text and usage."""
    full = {"model": "default", "max_tokens": 8, "temperature": 0.0, **body}
    with cli.open_request(f"{url}/v1/chat/completions", full, timeout=600) as response:
        text = response.read().decode()
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return {"content": "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]),
            "usage": next(e["usage"] for e in events if e.get("usage"))}


def kv_bytes_per_token(model: Path, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


def idle_and_empty(url: str, seconds: float = 60.0) -> dict[str, Any]:
    """Wait for the server to go idle, ``/flush_cache``, then until ``/v1/loads`` shows no token held:
    what was seen."""
    deadline = time.time() + seconds
    load = client.read_load(url)
    while time.time() < deadline and load["num_running_reqs"] + load["num_waiting_reqs"]:
        time.sleep(0.5)
        load = client.read_load(url)
    seen: dict[str, Any] = {"flush_status": client.flush_cache(url)}
    while True:
        load = client.read_load(url)
        seen.update(used=load["num_used_tokens"], pool=load["max_total_num_tokens"],
                    running=load["num_running_reqs"], waiting=load["num_waiting_reqs"])
        if load["num_used_tokens"] == 0 or time.time() > deadline:
            return seen
        time.sleep(1.0)


def mooncake_env(args: argparse.Namespace, log: Any) -> dict[str, str]:
    """PYTHONPATH and LD_LIBRARY_PATH entries that make ``mooncake.engine`` load, or RuntimeError naming
    the step that failed."""
    if args.dry_run:
        sys.path.insert(0, str(ROOT / "tests" / "sglang_cpu"))
        from akv.system import _build
        from mooncake_cpu import prepare

        found = prepare(_build.default_cache_dir().parent / "mooncake-cpu")
        if isinstance(found, str):
            raise RuntimeError(f"mooncake_cpu.prepare: {found}")
        # the early send of a cached prefix records a CUDA event
        return {"PYTHONPATH": found.python_path, "LD_LIBRARY_PATH": found.library_path,
                "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false"}
    kit, folder = ROOT / ".devkit-pd" / "mooncake-cp312.tar.xz", args.work / "mooncake"
    if not kit.exists():
        raise RuntimeError(f"{kit} is missing: run tools/gpu/pd_kit.sh and carry .devkit-pd")
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xJf", str(kit), "-C", str(folder)], check=True)
    cudart = [str(p.parent) for p in sorted({*Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu13/lib/libcudart.so.13"),
                                             *Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")).glob("lib*/libcudart.so.13")})]
    libraries = [str(folder / "lib"), *cudart]
    log(f"mooncake kit in {folder}; libcudart.so.13 from {cudart or 'the loader path'}")
    env = {"PYTHONPATH": str(folder / "site"), "LD_LIBRARY_PATH": os.pathsep.join(libraries)}
    ldd = subprocess.run(["ldd", str(folder / "site" / "mooncake" / "engine.so")], capture_output=True, text=True,
                         env={**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([*libraries, os.environ.get("LD_LIBRARY_PATH", "")])})
    missing = sorted({line.split()[0] for line in ldd.stdout.splitlines() if "not found" in line})
    if missing:
        raise RuntimeError(f"engine.so's libraries not found on this machine: {', '.join(missing)}")
    probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": env["PYTHONPATH"], "LD_LIBRARY_PATH": joined(env["LD_LIBRARY_PATH"], os.environ.get("LD_LIBRARY_PATH", ""))})
    if probe.returncode != 0:
        raise RuntimeError(f"import mooncake.engine: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    return env


def joined(first: str, rest: str) -> str:
    return os.pathsep.join([first, rest]) if rest else first


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU: the pair on the CPU (tests/sglang_cpu's setup)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("AKV_BENCH_OUT", "pd-check-out")))
    p.add_argument("--work", type=Path, default=ROOT / "build" / "pd-check", help="model (dry run), sites, kit")
    p.add_argument("--attention-backend", default="triton", choices=["triton", "flashinfer"])
    p.add_argument("--mem-fraction", type=float, default=0.4, help="each server's --mem-fraction-static (GPU)")
    p.add_argument("--ready-timeout", type=float, default=420.0)
    args = p.parse_args(argv)
    results.refuse_existing(p, args.out / "pd_check.json")
    args.argv = sys.argv[1:] if argv is None else argv
    return args


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run.sh's timeout: stop the servers, keep the report
    args = parse_args(argv)
    started = time.time()
    report: dict[str, Any] = {**results.header("bench/pd_check.py", args.argv), "dry_run": args.dry_run,
                              "failures": [], "steps": []}
    path = args.out / "pd_check.json"

    def log(line: str) -> None:
        print(f"[pd_check {time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - started:.0f}s] {line}", flush=True)

    def step(name: str, **fields: Any) -> None:
        report["steps"].append({"step": name, "t_s": round(time.time() - started, 1), **fields})
        results.write(report, path, copy_to_out=True)
        log(f"{name} {json.dumps(fields) if fields else ''}")

    running: list[servers.Server] = []
    try:
        base = {**os.environ, **STRICT}
        if args.dry_run:
            from akv.system.models.tiny import make_tiny_model

            model = args.work / "tiny-qwen3"
            if not (model / "config.json").exists():
                make_tiny_model(model, seed=3)
            site = servers.cpu_pythonpath(servers.cpu_patched_site(args.work))
            flags, dtype_bytes = servers.cpu_flags(4096), 4
        else:
            model, site = Path(os.environ["AKV_TINY_MODEL"]), os.pathsep.join([str(servers.device_site()), str(ROOT)])
            flags = ["--disable-cuda-graph", "--sampling-backend", "pytorch", "--enable-cache-report",
                     "--mem-fraction-static", str(args.mem_fraction), "--max-total-tokens", "131072",
                     "--attention-backend", args.attention_backend]
            dtype_bytes = 2
        flags += ["--served-model-name", "default"]
        report["model"] = {"path": str(model), "config": json.loads((model / "config.json").read_text())}
        step("model", path=str(model))
        engine = mooncake_env(args, log)
        step("mooncake", env=engine)
        env = {**base, "PYTHONPATH": joined(site, base.get("PYTHONPATH", ""))}
        pd_env = {**env, **engine, **ENGINE_METRICS, "PYTHONPATH": joined(engine["PYTHONPATH"], env["PYTHONPATH"]),
                  "LD_LIBRARY_PATH": joined(engine["LD_LIBRARY_PATH"], env.get("LD_LIBRARY_PATH", ""))}
        bodies = matrix(args.dry_run)

        single = servers.launch("single", "akv.system.launch_server", model, flags, env, servers.free_port(),
                                args.out / "server-single.log")
        running.append(single)
        single.wait(args.ready_timeout)
        step("single server up", command=single.command)
        want = {}
        for name, body in bodies:
            want[name] = streamed(single.url, body) if body.get("stream") else client.chat(single.url, body)
            log(f"single {name}: {want[name]['usage']['prompt_tokens']} prompt tokens")
        single.stop()
        running.remove(single)
        step("single server served and stopped", requests=len(want))

        pd = "--disaggregation-transfer-backend", "mooncake_tcp"
        bootstrap = servers.free_port() if args.dry_run else BOOTSTRAP_PORT
        prefill = servers.launch("prefill", "akv.system.launch_server", model,
                                 [*flags, *pd, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                  str(bootstrap)], pd_env, servers.free_port(), args.out / "server-prefill.log")
        decode = servers.launch("decode", "akv.system.launch_server", model,
                                [*flags, *pd, "--disaggregation-mode", "decode"], pd_env, servers.free_port(),
                                args.out / "server-decode.log")
        running += [prefill, decode]
        for server in (prefill, decode):
            server.wait(args.ready_timeout)
        report["servers"] = {s.name: s.command for s in (single, prefill, decode)}
        step("pd pair up")

        per_token = kv_bytes_per_token(model, dtype_bytes)
        rows, transfers = {}, {}
        for name, body in bodies:
            got = pd_chat(prefill.url, decode.url, bootstrap, body)
            if body.get("stream"):
                if got["content"] != want[name]["content"] or any(
                        got["usage"].get(k) != want[name]["usage"].get(k) for k in USAGE):
                    report["failures"].append(f"{name}: streamed {got} != single {want[name]}")
                log(f"{name}: streamed text {'equal' if got['content'] == want[name]['content'] else 'DIFFERS'}")
                continue
            rows[name] = oracle.compare(got, want[name])
            details = got["usage"].get("prompt_tokens_details") or {}
            kept = got["usage"]["prompt_tokens"] - (details.get("drop_skipped_tokens") or 0)
            transfers[name] = {"kept_tokens": kept, "expected_live_kv_bytes": kept * per_token, "sent_bytes": None}
            log(f"{name}: error {rows[name]['error']:.4f} agree {rows[name]['agree']}/{rows[name]['n']}; "
                f"live KV {kept} tokens = {kept * per_token} bytes expected")
        verdict = oracle.verdict(rows, CPU_BOUND_FLOOR if args.dry_run else 0.0)
        report.update(rows=rows, verdict=verdict, kv_bytes_per_token=per_token, transfers=transfers,
                      sent_bytes_note="not counted: SGLang 0.5.16's mooncake backend and Mooncake's Python "
                                      "TransferEngine expose no per-request byte count")
        report["failures"] += verdict["failures"]
        if args.dry_run:
            report["failures"] += [f"{n}: {r['agree']}/{r['n']} tokens agree (FP32)" for n, r in rows.items()
                                   if r["agree"] != r["n"]]
        step("matrix served", requests=len(bodies), bound=verdict["bound"])

        after = {}
        for server in (prefill, decode):
            alive = server.process.poll() is None
            after[server.name] = {"alive": alive, **(idle_and_empty(server.url) if alive else {})}
            if not alive or after[server.name]["used"] != 0:
                report["failures"].append(f"{server.name}: not back to an empty pool: {after[server.name]}")
        report["after"] = after
        report["engine_metric_lines"] = {s.name: [line.strip()[-300:] for line in s.log_path.read_text().splitlines()
                                                  if "Throughput" in line][-200:] for s in (prefill, decode)}
        step("after", **after)
    except Exception as exc:  # noqa: BLE001 - the report names the step that stopped the run
        failed = report["steps"][-1]["step"] if report["steps"] else "start"
        report["failures"].append(f"stopped after step '{failed}': {exc!r}"[:3000])
        log(report["failures"][-1])
    finally:
        for server in running:
            server.stop()
        report["ok"] = not report["failures"]
        report["total_s"] = round(time.time() - started, 1)
        results.write(report, path, copy_to_out=True)
        log(f"ok={report['ok']} failures={len(report['failures'])}; report {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
