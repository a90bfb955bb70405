"""Official chat templates taken from the pinned ``llama-cpp-python`` sdist on PyPI (llama.cpp ships
them under ``models/templates/``), fetched with pip once and cached, never committed.

The cache is ``$AKV_CACHE_DIR/templates`` (default ``~/.cache/akv/templates``); both the sdist and
the extracted template are checked against pinned sha256 digests.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TEMPLATE_DIR = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models/templates"

# template file name -> sha256 of its bytes in the pinned sdist
TEMPLATE_SHA256: dict[str, str] = {
    "MiniMax-M2.jinja": "967ff7e387676f4b4340585da0585416532f1e6c5ee3f1ede64b2c21ef7ea001",
}


class TemplateFetchError(RuntimeError):
    """The sdist could not be downloaded, or a file in it is not the pinned one."""


def cache_dir() -> Path:
    """``$AKV_CACHE_DIR/templates``, or ``$XDG_CACHE_HOME/akv/templates``, or ``~/.cache/akv/templates``."""
    base = os.environ.get("AKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "akv"
    )
    return Path(base) / "templates"


def official_template(name: str, cache: Path | None = None) -> str:
    """Source of template ``name`` (a key of ``TEMPLATE_SHA256``), from the cache or the sdist."""
    if name not in TEMPLATE_SHA256:
        raise ValueError(f"name must be one of {sorted(TEMPLATE_SHA256)}, got {name!r}")
    folder = cache or cache_dir()
    path = folder / f"{SDIST_NAME}-{SDIST_VERSION}" / name
    if not path.is_file():
        data = _extract(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != TEMPLATE_SHA256[name]:
        raise TemplateFetchError(f"{path}: sha256 differs from the pinned {TEMPLATE_SHA256[name]}; delete it")
    return data.decode("utf-8")


def _extract(name: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="akv-sdist-") as scratch:
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:",
            "--dest", scratch, f"{SDIST_NAME}=={SDIST_VERSION}",
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        sdist = Path(scratch) / SDIST_FILE
        if done.returncode != 0 or not sdist.is_file():
            raise TemplateFetchError(
                f"pip download {SDIST_NAME}=={SDIST_VERSION} failed (exit {done.returncode}):\n"
                f"{done.stderr.strip()[-2000:]}"
            )
        digest = hashlib.sha256()
        with open(sdist, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != SDIST_SHA256:
            raise TemplateFetchError(f"{SDIST_FILE}: sha256 {digest.hexdigest()} is not the pinned {SDIST_SHA256}")
        with tarfile.open(sdist, "r:gz") as archive:
            member = archive.extractfile(f"{TEMPLATE_DIR}/{name}")
            if member is None:
                raise TemplateFetchError(f"{SDIST_FILE} has no file {TEMPLATE_DIR}/{name}")
            data = member.read()
    if hashlib.sha256(data).hexdigest() != TEMPLATE_SHA256[name]:
        raise TemplateFetchError(f"{name} in {SDIST_FILE}: sha256 differs from the pinned {TEMPLATE_SHA256[name]}")
    return data
