"""Every serving-replay method side by side in one run: stock SGLang 0.5.16 (the pinned wheel,
unpatched) replays the text methods (Full, Standard, Text Engineering, trimming) and the patched
server (``python -m akv.system.launch_server``) replays AKV (drop_message/reposition from
akv.agent), both servers up at once on the same model (one at a time with --dry-run or
``--servers in-turn``, patched first), only one measured at a time, level by level over a
concurrency sweep that fits a time budget. Writes ``replay_suite.json`` (rows, ratios, the exact command and settings),
``replay_suite.md`` (the table, AKV vs Standard next to the goals, and where the patched server's time
per context request went, from its counters: ``bench.harness.client.prefill_breakdown``) and ``replay_suite.svg``
under ``--out``; server logs under ``--logs``. Prints a line per step and per run.

On the H200 (``tools/gpu/replay_suite.sh``, through ``tools/gpu/run.sh``): a Qwen3-8B-shaped
model with dummy weights and ``max_position_embeddings`` 131,072, bf16, CUDA graphs for decode,
FlashInfer attention for both servers (``AKV_REPLAY_BACKEND=triton`` for the second row).
``--dry-run``: the same steps on this CPU machine with the tiny random Qwen3, the CPU servers of
tests/sglang_cpu (stock and patched sites installed from the pinned wheel) and a tiny trajectory set.

Each setting is a flag with its default from an environment variable (run.sh runs the script
without arguments): AKV_REPLAY_CONCURRENCY (1,4,16), AKV_REPLAY_COUNT (8 trajectories),
AKV_REPLAY_PRESET (swe), AKV_REPLAY_START_TURN (12), AKV_REPLAY_MAX_TURNS (60; 0 = whole),
AKV_REPLAY_MAX_OUTPUT (128 tokens per call; 0 = the trajectories' own), AKV_REPLAY_STOCK_METHODS
(standard,trim,text_engineering,full), AKV_REPLAY_AKV_METHODS (akv_keep12; ``none`` in either: that
server is not started), AKV_REPLAY_THRESHOLDS
(96000,48000: Standard, Text Engineering), AKV_REPLAY_KEEP (12), AKV_REPLAY_TARGET_S (440: the
suite's planned wall time, server starts included), AKV_REPLAY_DEADLINE_S (470: no run that would
end later starts), AKV_REPLAY_SERVERS (together | in-turn), AKV_REPLAY_MEM_FRACTION,
AKV_REPLAY_POOL_TOKENS, AKV_REPLAY_BACKEND (flashinfer) and AKV_REPLAY_AKV_BACKEND (default: the same),
AKV_REPLAY_PREFILL_GRAPHS (0), AKV_REPLAY_PROTECT_LIVE (0; 1: the patched server runs with
--akv-protect-live), AKV_REPLAY_TURNS (0: the preset's), AKV_REPLAY_LIVE_BUDGET (96000: for
akv_live_budget), AKV_REPLAY_MAX_RUNNING (0: SGLang's), AKV_REPLAY_PRIME (1: measure from the second request of each
conversation, the first one, cold, sent before the run starts), AKV_REPLAY_TIMEOUT_S (240 per
socket operation), AKV_REPLAY_OUT (default $OUT).

Router mode (``--router affinity,round_robin``, AKV_REPLAY_ROUTER; issue #33): no stock server;
AKV_REPLAY_WORKERS (2) patched workers, each started as the patched server is (its
--mem-fraction-static and --max-total-tokens: AKV_REPLAY_MEM_FRACTION, default 0.8 with
AKV_REPLAY_POOL_TOKENS 150000 each on one GPU, as for two servers together), then smg 1.13 in front
of them once per policy, in turn: ``affinity`` through ``python -m akv.system.launch_router`` (each
conversation's routing key, the ``x-smg-routing-key`` header akv.agent's ``send_chat_request`` sends,
pinned to the worker least_load picks for it) and ``round_robin`` as ``python -m smg launch --policy
round_robin`` (every request to the next worker, the key ignored). The AKV methods are replayed
through each router's URL; every worker is flushed before each run, its KV pool sampled and its own
request counter read (``worker_requests``); rows name their ``router``, and the report compares
affinity with round-robin at each concurrency (cached and read fractions, output throughput, P95;
goals: at least 2x the read fraction, a lower P95). On one GPU (smg from ``.routerkit``, made by
``tools/gpu/router_kit.sh``; the carry leaves .devkit's jitcache out, so the workers compile SGLang's
kernels at their first start and triton attention keeps that short), one device call with
carry [".devkit/site-py312.tar.xz", ".devkit/MANIFEST.txt", ".routerkit"] and timeout_s 600 (not yet
run on a GPU):

    set -o pipefail; AKV_REPLAY_ROUTER=affinity,round_robin AKV_REPLAY_BACKEND=triton \
        AKV_REPLAY_CONCURRENCY=16 AKV_REPLAY_COUNT=16 bash tools/gpu/replay_suite.sh 2>&1 | tee $OUT/log.txt

and on this CPU: ``python bench/replay_suite.py --dry-run --router affinity,round_robin``.

``--merge A.json B.json [--out DIR]``: no run; the points of several device calls of one commit on one
warm machine joined into one report (a later call's point replaces an earlier one's, and says so).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from bench import serve_replay  # noqa: E402
from bench.agent_replay.methods import FullContext  # noqa: E402
from bench.agent_replay.serve import prepare, replay  # noqa: E402
from bench.agent_replay.suite_report import GOALS, best, markdown, ratios, router_ratios, svg  # noqa: E402
from bench.harness import client, results, servers  # noqa: E402
from bench.harness.models import QWEN3_8B_SHAPE  # noqa: E402
from bench.harness.servers import Server, free_port, free_port_pair  # noqa: E402

GPU_FLAGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--page-size", "1", "--chunked-prefill-size", "8192",
             "--enable-cache-report", "--enable-metrics", "--sampling-backend", "pytorch", "--context-length", "131072"]
ROUTER_POLICIES = ("affinity", "round_robin")
"""Router mode's policies: affinity (``python -m akv.system.launch_router``: least_load for a new
routing key, then pinned) and round_robin (``python -m smg launch --policy round_robin``: every
request to the next worker, routing keys ignored)."""
CPU_POOL_TOKENS = 16384
"""--max-total-tokens of each CPU server with --dry-run unless --pool-tokens says otherwise."""
MIN_RUN_S = 3.0


def env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny model, CPU servers, tiny trajectories")
    p.add_argument("--merge", type=Path, nargs="+", metavar="RESULT",
                   help="no run: join replay_suite.json files of one commit and one GPU (runs of a device call "
                        "each, on one warm machine) into one report in --out; a later run's point replaces an "
                        "earlier one's of the same method and concurrency, and the notes say so")
    p.add_argument("--out", type=Path, default=Path(env("AKV_REPLAY_OUT", env("OUT", "replay-out"))))
    p.add_argument("--logs", type=Path, default=Path(os.environ["AKV_BENCH_OUT"]) if os.environ.get("AKV_BENCH_OUT")
                   else None, help="server logs (default: $AKV_BENCH_OUT, else --out)")
    p.add_argument("--model", type=Path, default=None,
                   help="model folder, written if absent (Qwen3-8B shape, or the tiny model with --dry-run; default: "
                        "$AKV_REPLAY_MODEL, else akv-model-8b-128k, or tiny-qwen3, in --work)")
    p.add_argument("--stock-site", type=Path, default=Path(env("AKV_REPLAY_STOCK_SITE", str(servers.stock_site_default()))),
                   help="stock SGLang site (unpacked from .devkit/site-py312.tar.xz if absent; default: "
                        "$AKV_REPLAY_STOCK_SITE, else $AKV_STOCK_SITE, which tools/gpu/run.sh sets)")
    p.add_argument("--patched-site", type=Path, default=None,
                   help="patched SGLang site (default: the current PYTHONPATH; --dry-run builds one)")
    p.add_argument("--work", type=Path, default=Path(env("AKV_REPLAY_WORK", ROOT / "build" / "akv-replay-suite")),
                   help="where the model (and with --dry-run the CPU sites) are made (kept between runs; "
                        "default: $AKV_REPLAY_WORK, else build/akv-replay-suite in the checkout)")
    p.add_argument("--concurrency", default=env("AKV_REPLAY_CONCURRENCY", "1,4,16"))
    p.add_argument("--count", type=int, default=int(env("AKV_REPLAY_COUNT", "8")),
                   help="distinct trajectories (conversation k replays trajectory k mod count)")
    p.add_argument("--preset", default=env("AKV_REPLAY_PRESET", "swe"))
    p.add_argument("--start-turn", type=int, default=int(env("AKV_REPLAY_START_TURN", "12")),
                   help="first turn sent (its prompt prefilled cold); from about turn 11 the SWE-like set holds "
                        "more than 12 tool results, so trim and AKV edit")
    p.add_argument("--max-turns", type=int, default=int(env("AKV_REPLAY_MAX_TURNS", "60")) or None,
                   help="cut each trajectory to its first N calls (0: whole)")
    p.add_argument("--turns", type=int, default=int(env("AKV_REPLAY_TURNS", "0")) or None,
                   help="synthetic trajectories of exactly N turns (0: the preset's range); with akv_live_budget "
                        "they carry the text past the context length")
    p.add_argument("--live-budget", type=int, default=int(env("AKV_REPLAY_LIVE_BUDGET", "96000")),
                   help="akv_live_budget keeps the live length under this many tokens")
    p.add_argument("--max-running", type=int, default=int(env("AKV_REPLAY_MAX_RUNNING", "0")) or None,
                   help="--max-running-requests of each server (0: SGLang's; long texts widen every req_to_token "
                        "row, see akv.system.adapter.lengths)")
    p.add_argument("--stock-methods", default=env("AKV_REPLAY_STOCK_METHODS", "standard,trim,text_engineering,full"),
                   help="text methods on stock SGLang, in the order they run (most wanted first: a deadline cuts "
                        "the last)")
    p.add_argument("--akv-methods", default=env("AKV_REPLAY_AKV_METHODS", "akv_keep12"))
    p.add_argument("--thresholds", default=env("AKV_REPLAY_THRESHOLDS", "96000,48000"),
                   help="Standard and Text Engineering summarization thresholds in tokens")
    p.add_argument("--keep", type=int, default=int(env("AKV_REPLAY_KEEP", "12")))
    p.add_argument("--max-output-tokens", type=int, default=int(env("AKV_REPLAY_MAX_OUTPUT", "128")) or None,
                   help="cap of each request's fixed output length (0: the trajectories' own, ~350 on average)")
    p.add_argument("--target-s", type=float, default=float(env("AKV_REPLAY_TARGET_S", "440")),
                   help="wall seconds the suite plans for (server starts included)")
    p.add_argument("--deadline-s", type=float, default=float(env("AKV_REPLAY_DEADLINE_S", "470")),
                   help="no run starts after this many seconds")
    p.add_argument("--backend", default=env("AKV_REPLAY_BACKEND", "flashinfer"), help="attention backend (stock)")
    p.add_argument("--akv-backend", default=os.environ.get("AKV_REPLAY_AKV_BACKEND"),
                   help="attention backend of the patched server (default: --backend)")
    p.add_argument("--servers", choices=("in-turn", "together"), default=os.environ.get("AKV_REPLAY_SERVERS"),
                   help="start stock and patched one after the other (whole GPU each) or both at once (saves one "
                        "startup, ~65 s on FlashInfer with the carried kernels; each gets a --pool-tokens cap); "
                        "default: together on the H200, in turn with --dry-run")
    p.add_argument("--mem-fraction", default=os.environ.get("AKV_REPLAY_MEM_FRACTION"),
                   help="--mem-fraction-static of each server (default 0.85 in turn; 0.8 together, where the pool "
                        "cap leaves the other server room whichever profiles the GPU first)")
    p.add_argument("--pool-tokens", type=int, default=int(env("AKV_REPLAY_POOL_TOKENS", "0")) or None,
                   help="--max-total-tokens of each server (default: none in turn, 150000 together; "
                        f"{CPU_POOL_TOKENS} with --dry-run)")
    p.add_argument("--prime", type=int, choices=(0, 1), default=int(env("AKV_REPLAY_PRIME", "1")),
                   help="1: each conversation's cold first request is sent unmeasured and a run starts once all are "
                        "back (steady state); 0: measure from the cold start")
    p.add_argument("--prefill-graphs", action="store_true", default=os.environ.get("AKV_REPLAY_PREFILL_GRAPHS") == "1",
                   help="keep SGLang's prefill CUDA graphs (default off for both servers: the patched server runs "
                        "context rounds without them, and their capture adds about 30 s to each start)")
    p.add_argument("--protect-live", action="store_true", default=os.environ.get("AKV_REPLAY_PROTECT_LIVE") == "1",
                   help="start the patched server with --akv-protect-live (admission waits rather than evict live KV)")
    p.add_argument("--timeout", type=float, default=float(env("AKV_REPLAY_TIMEOUT_S", "240")),
                   help="seconds per socket operation of a request")
    p.add_argument("--ready-timeout", type=float, default=float(env("AKV_REPLAY_READY_TIMEOUT_S", "420")))
    p.add_argument("--router", default=env("AKV_REPLAY_ROUTER", ""),
                   help="router mode: smg policies, comma-separated, each replaying the AKV methods in turn through "
                        "smg in front of --workers patched workers (no stock server): affinity (python -m "
                        "akv.system.launch_router: each conversation's routing key, which akv.agent sends, pinned "
                        "to one worker) and round_robin (smg's own, no key pinning)")
    p.add_argument("--workers", type=int, default=int(env("AKV_REPLAY_WORKERS", "2")),
                   help="patched workers behind the router (router mode; each with --mem-fraction and --pool-tokens)")
    p.add_argument("--port", type=int, default=int(env("AKV_REPLAY_PORT", "0")) or None,
                   help="stock server's port, patched's the next (default: 30100 on the H200, free ports on CPU)")
    args = p.parse_args(argv)
    results.refuse_existing(p, args.out / "replay_suite.json")
    args.model = args.model or (Path(os.environ["AKV_REPLAY_MODEL"]) if os.environ.get("AKV_REPLAY_MODEL") else
                                args.work / ("tiny-qwen3" if args.dry_run else "akv-model-8b-128k"))
    if args.dry_run:
        for flag, value in (("concurrency", "1,2"), ("count", 1), ("preset", "tiny"), ("start_turn", 0),
                            ("thresholds", "450,250"), ("keep", 2), ("max_output_tokens", 4), ("target_s", 240.0),
                            ("deadline_s", 400.0), ("max_turns", 4), ("backend", "triton")):
            if getattr(args, flag) == p.get_default(flag):
                setattr(args, flag, value)
        if args.stock_site == p.get_default("stock_site"):
            args.stock_site = args.work / "stock-site"
    args.logs = args.logs or args.out
    args.akv_backend = args.akv_backend or args.backend
    args.levels = [int(c) for c in args.concurrency.split(",")]
    args.port = args.port or (free_port_pair() if args.dry_run else 30100)
    args.routers = [r.strip() for r in args.router.split(",") if r.strip()]
    unknown = [r for r in args.routers if r not in ROUTER_POLICIES]
    if unknown or args.workers < 1:
        p.error(f"--router: unknown {unknown}, choose from {list(ROUTER_POLICIES)}" if unknown
                else f"--workers must be at least 1, got {args.workers}")
    args.servers = args.servers or ("in-turn" if args.dry_run and not args.routers else "together")
    together = args.servers == "together"
    args.mem_fraction = args.mem_fraction or ("0.8" if together else "0.85")
    args.pool_tokens = args.pool_tokens or (150_000 if together and not args.dry_run else None)
    return args


def suite_label(args: argparse.Namespace, machine_info: dict[str, Any]) -> str:
    """What the run measured, in one line: the GPU it ran on (``machine_info`` as
    :func:`bench.harness.results.machine` gives it), the servers, the pool and the trajectories."""
    machine = ("CPU dry run, tiny random Qwen3 (FP32)" if args.dry_run
               else f"{results.gpu_label(machine_info)}, Qwen3-8B shape, dummy weights, bf16")
    pool = f", pool {args.pool_tokens} tokens each" if args.pool_tokens else ""
    if args.routers:
        from akv.system.launch_router import ROUTER_PIN

        return (f"{machine}; {args.workers} patched workers ({args.akv_backend} attention"
                f"{', --akv-protect-live' if args.protect_live else ''}"
                f"{'' if args.dry_run else f', --mem-fraction-static {args.mem_fraction}'}{pool}) behind smg "
                f"{ROUTER_PIN}, policies {', '.join(args.routers)}; keep {args.keep}, {args.count} {args.preset} "
                f"trajectories from turn {args.start_turn}"
                f"{' (primed: measured from the next turn)' if args.prime else ''}, output cap "
                f"{args.max_output_tokens or 'none'}")
    return (f"{machine}"
            f"; stock SGLang 0.5.16 ({args.backend} attention) for the text methods, the patched server "
            f"({args.akv_backend} attention{', --akv-protect-live' if args.protect_live else ''}) for AKV, "
            f"{args.servers}{pool}; thresholds {args.thresholds}, keep "
            f"{args.keep}, {args.count} {args.preset} trajectories from turn {args.start_turn}"
            f"{' (primed: measured from the next turn)' if args.prime else ''}, output cap "
            f"{args.max_output_tokens or 'none'}")


def log(message: str, started: float) -> None:
    """A progress line on stdout, and on the file descriptor AKV_REPLAY_PROGRESS_FD when set (run.sh
    keeps its own stdout as fd 3 while a benchmark's output goes to a log file)."""
    line = f"[replay_suite {time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - started:.0f}s] {message}"
    print(line, flush=True)
    fd = os.environ.get("AKV_REPLAY_PROGRESS_FD")
    if fd:
        try:
            os.write(int(fd), (line + "\n").encode())
        except OSError:
            pass


# ------------------------------------------------------------------------------- setup ---


def make_model(args: argparse.Namespace) -> None:
    """The served model folder: Qwen3-8B shape with a 131,072-token window (no weights), or the tiny model."""
    if (args.model / "config.json").exists():
        return
    from akv.system.models.tiny import make_tiny_model

    if args.dry_run:
        make_tiny_model(args.model, seed=3)
        return
    make_tiny_model(args.model, arch="qwen3", seed=0, dtype="bfloat16", weights=False,
                    **{**QWEN3_8B_SHAPE, "max_position_embeddings": 131_072})


def make_sites(args: argparse.Namespace) -> None:
    """The stock site (unpacked from the carried archive on the H200; with --dry-run installed from
    the pinned wheel) and with --dry-run the patched one, rebuilt when the patch changes."""
    if not args.dry_run:
        servers.unpack_stock_site(args.stock_site)
        return
    servers.cpu_stock_site(args.stock_site)
    args.patched_site = servers.cpu_patched_site(args.work, args.patched_site)


def make_servers(args: argparse.Namespace) -> list[Server]:
    """The stock server (text methods) and the patched one (AKV)."""
    base = dict(os.environ)
    if args.dry_run:
        flags = [*servers.cpu_flags(args.pool_tokens or CPU_POOL_TOKENS), "--page-size", "1"]
    else:
        flags = [*GPU_FLAGS, "--mem-fraction-static", args.mem_fraction,
                 "--cuda-graph-max-bs", str(max(16, *args.levels))]
    if not args.dry_run and not args.prefill_graphs:
        flags = [*flags, "--cuda-graph-backend-prefill", "disabled"]
    if args.pool_tokens and not args.dry_run:
        flags = [*flags, "--max-total-tokens", str(args.pool_tokens)]
    if args.max_running:
        flags = [*flags, "--max-running-requests", str(args.max_running)]
    if args.dry_run and importlib.util.find_spec("prometheus_client") is not None:
        flags = [*flags, "--enable-metrics"]  # SGLang's /metrics needs it; the H200 image has it
    if args.dry_run:  # CPU: the shims first; the site; the machine's own PYTHONPATH last
        patched_path = servers.cpu_pythonpath(args.patched_site)
        stock_path = servers.cpu_pythonpath(args.stock_site, akv=False)
    else:  # the H200: PYTHONPATH holds the patched site, whose entry points a stock server must not see
        patched_path = os.pathsep.join([str(args.patched_site) if args.patched_site else os.environ.get("PYTHONPATH", ""),
                                        str(ROOT)])
        stock_path = str(args.stock_site)
    model = ["--model-path", str(args.model)]
    return [Server("stock", [sys.executable, "-m", "sglang.launch_server", *model, *flags, "--attention-backend",
                             args.backend], {**base, "PYTHONUNBUFFERED": "1", "PYTHONPATH": stock_path}, args.port,
                   args.logs / "server-stock.log"),
            Server("patched", [sys.executable, "-m", "akv.system.launch_server", *model, *flags, "--attention-backend",
                               args.akv_backend, *(["--akv-protect-live"] if args.protect_live else [])],
                   {**base, "PYTHONUNBUFFERED": "1", "PYTHONPATH": patched_path},
                   args.port + 1, args.logs / "server-patched.log")]


def make_workers(args: argparse.Namespace) -> list[Server]:
    """Router mode: ``--workers`` patched servers as :func:`make_servers` makes the patched one, named
    worker-0, worker-1, ... (ports: free ones on the CPU, 30100 + k on the GPU)."""
    patched = make_servers(args)[1]
    return [Server(f"worker-{k}", patched.argv, patched.env, free_port() if args.dry_run else args.port + k,
                   args.logs / f"server-worker-{k}.log") for k in range(args.workers)]


def make_router(args: argparse.Namespace, policy: str, workers: list[Server]) -> Server:
    """smg in front of ``workers`` with ``policy`` (:data:`ROUTER_POLICIES`), named router-POLICY: for
    affinity through ``python -m akv.system.launch_router`` (its defaults), for round_robin smg itself."""
    urls = [w.url for w in workers]
    command = (["-m", "akv.system.launch_router"] if policy == "affinity"
               else ["-m", "smg", "launch", "--policy", "round_robin"])
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))
    port = free_port() if args.dry_run else args.port + args.workers + ROUTER_POLICIES.index(policy)
    return Server(f"router-{policy}", [sys.executable, *command, "--worker-urls", *urls, "--log-level", "warn",
                                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                  {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}, port, args.logs / f"router-{policy}.log")


# ------------------------------------------------------------------------------ replay ---


def replay_args(args: argparse.Namespace, url: str) -> argparse.Namespace:
    """serve_replay's settings for this suite (its parser, so every default stays serve_replay's)."""
    standard, text = (int(x) for x in args.thresholds.split(","))
    argv = ["--url", url, "--model-path", str(args.model), "--preset", args.preset, "--count", str(args.count),
            "--start-turn", str(args.start_turn), "--standard-threshold", str(standard), "--text-threshold", str(text),
            "--keep", str(args.keep), "--timeout", str(args.timeout), "--out", str(args.out / "unused.json"), "-v",
            "--live-budget", str(args.live_budget)]
    if args.routers:  # smg routes by model name: the workers serve theirs under the model path
        argv += ["--model", str(args.model)]
    if args.turns:
        argv += ["--turns", str(args.turns)]
    if args.max_turns:
        argv += ["--max-turns", str(args.max_turns)]
    if args.max_output_tokens:
        argv += ["--max-output-tokens", str(args.max_output_tokens)]
    if args.prime:
        argv += ["--prime"]
    return serve_replay.parse_args(argv)


def warm_up(server: Server, trajectories: list, filler: Any, args: argparse.Namespace, started: float) -> dict:
    """One unmeasured request (the first trajectory's first replayed turn, its own tag), so that
    kernel compilation and first-use costs fall outside the runs."""
    conversation = prepare(trajectories[0], FullContext(), [0], filler, args.start_turn, f"{started}/warm-up")[0]
    conversation = dataclasses.replace(conversation, requests=tuple(
        dataclasses.replace(r, generated=min(r.generated, args.max_output_tokens or 16, 16))
        for r in conversation.requests[:1]))
    got, wall = replay(server.url, [conversation], 1, "default", filler, args.timeout)
    return {"seconds": round(wall, 2), "prompt_tokens": got[0].prompt_tokens if got else None,
            "error": got[0].error if got else "no request"}


def write(args: argparse.Namespace, result: dict[str, Any], levels: list[int]) -> None:
    result["ratios"] = ratios(result["rows"])
    result["router_ratios"] = router_ratios(result["rows"])
    result["ratios_text_engineering"] = ratios(result["rows"], against="text_engineering")
    result["best"] = {m: best(result["rows"], m) for m in dict.fromkeys(r["method"] for r in result["rows"])}
    results.write(result, args.out / "replay_suite.json")
    (args.out / "replay_suite.md").write_text(markdown(result), encoding="utf-8")
    if any(r.get("requests") for r in result["rows"]):
        (args.out / "replay_suite.svg").write_text(svg(result["rows"], levels), encoding="utf-8")


@dataclass
class Suite:
    """One suite run: settings, the realized trajectories, the result being written, the clock, and
    the servers it was handed already running (``main``'s ``attached``)."""

    args: argparse.Namespace
    trajectories: list
    filler: Any
    levels: list[int]
    result: dict[str, Any]
    started: float
    status: int = 0
    tails: dict[int, float] = field(default_factory=dict)
    launched: dict[str, float] = field(default_factory=dict)
    attached: frozenset[str] = frozenset()

    def elapsed(self) -> float:
        return time.time() - self.started

    def note(self, text: str, failed: bool = True) -> None:
        self.result["notes"].append(text)
        self.status = self.status or int(failed)
        log(text, self.started)

    def launch(self, server: Server) -> None:
        if server.name in self.attached:
            log(f"{server.name}: attached: {server.command}", self.started)
            return
        log(f"{server.name}: starting: {server.command}", self.started)
        self.launched[server.name] = time.time()
        server.start()

    def ready(self, server: Server) -> bool:
        """Wait for `server`'s /health (unless attached) and send the warm-up request; False (noted) on
        failure."""
        if server.name in self.attached:
            started = {"attached": True}
        else:
            try:
                server.wait(self.args.ready_timeout)
            except (RuntimeError, TimeoutError, OSError) as exc:
                server.stop()
                self.result["servers"][server.name] = {"command": server.command, "error": str(exc)[-2000:]}
                self.note(f"{server.name} server did not start: {str(exc)[:300]}")
                return False
            started = {"startup_s": round(time.time() - self.launched[server.name], 1)}
        warmup = warm_up(server, self.trajectories, self.filler, self.args, self.started)
        self.result["servers"][server.name] = {"command": server.command, **started, "warmup": warmup}
        log(f"{server.name}: ready ({started}); warm-up request {warmup}", self.started)
        return True

    def router_ready(self, router: Server, workers: list[Server]) -> bool:
        """Wait until smg at ``router`` reports every worker healthy; False (noted) on failure."""
        deadline = time.time() + self.args.ready_timeout
        while client.healthy_workers(router.url) < len(workers):
            if router.process.poll() is not None or time.time() > deadline:
                tail = router.log_path.read_text()[-1500:] if router.log_path.exists() else ""
                router.stop()
                self.result["servers"][router.name] = {"command": router.command, "error": tail}
                self.note(f"{router.name}: not ready with {len(workers)} healthy workers: {tail[-300:]}")
                return False
            time.sleep(0.5)
        self.result["servers"][router.name] = {"command": router.command,
                                               "startup_s": round(time.time() - self.launched[router.name], 1)}
        log(f"{router.name}: ready, {len(workers)} workers healthy", self.started)
        return True

    def stop(self, server: Server) -> None:
        """Stop `server` unless it was attached."""
        if server.name not in self.attached:
            server.stop()

    def replay_phase(self, server: Server, methods: list, phase_end: float, workers: list[Server] = ()) -> None:
        """Every (method, concurrency) of one server, each starting new requests for its share of the
        time left before `phase_end`, less the tail (requests still in flight) seen at its level. With
        `workers`, `server` is a router in front of them (its rows name its policy)."""
        runs = [(m, c) for c in self.levels for m in methods]  # level by level: a deadline cuts the highest
        settings = replay_args(self.args, server.url)
        for k, (method, level) in enumerate(runs):
            tail = self.tails.get(level, max(self.tails.values(), default=0.0))
            if self.elapsed() + MIN_RUN_S + tail > self.args.deadline_s:
                self.note(f"{server.name}: {method.name} c={level} skipped: it would end past the "
                          f"{self.args.deadline_s:.0f} s deadline")
                continue
            run_s = max(MIN_RUN_S, (phase_end - time.time()) / (len(runs) - k) - tail)
            log(f"{server.name}: {method.name} c={level}: new requests for {run_s:.0f} s", self.started)
            row, got = serve_replay.run_one(server.url, self.trajectories, self.filler, method, level, settings,
                                            f"{self.started}/{server.name}/{method.name}/{level}", run_s,
                                            [w.url for w in workers])
            self.tails[level] = max(0.0, row["total_s"] - run_s)
            backend = self.args.backend if server.name == "stock" else self.args.akv_backend
            router = {"router": server.name.removeprefix("router-")} if workers else {}
            row = {"server": server.name, **router, "backend": backend,
                   "summary_requests": sum(s.kind == "summary" for s in got), **row}
            self.result["rows"].append(row)
            log(serve_replay.progress_line(row).strip(), self.started)
            write(self.args, self.result, self.levels)

    def phase_end(self, runs_now: int, runs_later: int, starts_later: int, startup_s: float) -> float:
        """When this phase should end: its share (by runs) of the planned time left."""
        left = self.args.target_s - self.elapsed() - starts_later * (startup_s + 10)
        return time.time() + max(0.0, left) * runs_now / max(1, runs_now + runs_later)


def merged(paths: list[Path]) -> tuple[dict[str, Any], list[int]]:
    """The runs in ``paths`` as one result (see ``--merge``) and their concurrency levels; ValueError
    naming the file when the runs differ in commit or GPU."""
    runs = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    first = runs[0]
    for path, run in zip(paths[1:], runs[1:]):
        for key in ("commit", "machine"):
            mine, theirs = (first[key]["gpus"], run[key]["gpus"]) if key == "machine" else (first[key], run[key])
            if mine != theirs:
                raise ValueError(f"--merge: {path} has {key} {theirs!r}, {paths[0]} has {mine!r}")
    points: dict[tuple[str, int], dict[str, Any]] = {}
    notes = [f"run {i + 1} ({path.name}, {run['date']}): {run['label']}"
             for i, (path, run) in enumerate(zip(paths, runs))]
    for i, run in enumerate(runs):
        notes += [f"run {i + 1}: {n}" for n in run.get("notes", [])]
        for row in run["rows"]:
            key = (row["method"], row["concurrency"], row.get("router"))
            if key in points and points[key].get("requests"):
                name = f"{key[0]} ({key[2]})" if key[2] else key[0]
                notes.append(f"{name} c={key[1]} measured again in run {i + 1}: "
                             f"{points[key]['output_tok_per_s']:.1f} "
                             f"then {row.get('output_tok_per_s') or 0:.1f} output tok/s; the later is kept")
            points[key] = row
    rows = sorted(points.values(), key=lambda r: (r["server"] != "patched", r["concurrency"], r["method"]))
    levels = sorted({r["concurrency"] for r in rows})
    result = {**first, "merged_from": [{"file": p.name, "date": r["date"], "command": r["command"],
                                        **{k: r[k] for k in ("device_command", "label_corrected") if k in r},
                                        "knobs": r.get("knobs", {})} for p, r in zip(paths, runs)],
              "rows": rows, "notes": notes, "label": first["label"] + f"; {len(runs)} runs joined"}
    result.pop("total_s", None)
    return result, levels


def replay_routers(suite: Suite, workers: list[Server], phases: list, n_runs: list[int]) -> None:
    """Router mode: start the workers (all at once), then each router in turn, replaying its methods
    through it, and stop it before the next one starts."""
    for worker in workers:
        suite.launch(worker)
    if not all([suite.ready(worker) for worker in workers]):
        suite.note("router mode: a worker did not start; no router started")
        return
    for p, (router, methods) in enumerate(phases):
        if suite.elapsed() > suite.args.deadline_s:
            suite.note(f"{router.name}: not started, past the {suite.args.deadline_s:.0f} s deadline")
            continue
        suite.launch(router)
        try:
            if suite.router_ready(router, workers):
                suite.replay_phase(router, methods, suite.phase_end(n_runs[p], sum(n_runs[p + 1:]), 0, 0.0), workers)
        finally:
            suite.stop(router)


def main(argv: list[str] | None = None, attached: dict[str, Server] | None = None) -> int:
    """``attached``: servers already running, by the name :func:`make_servers` (or in router mode
    :func:`make_workers`) gives them ("stock", "patched", "worker-0", ...), which this run uses instead
    of launching its own and does not stop (the replay
    tests on the CPU run the dry run on servers they share with another test)."""
    attached = attached or {}
    started = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run.sh's timeout: stop the servers, keep the rows
    args = parse_args(argv)
    if args.merge:
        try:
            result, levels = merged(args.merge)
        except (OSError, ValueError, KeyError) as e:
            print(f"replay_suite: {e}", file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        write(args, result, levels)
        print(markdown(result))
        return 0
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    levels = args.levels
    log(f"settings {json.dumps(settings)}", started)
    make_model(args)
    make_sites(args)
    log(f"model {args.model}, stock site {args.stock_site}, patched site {args.patched_site or 'PYTHONPATH'}", started)
    stock, patched = (attached.get(server.name, server) for server in make_servers(args))
    workers = [attached.get(w.name, w) for w in make_workers(args)] if args.routers else []
    if args.routers:  # the AKV methods through each router in turn, in front of the same workers
        routers = [make_router(args, policy, workers) for policy in args.routers]
        akv = serve_replay.choose_methods(args.akv_methods, replay_args(args, routers[0].url))
        phases = [(router, akv) for router in routers if akv]
    else:  # AKV first, Standard first among the text methods: a deadline cuts the last text methods' highest levels
        phases = [(patched, serve_replay.choose_methods(args.akv_methods, replay_args(args, patched.url))),
                  (stock, serve_replay.choose_methods(args.stock_methods, replay_args(args, stock.url)))]
    phases = [(server, methods) for server, methods in phases if methods]
    prepared = replay_args(args, stock.url)
    trajectories, filler = serve_replay.with_messages(serve_replay.load_trajectories(prepared), prepared)
    log(f"{len(trajectories)} trajectories realized; {[(s.name, [m.name for m in ms]) for s, ms in phases]}; "
        f"concurrency {levels}; servers {args.servers}", started)
    header = results.header("bench/replay_suite.py", argv)
    label = suite_label(args, header["machine"])
    result: dict[str, Any] = {
        **header,
        "knobs": {k: v for k, v in os.environ.items() if k.startswith("AKV_REPLAY_")},
        "settings": settings, "label": label,
        "goals": GOALS, "trajectories": [t.stats() for t in trajectories], "servers": {}, "rows": [], "notes": []}
    suite = Suite(args, trajectories, filler, levels, result, started,
                  attached=frozenset(server.name for server in attached.values()))
    n_runs = [len(methods) * len(levels) for _, methods in phases]
    try:
        if workers:
            replay_routers(suite, workers, phases, n_runs)
        elif args.servers == "together":
            for server, _ in phases:
                suite.launch(server)
            up = [server for server, _ in phases if suite.ready(server)]
            end = suite.phase_end(sum(n_runs), 0, 0, 0.0)
            for p, (server, methods) in enumerate(phases):
                if server in up:
                    suite.replay_phase(server, methods, time.time() + (end - time.time()) * n_runs[p] / sum(n_runs[p:]))
        else:
            startup_s = 60.0 if args.dry_run else 120.0
            for p, (server, methods) in enumerate(phases):
                if suite.elapsed() > args.deadline_s:
                    suite.note(f"{server.name}: not started, past the {args.deadline_s:.0f} s deadline")
                    continue
                suite.launch(server)
                if not suite.ready(server):
                    continue
                startup_s = result["servers"][server.name].get("startup_s", 0.0)
                end = suite.phase_end(n_runs[p], sum(n_runs[p + 1:]), len(phases) - p - 1, startup_s)
                try:
                    suite.replay_phase(server, methods, end)
                finally:
                    suite.stop(server)
                    log(f"{server.name}: {'left running' if server.name in attached else 'stopped'}", started)
    finally:
        for server in [*(server for server, _ in phases), *workers]:
            suite.stop(server)
        result["total_s"] = round(time.time() - started, 1)
        write(args, result, levels)
    log("\n" + (args.out / "replay_suite.md").read_text(), started)
    log(f"done in {result['total_s']:.0f} s; wrote {sorted(p.name for p in args.out.glob('replay_suite.*'))} to "
        f"{args.out}", started)
    return suite.status


if __name__ == "__main__":
    raise SystemExit(main())
