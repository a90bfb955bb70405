#!/usr/bin/env bash
# tools/gpu/run.sh -- one device call on the H200, from the repository root, with .devkit carried
# (made by tools/gpu/prepare.sh on the CPU machine). The jitcache archives are optional: a PD call
# carries .devkit's other parts by path and .devkit-pd (tools/gpu/pd_kit.sh says how) to stay under 64 MiB.
#
#   set -o pipefail; bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
#
# Steps (each printed with a timestamp): install the carried site archive + the AKV overlay into
# a fresh work folder (mktemp; removed at the end, nothing is written to a fixed shared path); check imports (sglang must be 0.5.16+akv); make the models (tiny Qwen3 with random
# safetensors weights, Qwen3-8B-shaped config for --load-format dummy); run `pytest -m gpu tests/`;
# start `python -m akv.system.launch_server` on the tiny model; run tools/gpu/smoke_client.py; run
# the benchmarks listed in AKV_BENCH_LIVE (server up) and AKV_BENCH (server stopped, GPU free): the
# scripts of bench/ (bench/harness is what they share).
#
# Files left in $OUT (at most 8 come back): log.txt (the caller's tee), summary.json (times,
# statuses, smoke results), pytest-gpu.log, server.log, extra.tar.gz (env.txt, junit xml, model
# configs, bench logs), bench.tar.gz (what benchmarks wrote to $AKV_BENCH_OUT), jitcache-akv.tar.xz
# (only with SAVE_JIT_CACHE=1: every kernel compiled or carried, to be copied into .devkit/ and carried
# next time).
#
# Knobs: AKV_BENCH / AKV_BENCH_LIVE  space-separated scripts, each run as `python SCRIPT` with
#          SGLANG_BASE_URL (live only), AKV_TINY_MODEL, AKV_MODEL_8B, AKV_BENCH_OUT, AKV_SITE (the patched
#          site) and AKV_STOCK_SITE (where a script unpacks stock SGLang) exported, all in the work folder
#        PYTEST_ARGS (default "-m gpu tests/"), PYTEST_TIMEOUT_S (default 240), SKIP_PYTEST=1, SKIP_SERVER=1,
#          PYTEST_TEST_TIMEOUT_S (per test, default 120), PYTEST_LIVE_ARGS (pytest arguments run while
#          the server is up, with SGLANG_BASE_URL, MODEL_DIR and AKV_SERVER=1 set)
#        SERVER_ARGS (default "--disable-cuda-graph --sampling-backend pytorch")
#        READY_TIMEOUT_S (default 300), DEADLINE_S (default 540: later steps are skipped after it)
#        PORT (default 30000), SAVE_JIT_CACHE (default 0)
#        ROUTER_KIT (default .routerkit, made by tools/gpu/router_kit.sh): where present, its smg-site.tar.xz
#          (smg for the router) is installed into the site, and its overlay.tar.xz when .devkit/overlay is
#          not carried (the router call carries only .devkit's site archive: see router_kit.sh)
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
KIT=$ROOT/.devkit
ROUTER_KIT=${ROUTER_KIT:-$ROOT/.routerkit}
OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/akv-run.XXXXXX") || exit 9
SITE=$WORK/site
CACHE=$WORK/jit-cache
TINY=$WORK/model-tiny
M8B=$WORK/model-8b
PORT=${PORT:-30000}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-300}
DEADLINE_S=${DEADLINE_S:-540}
PYTEST_TIMEOUT_S=${PYTEST_TIMEOUT_S:-240}
SERVER_ARGS=${SERVER_ARGS:---disable-cuda-graph --sampling-backend pytorch}
export AKV_BENCH_OUT=$WORK/bench AKV_TINY_MODEL=$TINY AKV_MODEL_8B=$M8B AKV_SITE=$SITE AKV_STOCK_SITE=$WORK/site-stock
mkdir -p "$WORK/logs" "$AKV_BENCH_OUT" "$CACHE"
T0=$(date +%s)
declare -A TIMES STATUS
SERVER_PID=""

exec 3>&1  # step lines go to the original stdout even inside redirected commands
elapsed() { echo $(( $(date +%s) - T0 )); }
step() { echo "[run.sh $(date -u +%H:%M:%S) +$(elapsed)s] $*" >&3; }
left() { echo $(( DEADLINE_S - $(elapsed) )); }
timed() {  # timed NAME CMD...: run, record seconds and exit status
  local name=$1 start rc; shift
  start=$(date +%s); "$@"; rc=$?
  TIMES[$name]=$(( $(date +%s) - start )); STATUS[$name]=$rc
  step "$name: exit $rc in ${TIMES[$name]}s"
  return $rc
}

stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  kill -TERM "$SERVER_PID" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$SERVER_PID" 2>/dev/null
  wait "$SERVER_PID" 2>/dev/null
  SERVER_PID=""
}

