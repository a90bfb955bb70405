"""Build the patched SGLang wheel ``sglang-0.5.16+akv`` from the pinned PyPI wheel.

Steps: fetch ``sglang==0.5.16`` for one CPython tag (cached, sha256-checked), unpack it, apply
``akv/system/sglang.patch`` strictly, copy optional overlay files, stamp the version ``0.5.16+akv``
(``sglang/_version.py``, dist-info name, ``METADATA``), rewrite ``RECORD`` and zip a deterministic
wheel. A build whose inputs match an existing output is skipped.

Usage: ``python -m akv.system._build --out DIR [--python-tag cp311|cp312] [--overlay DIR]
[--overlay-out DIR] [--cache DIR] [--install]``.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from akv import cli

SGLANG_VERSION = "0.5.16"
AKV_LOCAL = "akv"
AKV_VERSION = f"{SGLANG_VERSION}+{AKV_LOCAL}"
PLATFORM = "manylinux_2_34_x86_64"
PINNED_SHA256: dict[str, str] = {
    "cp311": "d5f345a18953dd35df568ac56bdcb7f5ee910ab39efea4469b714556d1070713",
    "cp312": "b8ed16e72c7d6a643e31ba52e3ff106439e9dbb78543950e4c810158b826ea8e",
}
PATCH_FILE = Path(__file__).with_name("sglang.patch")
BUILD_INFO = "akv_build.json"
BUILDER_REVISION = 2
"""Bump when the builder changes its output for the same inputs, so old outputs are rebuilt."""

_ZIP_TIME = (2020, 1, 1, 0, 0, 0)
_STOCK_VERSION_LINE = f"__version__ = version = '{SGLANG_VERSION}'"
_STOCK_TUPLE_LINE = "__version_tuple__ = version_tuple = (0, 5, 16)"


class BuildError(RuntimeError):
    """The build cannot proceed; the message says what and how to fix it."""


class PatchError(BuildError):
    """The patch does not parse or does not apply to the unpacked wheel."""


# --------------------------------------------------------------------------- unified diffs ---


@dataclass(frozen=True)
class Hunk:
    """One ``@@ -old_start,old_len +new_start,new_len @@`` block; lines keep their prefix."""

    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[str, ...]
    header_line: int


@dataclass(frozen=True)
class FilePatch:
    """All hunks for one file; ``old_path`` is None for a file the patch creates."""

    old_path: str | None
    new_path: str
    hunks: tuple[Hunk, ...]


_HUNK_RE = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(text: str) -> tuple[FilePatch, ...]:
    """Parse a unified diff (``a/``/``b/`` prefixes); text before the first ``---`` is commentary."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            if files and lines[i].startswith(("@@", "+", "-", " ")):
                raise PatchError(f"patch line {i + 1}: stray diff line {lines[i]!r} outside a hunk")
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"patch line {i + 2}: expected '+++ ' after {lines[i]!r}")
        old_path = _strip_prefix(lines[i][4:], "a/", i + 1)
        new_path = _strip_prefix(lines[i + 1][4:], "b/", i + 2)
        if new_path is None:
            raise PatchError(f"patch line {i + 2}: deleting files is not supported ({lines[i]!r})")
        if old_path is not None and old_path != new_path:
            raise PatchError(f"patch line {i + 1}: renames are not supported ({old_path!r} -> {new_path!r})")
        i += 2
        hunks: list[Hunk] = []
        while i < len(lines) and lines[i].startswith("@@"):
            hunk, i = _parse_hunk(lines, i)
            hunks.append(hunk)
        if not hunks:
            raise PatchError(f"patch line {i}: file {new_path!r} has no hunks")
        files.append(FilePatch(old_path, new_path, tuple(hunks)))
    if not files:
        raise PatchError("patch: no file sections ('--- a/...' / '+++ b/...') found")
    targets = [f.new_path for f in files]
    if len(set(targets)) != len(targets):
        raise PatchError(f"patch: a file appears in more than one section: {sorted(targets)}")
    return tuple(files)


