"""An SGLang server as a child process of its own process group, for the benchmarks, the device
checks and their CPU dry runs: started, waited on through ``/health``, stopped with everything it
spawned; the SGLang sites they run on (stock from the carried archive on the GPU node, CPU sites from
the pinned wheel); and the flags and environment every CPU server shares."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import client

ROOT = Path(__file__).resolve().parents[2]
CPU_SHIMS = ROOT / "tests" / "sglang_cpu" / "site"
"""The CPU shims every SGLang server on the CPU imports first (tests/sglang_cpu)."""
CPU_KV_SPLITS = 1
"""Triton decode attention's KV splits on the CPU (SGLang's default 8): the interpreter runs every
split's program in turn, and one split cut a scheduler test's time by 30%; the results differ by float
rounding only (the split-K merge). One mode of tests/sglang_cpu/test_scheduler.py's matrix keeps 8."""
CPU_BASE = ["--device", "cpu", "--dtype", "float32", "--disable-cuda-graph", "--sampling-backend", "pytorch",
            "--mem-fraction-static", "0.5", "--enable-cache-report", "--triton-attention-num-kv-splits",
            str(CPU_KV_SPLITS)]
"""Every CPU server: FP32 (the reference server's arithmetic), no CUDA graphs, PyTorch sampling,
:data:`CPU_KV_SPLITS`."""


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (for CPU dry runs on a shared machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 free now (the CPU machine is shared)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports found")


def cpu_flags(pool_tokens: int, *, chunk: int = 256, warmup: bool = False) -> list[str]:
    """A CPU server's flags: :data:`CPU_BASE`, a pool of ``pool_tokens``, prefill chunks of ``chunk``
    tokens, and SGLang's warm-up request only where asked (it costs a prefill on the CPU)."""
    return [*CPU_BASE, "--max-total-tokens", str(pool_tokens), "--chunked-prefill-size", str(chunk),
            *([] if warmup else ["--skip-server-warmup"])]


def cpu_pythonpath(site: Path, akv: bool = True) -> str:
    """PYTHONPATH of a CPU server on ``site``: the CPU shims, the site, this checkout (for ``akv``;
    left out for stock SGLang with ``akv=False``), then the caller's PYTHONPATH (modules this machine
    adds, such as prometheus_client)."""
    extra = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([str(CPU_SHIMS), str(site), *([str(ROOT)] if akv else []), *extra])


def device_site() -> Path:
    """The patched site tools/gpu/run.sh installs on the GPU node (``$AKV_SITE``, in its work folder)."""
    site = os.environ.get("AKV_SITE")
    if not site:
        raise RuntimeError("AKV_SITE is not set: run this through tools/gpu/run.sh (or give the stock site's folder)")
    return Path(site)


def stock_site_default() -> Path:
    """Where the stock site is unpacked on the GPU node: ``$AKV_STOCK_SITE`` (tools/gpu/run.sh sets it in
    its work folder), else ``build/stock-site`` in the checkout."""
    return Path(os.environ.get("AKV_STOCK_SITE") or ROOT / "build" / "stock-site")


def unpack_stock_site(target: Path, shared: Path | None = None) -> Path:
    """Stock SGLang 0.5.16 in ``target`` (on the GPU node; done once): the carried archive's ``sglang``
    without the AKV overlay, and every other package a link to ``shared``'s (default: the patched
    site, :func:`device_site`). FlashInfer builds its kernels under paths resolved through the links,
    so both servers load the same carried or compiled modules instead of each rebuilding the other's."""
    if not (target / "sglang").is_dir():
        shared = shared or device_site()
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"xz -T0 -dc {shlex.quote(str(ROOT / '.devkit' / 'site-py312.tar.xz'))} | "
                       f"tar -x -C {shlex.quote(str(target))} --wildcards './sglang/*' './sglang-*.dist-info/*'",
                       shell=True, check=True)
        link_packages(target, shared)
    return target


def link_packages(target: Path, shared: Path) -> None:
    """Link every entry of ``shared`` that ``target`` lacks into ``target``."""
    for entry in shared.iterdir():
        if not os.path.lexists(target / entry.name):
            (target / entry.name).symlink_to(entry)


def link_site(target: Path, site: Path) -> Path:
    """``target`` made a link to ``site`` (replacing an earlier link or install there)."""
    if target.is_symlink() and target.resolve() == site.resolve():
        return target
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(site, target_is_directory=True)
    return target


def cpu_stock_site(target: Path) -> Path:
    """Stock SGLang for this interpreter at ``target``: a link to the pinned wheel installed once per
    machine (CPU dry runs)."""
    from akv.system import _build

    wheel = _build.fetch_stock_wheel(_build.python_tag(), _build.default_cache_dir())
    return link_site(target, _build.installed_site(wheel))


def cpu_patched_site(work: Path, target: Path | None = None) -> Path:
    """The patched SGLang for this interpreter at ``target`` (default ``work/patched-site``): a link to
    the wheel of the current patch, built and installed once per machine (CPU dry runs)."""
    from akv.system import _build

    wheel = _build.cached_build(_build.python_tag()).wheel
    return link_site(target or work / "patched-site", _build.installed_site(wheel))


@dataclass
class Server:
    """One SGLang server process (its own process group) and where it listens."""

    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> str:
        """The command line as recorded (interpreter as `python`, PYTHONPATH shown)."""
        return f"PYTHONPATH={self.env.get('PYTHONPATH', '')} " + shlex.join(["python", *self.argv[1:]])

    def chat(self, body: dict[str, Any], max_tokens: int = 8, top_logprobs: int = 2) -> dict[str, Any]:
        """:func:`client.chat` on this server."""
        return client.chat(self.url, body, max_tokens, top_logprobs)

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.argv + ["--host", "127.0.0.1", "--port", str(self.port)], env=self.env,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        return self

    def wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.process.returncode}; "
                                   f"log tail: {self.log_path.read_text()[-1500:]}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"{self.name} server not ready in {timeout:.0f} s")

    def start_and_wait(self, timeout: float, attempts: int = 3) -> None:
        """Start and wait for ``/health``; where another process took the port in between (the CPU
        machine is shared, and SGLang picks its own internal ports), again on another free port."""
        for attempt in range(attempts):
            self.start()
            try:
                self.wait(timeout)
                return
            except RuntimeError:
                if attempt == attempts - 1 or "address already in use" not in self.log_path.read_text():
                    raise
                self.stop()
                self.port = free_port()

    def stop(self) -> None:
        """End the whole process group (launcher, scheduler, detokenizer) and wait until none of it
        is left, so that the next server finds the GPU memory free."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            if not self._group_alive(15 if sig == signal.SIGTERM else 10):
                break
        self._log.close()
        self.process = None

    def _group_alive(self, seconds: float) -> bool:
        """Whether a live (not zombie) process of the group is left after waiting up to `seconds`."""
        deadline = time.time() + seconds
        while True:
            alive = False
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.process.pid and fields[0] != "Z":
                    alive = True
                    break
            if not alive or time.time() > deadline:
                return alive
            time.sleep(0.5)


def launch(name: str, module: str, model: Path, flags: list[str], env: dict[str, str], port: int,
           log: Path) -> Server:
    """``python -m module --model-path model *flags`` (``akv.system.launch_server`` or
    ``sglang.launch_server``) started now as :class:`Server` ``name``, its output in ``log``."""
    argv = [sys.executable, "-m", module, "--model-path", str(model), *flags]
    return Server(name, argv, {"PYTHONUNBUFFERED": "1", **env}, port, log).start()