finish() {
  stop_server
  cp -f "$KIT"/MANIFEST.txt "$WORK/logs/" 2>/dev/null
  for m in "$TINY" "$M8B"; do [ -f "$m/config.json" ] && cp "$m/config.json" "$WORK/logs/$(basename "$m")-config.json"; done
  tar -C "$WORK/logs" -czf "$OUT/extra.tar.gz" . 2>/dev/null
  if [ -n "$(ls -A "$AKV_BENCH_OUT" 2>/dev/null)" ]; then tar -C "$AKV_BENCH_OUT" -czf "$OUT/bench.tar.gz" .; fi
  if [ "${SAVE_JIT_CACHE:-0}" = 1 ]; then  # loadable modules only: carried ones are never rebuilt
    tar -C "$CACHE" --exclude='*.o' --exclude='.ninja_deps' --exclude='generated' -cf - . | xz -T0 -6 \
      > "$OUT/jitcache-akv.tar.xz"
  fi
  python3 - "$OUT" "$WORK/smoke.json" <<PY
import json, os, sys
out, smoke = sys.argv[1], sys.argv[2]
summary = {
    "times_s": {$(for k in "${!TIMES[@]}"; do printf '"%s": %s, ' "$k" "${TIMES[$k]}"; done)},
    "exit_status": {$(for k in "${!STATUS[@]}"; do printf '"%s": "%s", ' "$k" "${STATUS[$k]}"; done)},
    "smoke": json.load(open(smoke)) if os.path.exists(smoke) else None,
    "server_args": "${SERVER_ARGS}",
    "total_s": $(elapsed),
}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2, sort_keys=True)
print("SUMMARY", json.dumps({k: summary[k] for k in ("times_s", "exit_status", "total_s")}, sort_keys=True))
PY
  step "done; files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
  rm -rf "$WORK"
}
trap finish EXIT

# ------------------------------------------------------------------ environment ---
PYBIN=$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')
export PATH="$PYBIN:$PATH"
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && export PATH="$PATH:$d" && break; done
fi
if command -v nvcc >/dev/null && [ -z "${CUDA_HOME:-}" ]; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TVM_FFI_CACHE_DIR=$CACHE/tvm-ffi TRITON_CACHE_DIR=$CACHE/triton FLASHINFER_WORKSPACE_BASE=$CACHE/flashinfer
{ date -u; nvidia-smi -L; python3 -V; nvcc --version 2>&1 | tail -1; echo "CUDA_HOME=${CUDA_HOME:-}"; } \
  > "$WORK/logs/env.txt" 2>&1
step "start: $(head -c 400 "$WORK/logs/env.txt" | tr '\n' ' ')"

# ---------------------------------------------------------------------- install ---
install_site() {
  [ -f "$KIT/site-py312.tar.xz" ] || { echo "missing $KIT/site-py312.tar.xz: run tools/gpu/prepare.sh and carry .devkit"; return 10; }
  [ -d "$KIT/overlay/sglang" ] || [ -f "$ROUTER_KIT/overlay.tar.xz" ] || { echo "missing $KIT/overlay: run tools/gpu/prepare.sh"; return 10; }
  mkdir -p "$SITE"
  if command -v xz >/dev/null; then
    xz -T0 -dc "$KIT/site-py312.tar.xz" | tar -x -C "$SITE" || return 11
  else
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2])" \
      "$KIT/site-py312.tar.xz" "$SITE" || return 11
  fi
  if [ -d "$KIT/overlay/sglang" ]; then cp -a "$KIT/overlay/." "$SITE/" || return 12
  else tar -xJf "$ROUTER_KIT/overlay.tar.xz" -C "$SITE" || return 12; fi
  if [ -f "$ROUTER_KIT/smg-site.tar.xz" ]; then tar -xJf "$ROUTER_KIT/smg-site.tar.xz" -C "$SITE" || return 12; fi
  find "$SITE/sglang" -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null
  local jit
  for jit in "$KIT/jitcache.tar.xz" "$KIT/jitcache-akv.tar.xz"; do
    if [ -f "$jit" ]; then tar -xJf "$jit" -C "$CACHE" || return 13; fi
  done
  install_flashinfer_aot
}

install_flashinfer_aot() {
  # FlashInfer runs ninja before loading a JIT module, and ninja rebuilds every carried module: the
  # site's headers are dated when the archive was built, later than the carried objects. A module
  # in FlashInfer's AOT folder is loaded as it is, so the carried ones go there.
  local so name
  for so in "$CACHE"/flashinfer/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] || continue
    name=$(basename "$(dirname "$so")")
    [ "$(basename "$so")" = "$name.so" ] || continue
    mkdir -p "$SITE/flashinfer/data/aot/$name" && cp -f "$so" "$SITE/flashinfer/data/aot/$name/" || return 14
  done
  echo "flashinfer AOT modules: $(ls "$SITE/flashinfer/data/aot" 2>/dev/null | wc -l)"
}
timed install install_site || exit 10
export PYTHONPATH="$SITE:$ROOT"

