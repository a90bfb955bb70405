#!/usr/bin/env bash
# tools/gpu/router_kit.sh -- run on the CPU machine (needs PyPI), after tools/gpu/prepare.sh, from
# anywhere in the repository.
#
# A device call carries at most 64 MiB (tree + carried ignored paths) and the device has no network.
# .devkit/ takes ~56 MiB (site archive 40.6 MiB, jitcache 9.4 MiB, models-cache 3.5 MiB, overlay
# 1.6 MiB) and smg's wheel is 35.7 MiB (smg_rs.abi3.so is 101 MiB with its debug info), so smg does not fit
# next to the whole of .devkit. This script fills the ignored folder .routerkit/ with:
#   .routerkit/smg-site.tar.xz   smg (the version pyproject's [router] extra pins) from its manylinux
#                                abi3 wheel: the smg package, smg_rs.abi3.so stripped of symbols and
#                                debug info (--strip-unneeded: 101 -> 72 MiB), and its dist-info
#                                without the SBOM; xz with the x86 filter, -9e (~19 MiB; ~2 min, cached
#                                per wheel in ~/.cache/akv/router-kit). Its Python needs are on the device
#                                already: setproctitle (site archive), pyyaml and grpcio (the image)
#   .routerkit/overlay.tar.xz    .devkit/overlay packed (1.6 MiB -> ~0.3 MiB): run.sh unpacks it when
#                                .devkit/overlay is not carried (re-packed on every run of this script,
#                                so run it again after prepare.sh)
# and checks that the router call's carry stays under the limit:
#
#   carry [".devkit/site-py312.tar.xz", ".devkit/MANIFEST.txt", ".routerkit"]   (timeout_s 600)
#
# Measured 2026-12-05 (smg 1.13.0): smg-site.tar.xz 19,990,032 bytes, overlay.tar.xz 261,676, the site
# archive 42,564,272, the working tree 3.77 MB: 66,587,013 bytes of the 67,108,864 limit (the tree
# may grow by about 250 KiB before this script's 256 KiB margin refuses the carry).
#
# i.e. without .devkit's jitcache and models-cache (the replay makes only the tiny and 8B-shaped models;
# without the carried kernels each worker compiles SGLang's JIT kernels on its first start: use
# AKV_REPLAY_BACKEND=triton, see tools/gpu/replay_suite.sh). tools/gpu/run.sh installs both archives
# into its site (ROUTER_KIT, default .routerkit, when present).
#
# Knobs: ROUTER_KIT_CACHE (default ~/.cache/akv/router-kit).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
KIT=$ROOT/.devkit
RKIT=$ROOT/.routerkit
CACHE=${ROUTER_KIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/akv/router-kit}
LIMIT=$(( 64 * 1048576 ))
MARGIN=$(( 256 * 1024 ))
step() { echo "[router_kit $(date -u +%H:%M:%S)] $*"; }

git check-ignore -q .routerkit/ || { echo ".routerkit/ is not ignored by git; add /.routerkit/ to .git/info/exclude" >&2; exit 2; }
[ -f "$KIT/site-py312.tar.xz" ] && [ -d "$KIT/overlay/sglang" ] || { echo "run tools/gpu/prepare.sh first" >&2; exit 2; }
PIN=$(python3 - <<'PY'
import re, tomllib
extra = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["router"]
print(next(re.fullmatch(r"smg==(\S+)", d).group(1) for d in extra if d.startswith("smg==")))
PY
)
mkdir -p "$CACHE/wheels" "$RKIT"

step "smg $PIN wheel (manylinux, x86-64)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$CACHE/wheels" "smg==$PIN"
WHEEL=$(ls "$CACHE"/wheels/smg-"$PIN"-*.whl | head -1)
SUM=$(sha256sum "$WHEEL" | cut -c1-16)
PACKED=$CACHE/smg-$PIN-$SUM.tar.xz
if [ ! -f "$PACKED" ]; then
  step "unpack, strip smg_rs.abi3.so, pack with xz --x86 -9e (about 2 minutes)"
  STAGE=$(mktemp -d)
  trap 'rm -rf "$STAGE"' EXIT
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$WHEEL" "$STAGE"
  rm -rf "$STAGE"/smg-*.dist-info/sboms "$STAGE"/smg-*.dist-info/RECORD
  strip --strip-unneeded "$STAGE/smg/smg_rs.abi3.so"
  PYTHONPATH=$STAGE python3 -c "import smg.smg_rs as s; print('    stripped module loads:', s.get_version_string())"
  tar -C "$STAGE" --sort=name --owner=0 --group=0 --numeric-owner -cf - . \
    | xz -T1 --x86 --lzma2=preset=9e,dict=64MiB > "$PACKED.tmp"
  mv "$PACKED.tmp" "$PACKED"
fi
cp -f "$PACKED" "$RKIT/smg-site.tar.xz"

step "overlay -> .routerkit/overlay.tar.xz"
tar -C "$KIT/overlay" --sort=name --owner=0 --group=0 --numeric-owner -cf - . | xz -9 > "$RKIT/overlay.tar.xz"
{
  echo "# made by tools/gpu/router_kit.sh $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "smg $PIN from $(basename "$WHEEL") (sha256 $SUM...)"
  echo "overlay from .devkit/overlay: $(find "$KIT/overlay" -type f | wc -l) files"
} > "$RKIT/MANIFEST.txt"

step "sizes"
size() { du -sb "$@" | awk '{s += $1} END {print s}'; }
tree=$(git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
carry=$(size "$KIT/site-py312.tar.xz" "$KIT/MANIFEST.txt" "$RKIT")
printf '    %-34s %9d bytes\n' "smg-site.tar.xz" "$(size "$RKIT/smg-site.tar.xz")" "overlay.tar.xz" \
  "$(size "$RKIT/overlay.tar.xz")" "site-py312.tar.xz + MANIFEST.txt" "$(size "$KIT/site-py312.tar.xz" \
  "$KIT/MANIFEST.txt")" "working tree" "$tree" "total" "$(( carry + tree ))" "limit" "$LIMIT"
if [ $(( carry + tree )) -gt $(( LIMIT - MARGIN )) ]; then
  echo "ERROR: the router call would carry $(( carry + tree )) bytes, over the limit less a 256 KiB margin" >&2
  exit 3
fi
step "ready. Device call: carry [\".devkit/site-py312.tar.xz\", \".devkit/MANIFEST.txt\", \".routerkit\"], timeout_s 600:"
echo '    set -o pipefail; AKV_REPLAY_ROUTER=affinity,round_robin AKV_REPLAY_BACKEND=triton bash tools/gpu/replay_suite.sh 2>&1 | tee $OUT/log.txt'
