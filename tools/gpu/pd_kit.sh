#!/usr/bin/env bash
# tools/gpu/pd_kit.sh -- run on the CPU machine (needs PyPI and apt), from anywhere in the repository.
#
# Fills the ignored folder .devkit-pd/ with what a PD device call (bench/pd_check.py) needs beyond
# .devkit/, in one archive:
#   .devkit-pd/mooncake-cp312.tar.xz  site/  the part of mooncake-transfer-engine-cuda13==0.3.14 (cp312,
#                                            manylinux_2_28) that `import mooncake.engine` loads: the
#                                            package's __init__.py, engine.so and every library of the
#                                            wheel in engine.so's NEEDED closure (readelf -d)
#                                     lib/   libibverbs.so.1, libmlx5.so.1 (libibverbs1, ibverbs-providers),
#                                            the libnl libraries libibverbs loads, libnuma.so.1 (libnuma1):
#                                            Debian packages (apt-get download, dpkg -x), shared objects only
#   .devkit-pd/MANIFEST.txt           what is in it, with versions and sha256
# SGLang's mooncake transfer backend imports nothing else of the package (mooncake.engine.TransferEngine;
# mooncake.allocator only with a custom memory pool, which the check leaves off); the wheel's Python
# requirements (aiohttp, requests, msgpack) are on the device image. Not carried: libcudart.so.13
# (the image's CUDA 13 toolkit and torch's nvidia/cu13), libcuda.so.1 (the driver), libcurl.so.4 (a
# system library engine.so links but the TCP transport with SGLang's handshake does not call;
# bench/pd_check.py names any library still missing on the device before it starts a server).
#
# The carry limit is 64 MiB for the working tree and every carried path together, and all of .devkit/
# plus this kit is over it. A PD call on the triton backend needs no compiled kernel cache, so it carries
# .devkit's parts by path and leaves .devkit/jitcache*.tar.xz (FlashInfer's kernels) and
# .devkit/models-cache (the gpt-oss / MiniMax makers' files) behind; tools/gpu/run.sh installs no
# jitcache when none is carried. The device call this prints:
#   carry [".devkit/site-py312.tar.xz", ".devkit/MANIFEST.txt", ".devkit/overlay", ".devkit-pd"]
#   set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH=bench/pd_check.py bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt
# The script ends with an error where that carry would exceed 62 MiB (2 MiB below the limit).
#
# Knobs: FORCE=1 (rebuild the archive), PD_WHEEL (default mooncake-transfer-engine-cuda13==0.3.14).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
KIT=$ROOT/.devkit-pd
PD_WHEEL=${PD_WHEEL:-mooncake-transfer-engine-cuda13==0.3.14}
DEBS="libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1"
CARRY=(.devkit/site-py312.tar.xz .devkit/MANIFEST.txt .devkit/overlay .devkit-pd)
LIMIT_MIB=64
T0=$(date +%s)
step() { echo "[pd_kit $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }

exclude=$(git rev-parse --git-common-dir)/info/exclude
if ! git check-ignore -q .devkit-pd/; then
  step "adding /.devkit-pd/ to $exclude"
  echo "/.devkit-pd/" >> "$exclude"
fi

if [ "${FORCE:-0}" != 1 ] && [ -f "$KIT/mooncake-cp312.tar.xz" ] && [ -f "$KIT/MANIFEST.txt" ] \
   && grep -q "^wheel $PD_WHEEL " "$KIT/MANIFEST.txt" \
   && grep -q "sha256 $(sha256sum "$KIT/mooncake-cp312.tar.xz" | cut -d' ' -f1)" "$KIT/MANIFEST.txt"; then
  step "$KIT/mooncake-cp312.tar.xz is up to date (FORCE=1 rebuilds it)"
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/akv-pd-kit.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  step "download $PD_WHEEL (cp312, manylinux_2_28_x86_64)"
  python3 -m pip download -q --platform manylinux_2_28_x86_64 --python-version 3.12 --only-binary=:all: \
    --no-deps -d "$WORK/wheel" "$PD_WHEEL"
  wheel=$(ls "$WORK"/wheel/*.whl)
  python3 -m zipfile -e "$wheel" "$WORK/whl"

  step "engine.so's closure inside the wheel"
  mkdir -p "$WORK/pack/site/mooncake" "$WORK/pack/lib"
  cp "$WORK/whl/mooncake/__init__.py" "$WORK/pack/site/mooncake/"
  todo=("mooncake/engine.so"); seen=" "
  while [ ${#todo[@]} -gt 0 ]; do
    rel=${todo[0]}; todo=("${todo[@]:1}")
    case "$seen" in *" $rel "*) continue ;; esac
    seen="$seen$rel "
    mkdir -p "$WORK/pack/site/$(dirname "$rel")"
    cp "$WORK/whl/$rel" "$WORK/pack/site/$rel"
    for lib in $(readelf -d "$WORK/whl/$rel" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
      for dir in mooncake mooncake_transfer_engine_cuda13.libs; do  # the wheel's RPATH: $ORIGIN, ../*.libs
        [ -f "$WORK/whl/$dir/$lib" ] && todo+=("$dir/$lib") && break
      done
    done
  done
  (cd "$WORK/pack/site" && find . -type f | sort | sed 's|^\./|    |')

  step "Debian packages: $DEBS"
  mkdir -p "$WORK/debs"
  (cd "$WORK/debs" && apt-get download $DEBS 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
  for pkg in $DEBS; do ls "$WORK"/debs/"${pkg}"_*.deb >/dev/null || { echo "apt-get download $pkg failed" >&2; exit 2; }; done
  for deb in "$WORK"/debs/*.deb; do dpkg -x "$deb" "$WORK/sys"; done
  find "$WORK/sys" \( -type f -o -type l \) -name 'lib*.so.*' \
    \( -name 'libibverbs.so.1*' -o -name 'libmlx5.so.1*' -o -name 'libnl-3.so.200*' -o -name 'libnl-route-3.so.200*' \
       -o -name 'libnuma.so.1*' \) -exec cp -a {} "$WORK/pack/lib/" \;
  ls "$WORK/pack/lib" | sed 's/^/    /'

  step "pack (xz -9)"
  mkdir -p "$KIT"
  rm -f "$KIT/mooncake-cp312.tar.xz"
  tar -C "$WORK/pack" --owner=0 --group=0 --sort=name -cf - . | xz -T0 -9 > "$KIT/mooncake-cp312.tar.xz"
  {
    echo "# mooncake-cp312.tar.xz: tar -xJf mooncake-cp312.tar.xz -C DIR; PYTHONPATH=DIR/site, LD_LIBRARY_PATH=DIR/lib"
    echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) by tools/gpu/pd_kit.sh"
    echo "wheel $PD_WHEEL $(basename "$wheel") sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
    for deb in "$WORK"/debs/*.deb; do echo "deb $(basename "$deb")"; done
    echo "unpacked_bytes $(du -sb "$WORK/pack" | cut -f1)"
    echo "sha256 $(sha256sum "$KIT/mooncake-cp312.tar.xz" | cut -d' ' -f1)"
  } > "$KIT/MANIFEST.txt"
fi

step "sizes (bytes)"
for f in .devkit/site-py312.tar.xz .devkit/MANIFEST.txt .devkit/overlay .devkit/jitcache.tar.xz \
         .devkit/jitcache-akv.tar.xz .devkit/models-cache .devkit .devkit-pd; do
  [ -e "$f" ] && printf '    %-28s %10d\n' "$f" "$(du -sb "$f" | cut -f1)"
done
for p in "${CARRY[@]}"; do [ -e "$p" ] || { echo "missing $p: run tools/gpu/prepare.sh first" >&2; exit 2; }; done
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
carry_bytes=$(du -scb "${CARRY[@]}" | tail -1 | cut -f1)
all_bytes=$(du -scb .devkit .devkit-pd | tail -1 | cut -f1)
total=$(( carry_bytes + tree_bytes ))
printf '    working tree %d KiB; PD carry %d KiB; total %d KiB = %.1f MiB (limit %d MiB)\n' \
  $(( tree_bytes / 1024 )) $(( carry_bytes / 1024 )) $(( total / 1024 )) "$(echo "$total / 1048576" | bc -l)" "$LIMIT_MIB"
printf '    (all of .devkit + .devkit-pd + tree would be %.1f MiB)\n' "$(echo "($all_bytes + $tree_bytes) / 1048576" | bc -l)"
if [ "$total" -gt $(( (LIMIT_MIB - 2) * 1048576 )) ]; then
  echo "ERROR: the PD device call would carry $(( total / 1048576 )) MiB, too close to the $LIMIT_MIB MiB limit" >&2
  exit 3
fi
step "ready. Device call (carry $(printf '"%s", ' "${CARRY[@]}" | sed 's/, $//; s/^/[/; s/$/]/'), timeout_s 600):"
echo '    set -o pipefail; SKIP_PYTEST=1 SKIP_SERVER=1 AKV_BENCH=bench/pd_check.py bash tools/gpu/run.sh 2>&1 | tee $OUT/log.txt'