def _strip_prefix(label: str, prefix: str, line_no: int) -> str | None:
    path = label.split("\t", 1)[0].strip()
    if path == "/dev/null":
        return None
    if not path.startswith(prefix):
        raise PatchError(f"patch line {line_no}: path {path!r} does not start with {prefix!r}")
    path = path[len(prefix):]
    parts = Path(path).parts
    if not parts or Path(path).is_absolute() or ".." in parts:
        raise PatchError(f"patch line {line_no}: unsafe path {path!r}")
    return path


def _parse_hunk(lines: list[str], i: int) -> tuple[Hunk, int]:
    match = _HUNK_RE.match(lines[i])
    if not match:
        raise PatchError(f"patch line {i + 1}: malformed hunk header {lines[i]!r}")
    old_start, new_start = int(match.group(1)), int(match.group(3))
    old_len = int(match.group(2)) if match.group(2) is not None else 1
    new_len = int(match.group(4)) if match.group(4) is not None else 1
    header = i + 1
    body: list[str] = []
    old_seen = new_seen = 0
    i += 1
    while i < len(lines) and (old_seen < old_len or new_seen < new_len):
        line = lines[i]
        tag = line[:1]
        if tag == " ":
            old_seen += 1
            new_seen += 1
        elif tag == "-":
            old_seen += 1
        elif tag == "+":
            new_seen += 1
        elif line == "":
            line = " "
            old_seen += 1
            new_seen += 1
        elif line.startswith("\\"):
            raise PatchError(f"patch line {i + 1}: files without a final newline are not supported")
        else:
            raise PatchError(f"patch line {i + 1}: unexpected line {line!r} inside hunk at line {header}")
        body.append(line)
        i += 1
    if old_seen != old_len or new_seen != new_len:
        raise PatchError(
            f"patch line {header}: hunk counts -{old_len},+{new_len} but body has -{old_seen},+{new_seen}"
        )
    if i < len(lines) and lines[i].startswith("\\"):
        raise PatchError(f"patch line {i + 1}: files without a final newline are not supported")
    return Hunk(old_start, old_len, new_start, new_len, tuple(body), header), i


def apply_file_patch(original: str | None, patch: FilePatch) -> str:
    """Apply one file's hunks exactly (no fuzz, no offset); raise PatchError naming the mismatch."""
    if patch.old_path is None:
        if original is not None:
            raise PatchError(f"{patch.new_path}: the patch creates this file but it already exists")
        old_lines: list[str] = []
    else:
        if original is None:
            raise PatchError(f"{patch.new_path}: file to patch does not exist in the wheel")
        old_lines = original.split("\n")
    out: list[str] = []
    cursor = 0
    for hunk in patch.hunks:
        start = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        if start < cursor:
            raise PatchError(f"{patch.new_path}: hunk at patch line {hunk.header_line} overlaps the previous hunk")
        out.extend(old_lines[cursor:start])
        pos = start
        for line in hunk.lines:
            tag, body = line[:1], line[1:]
            if tag in (" ", "-"):
                found = old_lines[pos] if pos < len(old_lines) else None
                if found != body:
                    raise PatchError(
                        f"{patch.new_path}: hunk at patch line {hunk.header_line} does not apply: "
                        f"line {pos + 1} is {found!r}, the patch expects {body!r}"
                    )
                pos += 1
                if tag == " ":
                    out.append(body)
            else:
                out.append(body)
        cursor = pos
    out.extend(old_lines[cursor:])
    text = "\n".join(out)
    return text + "\n" if patch.old_path is None else text


def apply_patch(root: Path, patch_text: str) -> list[str]:
    """Apply a unified diff to the tree at ``root``; all files are checked before any is written."""
    results: dict[str, str] = {}
    for file_patch in parse_patch(patch_text):
        target = root / file_patch.new_path
        original = target.read_text(encoding="utf-8") if target.exists() else None
        results[file_patch.new_path] = apply_file_patch(original, file_patch)
    for rel, text in results.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return sorted(results)


# ------------------------------------------------------------------------------- the wheel ---


@dataclass(frozen=True)
class BuildResult:
    """What a build produced: the wheel, the files changed relative to the stock wheel."""

    wheel: Path
    changed_files: tuple[str, ...]
    skipped: bool


