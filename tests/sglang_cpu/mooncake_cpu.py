"""Mooncake's transfer engine on a machine without a GPU or RDMA, for a PD pair over TCP on the CPU.

``engine.so`` of ``mooncake-transfer-engine-cuda13`` (the ``[pd]`` pin) loads only with
``libcudart.so.13``, ``libcuda.so.1``, ``libibverbs.so.1`` and ``libmlx5.so.1`` present, although the
TCP transport calls none of their RDMA or device functions on host memory. :func:`prepare` puts what
is missing into a folder, once per machine: the engine's wheel and NVIDIA's CUDA 13 runtime wheel from
PyPI (unpacked, not installed), Debian's ``libibverbs1``, ``ibverbs-providers`` and their ``libnl``
libraries (``apt-get download``, unpacked with ``dpkg -x``), and a ``libcuda.so.1`` built with gcc whose
every entry point the engine imports returns ``CUDA_ERROR_NO_DEVICE``. The README's PD section gives
the same steps by hand. Test-side only: nothing here is used by the servers themselves.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

WHEELS = ("mooncake-transfer-engine-cuda13==0.3.14", "nvidia-cuda-runtime==13.0.96")
DEBS = ("libibverbs1", "ibverbs-providers", "libnl-3-200", "libnl-route-3-200")
CUDA_ERROR_NO_DEVICE = 100


@dataclass(frozen=True)
class MooncakeCpu:
    """Where the engine's package and the shared libraries it loads are: ``PYTHONPATH`` and
    ``LD_LIBRARY_PATH`` entries for the server processes."""

    python_path: str
    library_path: str

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the engine importable (its folders first)."""
        joined = lambda first, rest: os.pathsep.join([first, rest]) if rest else first  # noqa: E731
        return {**base, "PYTHONPATH": joined(self.python_path, base.get("PYTHONPATH", "")),
                "LD_LIBRARY_PATH": joined(self.library_path, base.get("LD_LIBRARY_PATH", ""))}


def prepare(cache: Path) -> MooncakeCpu | str:
    """The engine, ready under ``cache`` (made there on the first call); a one-line reason when it
    cannot be made or does not import."""
    folder = cache / re.sub(r"[^A-Za-z0-9.]+", "-", "+".join(WHEELS))
    if not folder.exists():
        cache.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=cache))
        try:
            problem = _make(work)
            if problem is not None:
                return problem
            try:
                work.rename(folder)
            except OSError:  # another process made it first
                pass
        finally:
            shutil.rmtree(work, ignore_errors=True)
    found = _layout(folder)
    probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True,
                           env=found.env({**os.environ, "PYTHONPATH": ""}), timeout=120, check=False)
    if probe.returncode != 0:
        return f"mooncake.engine does not import from {folder}: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return found


def _layout(folder: Path) -> MooncakeCpu:
    libraries = [folder / "site" / "nvidia" / "cu13" / "lib", folder / "stub",
                 folder / "sys" / "usr" / "lib" / "x86_64-linux-gnu", folder / "sys" / "lib" / "x86_64-linux-gnu"]
    return MooncakeCpu(str(folder / "site"), os.pathsep.join(str(p) for p in libraries))


def _run(command: list[str], cwd: Path) -> str | None:
    """None when ``command`` succeeded, else its last line of output."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{command[0]}: {exc}"
    if done.returncode != 0:
        return f"{' '.join(command)}: {((done.stderr or done.stdout).strip().splitlines() or ['?'])[-1]}"
    return None


def _make(work: Path) -> str | None:
    (work / "debs").mkdir()
    problem = _run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(work / "wheels"), *WHEELS], work)
    if problem is not None:
        return problem
    for wheel in sorted((work / "wheels").glob("*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(work / "site")
    shutil.rmtree(work / "wheels")
    problem = _run(["apt-get", "download", *DEBS], work / "debs")
    if problem is not None:
        return f"the system libraries the engine loads are not downloadable here ({problem})"
    for deb in sorted((work / "debs").glob("*.deb")):
        problem = _run(["dpkg", "-x", str(deb), str(work / "sys")], work)
        if problem is not None:
            return problem
    return _stub_libcuda(work)


def _stub_libcuda(work: Path) -> str | None:
    """``stub/libcuda.so.1``: every ``cu*`` driver function ``engine.so`` imports, returning no device."""
    engine = work / "site" / "mooncake" / "engine.so"
    try:
        symbols = subprocess.run(["nm", "-D", "--undefined-only", str(engine)], capture_output=True, text=True,
                                 timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nm cannot list the engine's imports: {exc}"
    names = sorted({line.split()[-1].split("@")[0] for line in symbols.splitlines()
                    if re.fullmatch(r"cu[A-Z]\w*", line.split()[-1].split("@")[0])})
    (work / "stub").mkdir()
    source = work / "stub" / "libcuda_stub.c"
    source.write_text("".join(f"int {name}(void) {{ return {CUDA_ERROR_NO_DEVICE}; }}\n" for name in names))
    return _run(["gcc", "-shared", "-fPIC", "-o", str(work / "stub" / "libcuda.so.1"), str(source)], work)
