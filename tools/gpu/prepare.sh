#!/usr/bin/env bash
# tools/gpu/prepare.sh -- run on the CPU machine (needs PyPI), from anywhere in the repository.
#
# Fills the ignored folder .devkit/ with what tools/gpu/run.sh needs on the H200:
#   .devkit/site-py312.tar.xz, MANIFEST.txt  SGLang 0.5.16 + runtime closure for CPython 3.12
#                                            (devicekit's build-wheelhouse.sh; cached, ~1.5 min cold)
#   .devkit/jitcache.tar.xz                  kernels compiled on an H200 (from devicekit; left out when
#                                            .devkit/jitcache-akv.tar.xz, a later run's, is there)
#   .devkit/overlay/sglang/...               the files the AKV build changes, from the patched
#                                            cp312 wheel (python -m akv.system._build), copied over
#                                            the extracted site on the device
#   .devkit/models-cache/...                 the PyPI files the gpt-oss / MiniMax-M2 makers read
#                                            (tools/gpu/model_cache.sh, ~3.5 MiB)
# and checks that everything a device call carries stays under the 64 MiB limit.
#
# Knobs: DEVICEKIT (default /work/shared/devicekit, else ../shared/devicekit), FORCE_WHEELHOUSE=1,
#        AKV_DIST (where the patched wheel is written, default ~/.cache/akv/dist).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
KIT=$ROOT/.devkit
if [ -z "${DEVICEKIT:-}" ]; then
  for d in /work/shared/devicekit "$ROOT/../shared/devicekit"; do [ -d "$d" ] && DEVICEKIT=$d && break; done
fi
[ -d "${DEVICEKIT:-}" ] || { echo "devicekit folder not found; set DEVICEKIT=/path/to/shared/devicekit" >&2; exit 2; }
AKV_DIST=${AKV_DIST:-${XDG_CACHE_HOME:-$HOME/.cache}/akv/dist}
LIMIT_MIB=64
T0=$(date +%s)
step() { echo "[prepare $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

git check-ignore -q .devkit/ || { echo ".devkit/ is not ignored by git; add it to .git/info/exclude" >&2; exit 2; }

step "copy devicekit from $DEVICEKIT"
mkdir -p "$KIT"
for f in "$DEVICEKIT"/*; do
  cmp -s "$f" "$KIT/$(basename "$f")" || cp -f "$f" "$KIT/"
done
if [ -f "$KIT/jitcache-akv.tar.xz" ]; then  # brought back by run.sh SAVE_JIT_CACHE=1: holds devicekit's too
  step "jitcache: .devkit/jitcache-akv.tar.xz in place of devicekit's jitcache.tar.xz"
  rm -f "$KIT/jitcache.tar.xz"
fi

if [ "${FORCE_WHEELHOUSE:-0}" != 1 ] && [ -f "$KIT/site-py312.tar.xz" ] && [ -f "$KIT/MANIFEST.txt" ] \
   && [ "$KIT/site-py312.tar.xz" -nt "$KIT/build-wheelhouse.sh" ] \
   && grep -q "sha256 $(sha256sum "$KIT/site-py312.tar.xz" | cut -d' ' -f1)" "$KIT/MANIFEST.txt"; then
  step "wheelhouse: $KIT/site-py312.tar.xz is up to date, skipping"
else
  step "wheelhouse: building (devicekit build-wheelhouse.sh)"
  bash "$KIT/build-wheelhouse.sh" "$KIT"
fi

step "patched sglang wheel for cp312 -> overlay"
rm -rf "$KIT/overlay"
python3 -m akv.system._build --out "$AKV_DIST" --python-tag cp312 --overlay-out "$KIT/overlay"
find "$KIT/overlay" -type f | sed "s|^$KIT/|    |"

step "model makers' PyPI files -> .devkit/models-cache"
bash "$ROOT/tools/gpu/model_cache.sh"

step "sizes"
kit_bytes=$(du -sb "$KIT" | cut -f1)
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
total=$(( kit_bytes + tree_bytes ))
printf '    .devkit %d KiB, working tree %d KiB, total %d KiB (limit %d MiB)\n' \
  $(( kit_bytes / 1024 )) $(( tree_bytes / 1024 )) $(( total / 1024 )) "$LIMIT_MIB"
if [ "$total" -gt $(( (LIMIT_MIB - 2) * 1048576 )) ]; then
  echo "ERROR: a device call would carry $(( total / 1048576 )) MiB, too close to the $LIMIT_MIB MiB limit" >&2
  exit 3
fi
step "ready. Device call (carry [\".devkit\"], timeout_s 600):"
echo '    set -o pipefail; bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt'