def python_tag(version_info: tuple[int, int] | None = None) -> str:
    """The CPython tag of this interpreter, or BuildError when no pinned wheel exists for it."""
    major, minor = version_info or sys.version_info[:2]
    tag = f"cp{major}{minor}"
    if tag not in PINNED_SHA256:
        raise BuildError(
            f"unsupported interpreter {tag} (Python {major}.{minor}): sglang {SGLANG_VERSION} is pinned "
            f"for {', '.join(sorted(PINNED_SHA256))}; pass --python-tag to build for another interpreter"
        )
    return tag


def _check_tag(tag: str) -> None:
    if tag not in PINNED_SHA256:
        raise BuildError(f"--python-tag: unsupported tag {tag!r}; choose one of {sorted(PINNED_SHA256)}")


def stock_wheel_name(tag: str) -> str:
    return f"sglang-{SGLANG_VERSION}-{tag}-{tag}-{PLATFORM}.whl"


def patched_wheel_name(tag: str) -> str:
    return f"sglang-{AKV_VERSION}-{tag}-{tag}-{PLATFORM}.whl"


def default_cache_dir() -> Path:
    base = os.environ.get("AKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "akv"
    )
    return Path(base) / "wheels"


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on ``path`` shared by every process on this machine."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def cached_build(tag: str, cache_dir: Path | None = None) -> BuildResult:
    """The patched wheel for ``tag`` in ``<cache>/builds/<inputs>``: built once per patch, whichever
    process (test session, dry run, worker) asks first."""
    cache = cache_dir or default_cache_dir()
    inputs = build_inputs(tag, PATCH_FILE.read_text(encoding="utf-8"), None)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    out = cache.parent / "builds" / key
    with _locked(out.with_suffix(".lock")):
        return build(out, tag, cache_dir=cache)


def installed_site(wheel: Path, cache_dir: Path | None = None) -> Path:
    """A folder with ``wheel`` installed into it (pip ``--target``, no dependencies), named by the
    wheel's sha256 under ``<cache>/sites``: installed once with its bytecode compiled, then shared
    read-only. (Without the bytecode, every process that imports SGLang compiled its modules again
    where ``PYTHONDONTWRITEBYTECODE`` is set: 2-5 s of a core per server process on the CPU.)"""
    site = (cache_dir or default_cache_dir()).parent / "sites" / sha256_file(wheel)[:20]
    done = site / ".akv-installed"
    with _locked(site.with_suffix(".lock")):
        if not done.exists():
            shutil.rmtree(site, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                            "--target", str(site), str(wheel)], check=True)
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(site)], check=True,
                           stdout=subprocess.DEVNULL)
            done.write_text(wheel.name + "\n")
    return site


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_stock_wheel(tag: str, cache_dir: Path) -> Path:
    """Return the cached pinned wheel for ``tag``, downloading it with pip when absent."""
    _check_tag(tag)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / stock_wheel_name(tag)
    if not path.exists():
        print(f"[akv-build] downloading sglang=={SGLANG_VERSION} ({tag}) into {cache_dir}", flush=True)
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", tag[2] + "." + tag[3:], "--implementation", "cp", "--abi", tag,
            "--platform", PLATFORM, "--dest", str(cache_dir), f"sglang=={SGLANG_VERSION}",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not path.exists():
            raise BuildError(
                f"downloading sglang=={SGLANG_VERSION} for {tag} failed (pip exit {done.returncode}); "
                f"expected {path.name}. pip said:\n{done.stderr.strip()[-2000:]}"
            )
    actual = sha256_file(path)
    if actual != PINNED_SHA256[tag]:
        raise BuildError(
            f"sha256 mismatch for {path}: expected {PINNED_SHA256[tag]}, got {actual}. "
            "The file is not the pinned release; delete it and run the build again."
        )
    print(f"[akv-build] stock wheel {path.name} sha256 ok", flush=True)
    return path


