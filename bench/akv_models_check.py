"""On the H200: the gpt-oss and MiniMax-M2 families on the patched server (issues #14, #15), in
order of priority, each part written to ``$AKV_BENCH_OUT/akv_models_check.json`` as it ends:

1. ``gpt_oss_tiny``: gpt-oss-tiny (bf16 weights, sliding window 128 on even layers, sinks, YaRN,
   MoE) on the patched server (bf16, triton, ``--reasoning-parser gpt-oss --tool-call-parser
   gpt-oss``, no CUDA graphs) against the exact reference server (FP32, same weights file), with
   bench.harness.oracle's requests and bounds: context requests' log-prob error within 1.5x the
   plain requests', tokens equal wherever the reference's top-2 margin exceeds it, usage equal.
   Plain requests are compared on their first token only: stock SGLang's triton decode reads one
   sliding-window key fewer than the contract (sgl-project/sglang#32087), AKV's context requests not.
   Tool results of 30/30/3/3/30/3/3/30 fields (~130 or ~25 tokens): the drops of turns 3 and 6
   lie inside the generation prompt's window, the others outside it (inside the window of the
   first queries after them); turns 3, 5, 7 reposition after drops.
2. ``minimax_tiny``: the same for minimax-m2-tiny (``--tool-call-parser minimax-m2
   --reasoning-parser minimax-append-think``, MiniMax's SGLang guide).
3. ``gpt_oss_20b``: the 20b shape, ``--load-format dummy``, bf16: patched and stock 0.5.16 (both
   with ``--disable-hybrid-swa-memory``) at once; akv_8b_check.py's checks: plain requests
   token-identical to stock, a 10-turn tool conversation with drops and repositions that reports
   the AKV usage counters on every context turn, and the exact-equivalence case.
4. ``minimax_dummy``: the same for the 62-layer, 64-expert MiniMax-M2 shape in FP8 (the maker's
   default; bf16 would need ~112 GB per server), both servers at once with small KV pools.
5. ``gpt_oss_120b`` (only when named in AKV_MODELS_PARTS; issue #35): the 120b shape in mxfp4
   (``--load-format dummy``, ``--moe-runner-backend marlin``, ~65 GB of weights), the patched server
   alone, then stock alone: the same checks, plain tokens compared across the two runs. Not yet run;
   its device call: ``AKV_MODELS_PARTS=gpt_oss_120b`` with the command below.

The models are made here (``akv.system.models``) from the PyPI-file cache carried in
``.devkit/models-cache`` (``tools/gpu/model_cache.sh``; the makers are deterministic: the same seed
gives the same bytes). The servers of parts 1-3 start together at the beginning (the tiny ones
without CUDA graphs, the big ones with decode graphs up to batch 4 unless AKV_MODELS_BIG_GRAPHS=0);
part 4's start once part 3's are stopped. A part that would not end before the deadline
(AKV_MODELS_DEADLINE_S, default 470 s from the start; 2,400 s for the dry run) is skipped and says so.

Device call (carry [".devkit"] after tools/gpu/prepare.sh or model_cache.sh; timeout_s 600). Measured
on 2026-12-01 (bench/results/akv-models-check-h200.json): run.sh's install and import check ~35 s,
then this script 311 s: the 20b pair ready at +135 s, parts 1-3 done at +167 s, the FP8 MiniMax pair
ready 100 s after its launch, part 4 done at +298 s. Knobs AKV_MODELS_PARTS=gpt_oss_tiny,... and
AKV_MODELS_BIG_GRAPHS=0::

    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH="bench/akv_models_check.py" DEADLINE_S=570 bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt

CPU dry run (parts 1-2 with the CPU servers of tests/sglang_cpu, FP32; 13.5 minutes on the 2-core
machine, the build included; gpt-oss's server is ready after 266 s there, over 420 s under CI's load)::

    python bench/akv_models_check.py --dry-run [--work DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from akv import cli  # noqa: E402
from bench import akv_8b_check as big  # noqa: E402
from bench import router_ties  # noqa: E402
from bench.harness import client, oracle, results, servers  # noqa: E402
from bench.harness.models import as_float32  # noqa: E402

PARSERS = {"gpt-oss": ["--reasoning-parser", "gpt-oss", "--tool-call-parser", "gpt-oss"],
           "minimax": ["--reasoning-parser", "minimax-append-think", "--tool-call-parser", "minimax-m2"]}
GPU_TINY = ["--dtype", "bfloat16", "--attention-backend", "triton", "--disable-cuda-graph", "--sampling-backend",
            "pytorch", "--max-total-tokens", "32768", "--mem-fraction-static", "0.9", "--enable-cache-report"]
CPU_TINY = [*servers.cpu_flags(8192), "--max-running-requests", "16"]
"""A few running requests, since each req_to_token row holds AKV_MAX_TEXT_TOKENS (4x the context)."""
BIG = ["--load-format", "dummy", "--dtype", "bfloat16", "--attention-backend", "triton", "--page-size", "1",
       "--sampling-backend", "pytorch", "--enable-cache-report", "--context-length", "32768",
       "--disable-hybrid-swa-memory"]
BIG_MEMORY = {"gpt_oss_20b": ["--mem-fraction-static", "0.8", "--max-total-tokens", "65536",
                              "--chunked-prefill-size", "8192"],
              "minimax_dummy": ["--mem-fraction-static", "0.92", "--max-total-tokens", "16384",
                                "--chunked-prefill-size", "4096"]}
"""Servers share the GPU: SGLang leaves (1 - mem-fraction-static) x the memory free at its start
unused and sizes its KV pool from what is free then, so every server takes a high fraction and an
explicit --max-total-tokens (20b: 65536 x 48 KiB; MiniMax: 16384 x 248 KiB, next to 2 x ~61 GB FP8)."""
BIG_MEMORY["gpt_oss_120b"] = ["--mem-fraction-static", "0.85", "--max-total-tokens", "65536",
                               "--chunked-prefill-size", "8192", "--moe-runner-backend", "marlin"]
"""120b in mxfp4 (~65 GB of weights): one server at a time; SGLang 0.5.16 runs mxfp4 MoE on sm90 with
the marlin runner (or flashinfer_mxfp4) when the triton_kernels package is absent (research notes)."""
BIG_ENV = {"gpt_oss_20b": {}, "gpt_oss_120b": {}, "minimax_dummy": {"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}}
"""FP8 block GEMMs on triton rather than DeepGEMM, whose precompile at startup takes minutes."""
PLAIN_TOKENS = {"gpt_oss_tiny": 1}
"""Plain gpt-oss requests keep stock SGLang's window: its extend reads the contract's window, its
triton decode one key fewer (sgl-project/sglang#32087, akv.system.adapter.window_lists), so plain
requests are compared with the reference on their first token (prefill) only, and the bound they set
applies to the context requests' first tokens; the context requests' greedy tokens are compared on all.
Plain requests ask for only the tokens compared (on both servers: no decode step that nothing reads)."""
TIE_GAP = 0.006
"""MiniMax-M2 routes each token to the top-k experts of ``sigmoid(gate x) + bias``; where the exact
reference's k-th and (k+1)-th scores are closer than this at some layer, bf16 arithmetic may pick the
other expert (it moved this model's gaps by up to ~0.0057 against FP32: bench/router_ties.py), and
that token's log-probs move far beyond bf16 noise in plain and context requests alike. Tokens from
the first such one on are not compared; a first token at such a tie must match the reference with
either expert (the one it chose, or the next one swapped in)."""
CHECKS = {"AKV_CHECK_HOST_ROWS": "1"}
"""The tiny servers check every host row the radix backend publishes against the device's ``req_to_token``."""
CPU_BOUND_FLOOR = 1e-3
"""Dry run only: in FP32 on the CPU plain and context errors are both noise (~1e-5)."""
ESTIMATE_S = {"gpt_oss_tiny": 150, "minimax_tiny": 60, "gpt_oss_20b": 120, "minimax_dummy": 200, "gpt_oss_120b": 420}
"""Seconds each part needs from its turn (its servers' startup included where it is not yet done;
gpt_oss_120b's two servers start one after the other: an estimate, not yet measured)."""
DEFAULT_PARTS = ("gpt_oss_tiny", "minimax_tiny", "gpt_oss_20b", "minimax_dummy")
"""gpt_oss_120b runs only when named (AKV_MODELS_PARTS=gpt_oss_120b): it needs a call of its own."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli.parser(None, __doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: parts 1-2 on the CPU servers of tests/sglang_cpu")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("AKV_BENCH_OUT", "models-check-out")))
    p.add_argument("--work", type=Path, default=ROOT / "build" / "akv-models-check",
                   help="models (and with --dry-run the CPU sites) are made here")
    p.add_argument("--deadline-s", type=float, default=float(os.environ.get("AKV_MODELS_DEADLINE_S", "470")))
    p.add_argument("--ready-timeout", type=float, default=float("inf"),
                   help="seconds to wait for a server's /health (default: until the deadline; on the CPU gpt-oss's "
                        "warm-up request compiles its MoE routing with inductor, which takes minutes)")
    p.add_argument("--parts", default=os.environ.get("AKV_MODELS_PARTS", ",".join(DEFAULT_PARTS)),
                   help=f"comma-separated parts to run (default {','.join(DEFAULT_PARTS)}; also gpt_oss_120b); "
                        "the others are skipped")
    p.add_argument("--big-graphs", type=int, choices=(0, 1), default=int(os.environ.get("AKV_MODELS_BIG_GRAPHS", "1")))
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    results.refuse_existing(p, args.out / "akv_models_check.json")
    args.parts = args.parts.split(",")
    unknown = set(args.parts) - set(ESTIMATE_S)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {list(ESTIMATE_S)}")
    if args.dry_run and args.deadline_s == p.get_default("deadline_s"):
        args.deadline_s = 2400.0
    return args


class Run:
    """The report being written, the clock, and the servers alive."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.started = args, time.time()
        self.report: dict[str, Any] = {**results.header("bench/akv_models_check.py", args.argv),
                                       "dry_run": args.dry_run, "deadline_s": args.deadline_s, "parts": {},
                                       "servers": {}}
        self.servers: dict[str, servers.Server] = {}
        self.launched: dict[str, float] = {}
        self.attached: dict[str, servers.Server] = {}
        """Servers this run neither launched nor stops (``main``'s ``attached``)."""

    def left(self) -> float:
        return self.args.deadline_s - (time.time() - self.started)

    def log(self, message: str) -> None:
        print(f"[akv_models_check {time.strftime('%H:%M:%S', time.gmtime())} +{time.time() - self.started:.0f}s] "
              f"{message}", flush=True)

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.started, 1)
        results.write(self.report, self.args.out / "akv_models_check.json")

    def launch(self, name: str, module: str, model: Path, flags: list[str], env: dict[str, str], port: int) -> None:
        self.launched[name] = time.time()
        self.servers[name] = servers.launch(name, module, model, flags, env, port, self.args.out / f"server-{name}.log")
        self.report["servers"][name] = {"command": self.servers[name].command}
        self.log(f"{name}: starting")

    def ready(self, name: str) -> servers.Server:
        if name in self.attached:
            return self.attached[name]
        server = self.servers[name]
        server.wait(max(10.0, min(self.args.ready_timeout, self.left())))
        if "startup_s" not in self.report["servers"][name]:
            self.report["servers"][name]["startup_s"] = round(time.time() - self.launched[name], 1)
            self.log(f"{name}: ready after {self.report['servers'][name]['startup_s']} s")
        return server

    def stop(self, *names: str) -> None:
        """Stop these servers, all at once (each waits for its whole process group to end)."""
        stopping = [threading.Thread(target=self.servers.pop(name).stop) for name in names if name in self.servers]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()

    def part(self, name: str, check: Callable[[], dict[str, Any]], need_s: float | None = None) -> None:
        """Run ``check`` unless it is not asked for or would need more than the time left (``need_s``,
        default ``ESTIMATE_S[name]``); its result (or why not) goes into the report, written at once."""
        need_s = ESTIMATE_S[name] if need_s is None else need_s
        if name not in self.args.parts:
            self.report["parts"][name] = {"ok": None, "skipped": "not in --parts"}
        elif self.left() < need_s:
            self.report["parts"][name] = {"ok": None, "skipped": f"needs ~{need_s:.0f} s, {self.left():.0f} s "
                                                                 "left before the deadline"}
        else:
            started = time.time()
            cut = f"started at +{started - self.started:.0f} s, not finished"
            self.report["parts"][name] = {"ok": None, "cut": cut}
            self.write()
            try:
                self.report["parts"][name] = check()
            except Exception as exc:  # noqa: BLE001 - record it and go on to the next part
                self.report["parts"][name] = {"ok": False, "error": repr(exc)[-3000:]}
            self.report["parts"][name]["seconds"] = round(time.time() - started, 1)
        self.log(f"{name}: {json.dumps(self.report['parts'][name])[:400]}")
        self.write()


def make_models(folder: Path, names: tuple[str, ...], dry_run: bool) -> dict[str, Path]:
    """Model folders (the tiny ones with weights, the big ones config-only) from the carried cache."""
    from akv.system.models.gpt_oss import make_gpt_oss_model
    from akv.system.models.minimax_m2 import make_minimax_m2_dummy, make_minimax_m2_tiny

    cache = ROOT / ".devkit" / "models-cache"
    if cache.is_dir() and not os.environ.get("AKV_CACHE_DIR"):
        os.environ["AKV_CACHE_DIR"] = str(cache)
    makers = {"gpt_oss_tiny": lambda: make_gpt_oss_model(folder / "gpt-oss-tiny", dtype="bfloat16", seed=0),
              "minimax_tiny": lambda: make_minimax_m2_tiny(folder / "minimax-m2-tiny", dtype="bfloat16", seed=0),
              "gpt_oss_20b": lambda: make_gpt_oss_model(folder / "gpt-oss-20b", shape="20b", weights=False),
              "gpt_oss_120b": lambda: make_gpt_oss_model(folder / "gpt-oss-120b", shape="120b", weights=False,
                                                         mxfp4=True),
              "minimax_dummy": lambda: make_minimax_m2_dummy(folder / "minimax-m2-dummy")}
    models = {name: makers[name]() for name in names}
    if dry_run:
        for path in models.values():
            as_float32(path)
    return models


def check_tiny(run: Run, name: str, model: Path) -> dict[str, Any]:
    """Part 1 or 2: the patched server against the reference server on the same weights."""
    server = run.ready(name)
    rows, swaps = {}, {}
    try:
        with oracle.reference_server(model, kv_slots=16384) as reference:
            engine = reference.engine
            probe = router_ties.RouterProbe(engine.model) if name == "minimax_tiny" else None
            for request, body in oracle.requests(oracle.WINDOW_WORDS):
                tokens = PLAIN_TOKENS.get(name) if request.startswith("plain") else None
                got = client.chat(server.url, body, tokens or 8)
                if probe is not None:
                    probe.calls = []
                want = client.chat(reference.url, body, tokens or 8)
                gaps = [] if probe is None else router_ties.token_gaps(
                    probe.calls, len(want["choices"][0]["logprobs"]["content"]), engine.model.config.num_layers)
                tie = next((i for i, layers in enumerate(gaps) if min(layers) < TIE_GAP), None)
                if tie is not None and (tokens is None or tie < tokens):
                    tokens = tie
                rows[request] = row = oracle.compare(got, want, 1 if tokens == 0 else tokens)
                if tie is not None:
                    row["router_tie"] = {"token": tie, "gap": min(gaps[tie])}
                if tie == 0:  # nothing to score by log-prob: checked against the swapped expert below
                    row.update(unswapped_first_token_error=row["first_token_error"], error=0.0, first_token_error=None,
                               agree=0, n=0, margin_at_split=None, split_tokens=None)
                    swaps[request] = (body, got, [layer for layer, gap in enumerate(gaps[0]) if gap < TIE_GAP])
                run.log(f"{request}: {row['error']:.3f} agree {row['agree']}/{row['n']}"
                        + (f" (router tie at token {tie}: gap {min(gaps[tie]):.5f})" if tie is not None else ""))
            for request, (body, got, layers) in swaps.items():  # after the sequence: a swap flushes the cache
                rows[request]["router_tie"]["swapped"] = swapped_first_token(engine, probe, body, got, layers)
    finally:
        run.stop(name)
    result = oracle.verdict(rows, CPU_BOUND_FLOOR if run.args.dry_run else 0.0,
                            first_token_bound=PLAIN_TOKENS.get(name) == 1)
    for request, row in rows.items():
        swapped = row.get("router_tie", {}).get("swapped")
        if swapped is not None:
            errors = [e for e in (swapped["error"], row["unswapped_first_token_error"]) if e is not None]
            if not errors or min(errors) > result["bound"]:
                result["failures"].append(
                    f"{request}: first token at a router tie, {row['unswapped_first_token_error']:.3f} from the "
                    f"reference and {swapped['error']} from it with the expert swapped (bound {result['bound']:.3f})")
    context_first = [r["first_token_error"] for n, r in rows.items()
                     if n.startswith("context") and r["first_token_error"] is not None]
    result["context_first_token_max_error"] = max(context_first) if context_first else None
    return {"ok": not result["failures"], "model": str(model), "plain_tokens_compared": PLAIN_TOKENS.get(name, "all"),
            "router_tie_gap": TIE_GAP if probe is not None else None, **result, "requests": rows}


def swapped_first_token(engine: Any, probe: Any, body: dict[str, Any], got: dict[str, Any],
                        layers: list[int]) -> dict[str, Any]:
    """The served first token against the reference's with the tied expert swapped at each of
    ``layers`` (where the last prompt token's router gap is below ``TIE_GAP``): the closest log-prob
    error (None when the served token is in no swapped top two)."""
    first = got["choices"][0]["logprobs"]["content"][0]
    best: dict[str, Any] = {"served": first["token"], "error": None}
    for layer in layers:
        top = router_ties.swapped_first_token(engine, probe, body, layer)
        if first["token"] in top:
            error = abs(top[first["token"]] - first["logprob"])
            if best["error"] is None or error < best["error"]:
                best = {"served": first["token"], "layer": layer, "swapped_top": top, "error": error}
    return best


def run_checks(run: Run, name: str, out: dict[str, Any],
               checks: tuple[tuple[str, Callable[[], dict[str, Any]]], ...]) -> None:
    """Each check's result into ``out`` under its name (a failure as ``ok: False`` with its error,
    and the next check still runs), logged."""
    for check, call in checks:
        try:
            out[check] = call()
        except Exception as exc:  # noqa: BLE001 - record it and go on to the next check
            out[check] = {"ok": False, "error": repr(exc)[-2000:]}
        run.log(f"{name} {check}: {json.dumps(out[check])[:300]}")


def check_big(run: Run, name: str, model: Path) -> dict[str, Any]:
    """Part 3 or 4: plain identity with stock, ten turns with drops and repositions, equivalence."""
    from transformers import AutoTokenizer

    patched, stock = run.ready(f"{name}_patched"), run.ready(f"{name}_stock")
    tokenizer = AutoTokenizer.from_pretrained(model)
    out: dict[str, Any] = {"model": str(model)}
    try:
        run_checks(run, name, out, (("plain_identity", lambda: big.check_plain_identity(patched, stock, tokenizer)),
                                    ("ten_turns", lambda: big.check_ten_turns(patched, tokenizer)),
                                    ("equivalence", lambda: big.check_equivalence(patched, tokenizer))))
    finally:
        run.stop(f"{name}_patched", f"{name}_stock")
    out["ok"] = bool(out["plain_identity"].get("ok") and out["ten_turns"].get("ok"))
    return out


def check_big_in_turn(run: Run, name: str, model: Path, launch: Callable[[str], None]) -> dict[str, Any]:
    """Part 5 (a model two servers cannot share the card with): the patched server alone serves the
    plain conversations, the ten turns and the equivalence case; then stock alone serves the plain
    conversations, whose tokens must equal the patched server's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out: dict[str, Any] = {"model": str(model)}
    replies: dict[str, list[dict[str, Any]]] = {}
    for side in ("patched", "stock"):
        launch(side)
        try:
            server = run.ready(f"{name}_{side}")
            replies[side] = big.plain_replies(server, tokenizer)
            if side == "patched":
                run_checks(run, name, out, (("ten_turns", lambda: big.check_ten_turns(server, tokenizer)),
                                            ("equivalence", lambda: big.check_equivalence(server, tokenizer))))
        finally:
            run.stop(f"{name}_{side}")
    out["plain_identity"] = big.compare_plain(replies["patched"], replies["stock"])
    out["ok"] = bool(out["plain_identity"]["ok"] and out["ten_turns"].get("ok"))
    return out


def main(argv: list[str] | None = None, attached: dict[str, tuple[servers.Server, Path]] | None = None) -> int:
    """``attached``: tiny parts checked on servers already running (part name -> the server and the
    FP32 model folder it serves, made by ``make_models``), which this run neither makes, launches
    nor stops: tests/sglang_cpu/test_demo_models.py runs the demo on the same servers first."""
    attached = attached or {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run.sh's timeout: stop the servers, keep the parts
    args = parse_args(argv)
    run = Run(args)
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    stock_site = args.work / "stock-site" if args.dry_run else servers.stock_site_default()
    unpack = None
    try:
        if args.dry_run:
            site = servers.cpu_pythonpath(servers.cpu_patched_site(args.work))
            patched_env, tiny_flags = {**base, "PYTHONPATH": site}, CPU_TINY
        else:
            unpack = threading.Thread(target=servers.unpack_stock_site, args=(stock_site,))
            unpack.start()
            patched_env, tiny_flags = {**base, "PYTHONPATH": os.environ["PYTHONPATH"]}, GPU_TINY
        models = make_models(args.work / "models", tuple(n for n in ("gpt_oss_tiny", "minimax_tiny")
                                                         if n in args.parts and n not in attached), args.dry_run)
        for name, (server, model) in attached.items():
            run.attached[name], models[name] = server, model
            run.report["servers"][name] = {"command": server.command, "attached": True}
        port = (lambda k: servers.free_port()) if args.dry_run else (lambda k: 30020 + k)
        patched = "akv.system.launch_server"
        for k, (name, parsers) in enumerate((("gpt_oss_tiny", "gpt-oss"), ("minimax_tiny", "minimax"))):
            if name in args.parts and name not in attached:
                run.launch(name, patched, models[name], [*tiny_flags, *PARSERS[parsers]], {**patched_env, **CHECKS},
                           port(k))
        graphs = ["--cuda-graph-max-bs", "4", "--cuda-graph-backend-prefill", "disabled"] if args.big_graphs else [
            "--disable-cuda-graph"]
        stock_env = {**base, "PYTHONPATH": str(stock_site)}

        def launch_one(name: str, side: str, parsers: list[str], k: int) -> None:
            flags = [*BIG, *BIG_MEMORY[name], *graphs, *parsers]
            module, env = (patched, patched_env) if side == "patched" else ("sglang.launch_server", stock_env)
            run.launch(f"{name}_{side}", module, models[name], flags, {**env, **BIG_ENV[name]}, port(k))

        def launch_big(name: str, parsers: list[str], k: int) -> None:
            launch_one(name, "patched", parsers, k)
            launch_one(name, "stock", parsers, k + 1)

        if not args.dry_run:
            models.update(make_models(args.work / "models", ("gpt_oss_20b", "minimax_dummy"), False))
            unpack.join()
            if "gpt_oss_20b" in args.parts:
                launch_big("gpt_oss_20b", PARSERS["gpt-oss"], 2)
        run.report["models"] = {k: json.loads((v / "config.json").read_text()) for k, v in models.items()}
        run.write()
        run.part("gpt_oss_tiny", lambda: check_tiny(run, "gpt_oss_tiny", models["gpt_oss_tiny"]))
        run.part("minimax_tiny", lambda: check_tiny(run, "minimax_tiny", models["minimax_tiny"]))
        if args.dry_run:
            for name in ("gpt_oss_20b", "minimax_dummy", "gpt_oss_120b"):
                run.report["parts"][name] = {"ok": None, "skipped": "dry run: H200 only"}
        else:
            run.part("gpt_oss_20b", lambda: check_big(run, "gpt_oss_20b", models["gpt_oss_20b"]))
            run.stop(*list(run.servers))
            started = "minimax_dummy" in args.parts and run.left() >= ESTIMATE_S["minimax_dummy"]
            if started:
                launch_big("minimax_dummy", PARSERS["minimax"], 4)
            run.part("minimax_dummy", lambda: check_big(run, "minimax_dummy", models["minimax_dummy"]),
                     0.0 if started else None)
            run.stop(*list(run.servers))
            if "gpt_oss_120b" in args.parts:
                models.update(make_models(args.work / "models", ("gpt_oss_120b",), False))
            run.part("gpt_oss_120b", lambda: check_big_in_turn(
                run, "gpt_oss_120b", models["gpt_oss_120b"],
                lambda side: launch_one("gpt_oss_120b", side, PARSERS["gpt-oss"], 6)))
    finally:
        run.stop(*list(run.servers))
        run.write()
    parts = run.report["parts"]
    run.log("summary " + json.dumps({k: v.get("ok") for k, v in parts.items()}))
    return 0 if all(v.get("ok") is not False for v in parts.values()) and parts else 1


if __name__ == "__main__":
    sys.exit(main())