check_imports() {
  python3 - <<'PY' 2>&1 | tee -a "$WORK/logs/env.txt"
import importlib, sys, time
t0 = time.time()
import sglang
print("sglang", sglang.__version__, sglang.__file__)
assert sglang.__version__.endswith("+akv"), "the overlay did not install the AKV build"
for name in ["torch", "akv.system.adapter.serving", "sglang.srt.entrypoints.openai.protocol",
             "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler"]:
    importlib.import_module(name)
    print("import ok", name)
import torch
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print(f"imports {time.time() - t0:.1f}s")
PY
}
timed import_check check_imports || exit 11

# ----------------------------------------------------------------------- models ---
timed make_models python3 tools/gpu/make_models.py --tiny "$TINY" --qwen3-8b "$M8B" || exit 12

# ---------------------------------------------------------------------- pytest ---
if [ "${SKIP_PYTEST:-0}" != 1 ]; then
  read -r -a PYTEST_ARGV <<< "${PYTEST_ARGS:--m gpu tests/}"
  timed pytest_gpu timeout "$PYTEST_TIMEOUT_S" python3 -m pytest -q -rA --tb=short -p no:cacheprovider \
    --timeout="${PYTEST_TEST_TIMEOUT_S:-120}" "${PYTEST_ARGV[@]}" \
    --junitxml="$WORK/logs/pytest-gpu.xml" > "$OUT/pytest-gpu.log" 2>&1
  tail -n 25 "$OUT/pytest-gpu.log"
fi

# ----------------------------------------------------------------------- server ---
run_bench_list() {  # run_bench_list LABEL SCRIPTS...
  local label=$1 script name; shift
  for script in "$@"; do
    name=${label}_$(basename "$script" .py)
    if [ "$(left)" -lt 30 ]; then step "$name: skipped, deadline"; STATUS[$name]=skipped_deadline; continue; fi
    timed "$name" timeout "$(left)" python3 "$script" > "$WORK/logs/$name.log" 2>&1
    tail -n 15 "$WORK/logs/$name.log"
  done
}

start_server() {
  # shellcheck disable=SC2086
  local cmd="python3 -m akv.system.launch_server --model-path $TINY --host 127.0.0.1 --port $PORT \
    --tool-call-parser qwen --enable-cache-report --max-total-tokens 131072 $SERVER_ARGS"
  step "launch: $(echo $cmd | tr -s ' ')"
  # own process group, so stop_server can end the launcher and its scheduler/detokenizer together
  python3 -c 'import os, sys; os.setsid(); os.execvp("bash", ["bash", "-c", "exec " + sys.argv[1]])' "$cmd" \
    > "$OUT/server.log" 2>&1 < /dev/null &
  SERVER_PID=$!
  local wait_s=$(( $(left) - 60 < READY_TIMEOUT_S ? $(left) - 60 : READY_TIMEOUT_S ))
  for _ in $(seq 1 "$wait_s"); do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited early"; tail -n 40 "$OUT/server.log"; return 1; }
    if python3 -c "import urllib.request, sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "server not ready after ${wait_s}s"; tail -n 40 "$OUT/server.log"; return 1
}

if [ "${SKIP_SERVER:-0}" = 1 ]; then
  step "server: skipped (SKIP_SERVER=1)"; STATUS[server_ready]=skipped
elif [ "$(left)" -lt 120 ]; then
  step "server: skipped, only $(left)s left"; STATUS[server_ready]=skipped_deadline
elif timed server_ready start_server; then
  timed smoke python3 tools/gpu/smoke_client.py --base "http://127.0.0.1:$PORT" --json "$WORK/smoke.json"
  read -r -a LIVE <<< "${AKV_BENCH_LIVE:-}"
  export SGLANG_BASE_URL="http://127.0.0.1:$PORT"
  if [ -n "${PYTEST_LIVE_ARGS:-}" ]; then
    read -r -a LIVE_ARGV <<< "$PYTEST_LIVE_ARGS"
    timed pytest_live env MODEL_DIR="$TINY" AKV_SERVER=1 timeout "$(left)" python3 -m pytest -q -rA --tb=short \
      -p no:cacheprovider --timeout="${PYTEST_TEST_TIMEOUT_S:-120}" "${LIVE_ARGV[@]}" > "$OUT/pytest-live.log" 2>&1
    tail -n 25 "$OUT/pytest-live.log"
  fi
  run_bench_list live "${LIVE[@]}"
  unset SGLANG_BASE_URL
fi
stop_server

read -r -a OFFLINE <<< "${AKV_BENCH:-}"
run_bench_list bench "${OFFLINE[@]}"
ok=1
required="install import_check make_models"; [ "${SKIP_SERVER:-0}" = 1 ] || required="$required server_ready smoke"
for k in $required; do [ "${STATUS[$k]:-1}" = 0 ] || ok=0; done
[ "${STATUS[pytest_gpu]:-0}" = 0 ] || ok=0
for k in "${!STATUS[@]}"; do case $k in bench_*|live_*) [ "${STATUS[$k]}" = 0 ] || ok=0 ;; esac; done
[ $ok = 1 ]