def build_inputs(tag: str, patch_text: str, overlay: Path | None) -> dict[str, object]:
    """Everything the output depends on; equal inputs give a byte-identical wheel."""
    overlay_digest = hashlib.sha256()
    for rel in _overlay_files(overlay):
        overlay_digest.update(rel.encode() + b"\0" + (overlay / rel).read_bytes() + b"\0")
    return {
        "sglang": SGLANG_VERSION,
        "version": AKV_VERSION,
        "python_tag": tag,
        "stock_sha256": PINNED_SHA256[tag],
        "patch_sha256": hashlib.sha256(patch_text.encode()).hexdigest(),
        "overlay_sha256": overlay_digest.hexdigest() if overlay is not None else None,
        "builder_revision": BUILDER_REVISION,
    }


def _overlay_files(overlay: Path | None) -> list[str]:
    if overlay is None:
        return []
    if not overlay.is_dir():
        raise BuildError(f"--overlay: {overlay} is not a folder")
    files = sorted(
        p.relative_to(overlay).as_posix()
        for p in overlay.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    for rel in files:
        if not rel.startswith("sglang/"):
            raise BuildError(f"--overlay: {rel!r} is outside the sglang/ package folder")
    return files


def _existing_build(wheel: Path, inputs: dict[str, object]) -> tuple[str, ...] | None:
    """The changed-file list of an up-to-date existing output, or None when it must be rebuilt."""
    if not wheel.exists():
        return None
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = json.loads(zf.read(f"sglang-{AKV_VERSION}.dist-info/{BUILD_INFO}"))
    except (KeyError, zipfile.BadZipFile, json.JSONDecodeError, OSError):
        return None
    if info.get("inputs") != inputs:
        return None
    return tuple(info.get("changed_files", ()))


def _stamp_version(root: Path) -> None:
    version_py = root / "sglang" / "_version.py"
    text = version_py.read_text(encoding="utf-8")
    if _STOCK_VERSION_LINE not in text or _STOCK_TUPLE_LINE not in text:
        raise BuildError(f"{version_py}: stock version lines not found; is this sglang {SGLANG_VERSION}?")
    text = text.replace(_STOCK_VERSION_LINE, f"__version__ = version = '{AKV_VERSION}'")
    text = text.replace(_STOCK_TUPLE_LINE, f"__version_tuple__ = version_tuple = (0, 5, 16, '{AKV_LOCAL}')")
    version_py.write_text(text, encoding="utf-8")

    old_info = root / f"sglang-{SGLANG_VERSION}.dist-info"
    new_info = root / f"sglang-{AKV_VERSION}.dist-info"
    if not old_info.is_dir():
        raise BuildError(f"{old_info.name} missing from the stock wheel")
    old_info.rename(new_info)
    metadata = new_info / "METADATA"
    lines = metadata.read_text(encoding="utf-8").split("\n")
    if f"Version: {SGLANG_VERSION}" not in lines:
        raise BuildError(f"{metadata}: no 'Version: {SGLANG_VERSION}' line")
    lines[lines.index(f"Version: {SGLANG_VERSION}")] = f"Version: {AKV_VERSION}"
    metadata.write_text("\n".join(lines), encoding="utf-8")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _write_wheel(root: Path, wheel: Path, info_dir: str) -> None:
    """Write RECORD and a deterministic zip (sorted entries, fixed times, dist-info last)."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    record_rel = f"{info_dir}/RECORD"
    files = [f for f in files if f != record_rel]
    body = [f for f in files if not f.startswith(info_dir + "/")]
    meta = [f for f in files if f.startswith(info_dir + "/")]
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for rel in body + meta:
        data = (root / rel).read_bytes()
        writer.writerow([rel, _record_hash(data), len(data)])
    writer.writerow([record_rel, "", ""])
    (root / record_rel).write_text(record.getvalue(), encoding="utf-8")
    tmp = wheel.with_name(wheel.name + ".part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for rel in body + meta + [record_rel]:
            path = root / rel
            entry = zipfile.ZipInfo(rel, date_time=_ZIP_TIME)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = ((0o755 if os.access(path, os.X_OK) else 0o644) | 0o100000) << 16
            zf.writestr(entry, path.read_bytes())
    tmp.replace(wheel)


def build(
    out_dir: Path,
    tag: str,
    *,
    patch_file: Path = PATCH_FILE,
    overlay: Path | None = None,
    cache_dir: Path | None = None,
) -> BuildResult:
    """Build ``sglang-0.5.16+akv`` for ``tag`` into ``out_dir`` (skipped when already up to date)."""
    _check_tag(tag)
    patch_text = patch_file.read_text(encoding="utf-8")
    inputs = build_inputs(tag, patch_text, overlay)
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / patched_wheel_name(tag)
    existing = _existing_build(wheel, inputs)
    if existing is not None:
        print(f"[akv-build] {wheel} is up to date, skipping", flush=True)
        return BuildResult(wheel, existing, skipped=True)

    stock = fetch_stock_wheel(tag, cache_dir or default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="akv-build-") as tmp:
        root = Path(tmp) / "wheel"
        print(f"[akv-build] unpacking {stock.name}", flush=True)
        with zipfile.ZipFile(stock) as zf:
            zf.extractall(root)
            for entry in zf.infolist():
                if (entry.external_attr >> 16) & 0o111:
                    os.chmod(root / entry.filename, 0o755)
        print(f"[akv-build] applying {patch_file.name}", flush=True)
        changed = set(apply_patch(root, patch_text))
        for rel in _overlay_files(overlay):
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(overlay / rel, target)
            changed.add(rel)
        if overlay is not None:
            print(f"[akv-build] copied overlay {overlay}", flush=True)
        _stamp_version(root)
        changed.add("sglang/_version.py")
        info_dir = f"sglang-{AKV_VERSION}.dist-info"
        changed_files = tuple(sorted(changed))
        (root / info_dir / BUILD_INFO).write_text(
            json.dumps({"inputs": inputs, "changed_files": list(changed_files)}, indent=1, sort_keys=True) + "\n",
            encoding="utf-8",
        )
        print(f"[akv-build] writing {wheel}", flush=True)
        _write_wheel(root, wheel, info_dir)
    print(f"[akv-build] done: {wheel} ({len(changed_files)} files changed)", flush=True)
    return BuildResult(wheel, changed_files, skipped=False)


def export_overlay(result: BuildResult, dest: Path) -> list[str]:
    """Copy the built wheel's changed files into ``dest`` in site-packages layout (SITE_OVERLAY).

    ``dest`` must be absent, empty or an earlier overlay (holding only ``sglang/``), which is replaced.
    """
    if dest.exists():
        foreign = sorted(p.name for p in dest.iterdir() if p.name != "sglang")
        if foreign:
            raise BuildError(f"--overlay-out: {dest} holds other files ({', '.join(foreign[:5])}); give an empty folder")
        shutil.rmtree(dest / "sglang", ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(result.wheel) as zf:
        for rel in result.changed_files:
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(rel))
    return list(result.changed_files)


def install(wheel: Path) -> None:
    """pip-install the wheel into this interpreter without touching its dependencies."""
    print(f"[akv-build] installing {wheel.name} (--no-deps; sglang's own dependencies stay as they are)", flush=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", str(wheel)], check=False
    )
    if done.returncode != 0:
        raise BuildError(f"pip install {wheel} failed with exit code {done.returncode}")


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("python -m akv.system._build", __doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the patched wheel")
    parser.add_argument("--python-tag", choices=sorted(PINNED_SHA256), help="default: this interpreter's tag")
    parser.add_argument("--overlay", type=Path, help="folder of extra files in wheel layout (sglang/...)")
    parser.add_argument("--overlay-out", type=Path, help="also write the changed files here, site-packages layout")
    parser.add_argument("--cache", type=Path, help=f"stock wheel cache (default {default_cache_dir()})")
    parser.add_argument("--install", action="store_true", help="pip install the result into this interpreter")
    args = parser.parse_args(argv)
    try:
        running = python_tag() if args.install or args.python_tag is None else None
        tag = args.python_tag or running
        if args.install and tag != running:
            raise BuildError(f"--install: the wheel is for {tag} but this interpreter is {running}")
        result = build(args.out, tag, overlay=args.overlay, cache_dir=args.cache)
        if args.overlay_out is not None:
            files = export_overlay(result, args.overlay_out)
            print(f"[akv-build] overlay with {len(files)} files in {args.overlay_out}", flush=True)
        if args.install:
            install(result.wheel)
    except BuildError as exc:
        print(f"[akv-build] error: {exc}", file=sys.stderr)
        return 2
    print(result.wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
