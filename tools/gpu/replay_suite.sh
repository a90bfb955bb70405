#!/usr/bin/env bash
# tools/gpu/replay_suite.sh -- every serving-replay method side by side in one run
# (bench/replay_suite.py: stock SGLang 0.5.16 replays the text methods, the patched server AKV,
# both servers up at once, Qwen3-8B shape with dummy weights and a 131,072-token window, FlashInfer).
#
# H200, one device call from the repository root (carry [".devkit"] made by tools/gpu/prepare.sh,
# timeout_s 600); about 6 minutes with the defaults:
#
#   set -o pipefail; bash tools/gpu/replay_suite.sh 2>&1 | tee $OUT/log.txt
#
# It runs tools/gpu/run.sh with SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH=bench/replay_suite.py:
# install, import check, models, then the suite. Files in $OUT: replay_suite.{json,md,svg},
# log.txt, summary.json, bench.tar.gz (server logs), extra.tar.gz (the suite's full log).
# Knobs: the AKV_REPLAY_* variables in bench/replay_suite.py's docstring, e.g.
#   AKV_REPLAY_CONCURRENCY=1,4,8,16,32 AKV_REPLAY_TARGET_S=420 AKV_REPLAY_START_TURN=40
#   AKV_REPLAY_BACKEND=triton (both servers on triton: the second row)
#
# Router mode (issue #33; not yet run on a GPU): two patched workers on the one GPU behind smg, the AKV
# methods through smg with conversation affinity, then through smg's round-robin. smg does not fit in a
# call next to the whole of .devkit: run tools/gpu/router_kit.sh after prepare.sh (it makes .routerkit/
# and checks the size), then one device call with
# carry [".devkit/site-py312.tar.xz", ".devkit/MANIFEST.txt", ".routerkit"], timeout_s 600:
#
#   set -o pipefail; AKV_REPLAY_ROUTER=affinity,round_robin AKV_REPLAY_BACKEND=triton \
#     AKV_REPLAY_CONCURRENCY=16 AKV_REPLAY_COUNT=16 bash tools/gpu/replay_suite.sh 2>&1 | tee $OUT/log.txt
#
# (no jitcache carried: each worker compiles SGLang's JIT kernels at its first start; triton attention
# needs no FlashInfer attention kernels, which took ~150 s more for the 8B shape.) Knobs:
# AKV_REPLAY_WORKERS (2), AKV_REPLAY_MEM_FRACTION (0.8) and AKV_REPLAY_POOL_TOKENS (150000, each worker).
#
# CPU dry run (this machine: tiny random Qwen3, CPU servers, a tiny trajectory set, ~5 minutes):
#
#   bash tools/gpu/replay_suite.sh --dry-run [--out DIR] [more bench/replay_suite.py flags]
#   bash tools/gpu/replay_suite.sh --dry-run --router affinity,round_robin   (router mode, smg on the CPU)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
if [ "${1:-}" = "--dry-run" ]; then
  shift
  exec python3 bench/replay_suite.py --dry-run "$@"
fi
export OUT=${OUT:-$ROOT/gpu-out}
export AKV_REPLAY_OUT=${AKV_REPLAY_OUT:-$OUT} AKV_REPLAY_PROGRESS_FD=3
SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH=bench/replay_suite.py exec bash tools/gpu/run.sh
