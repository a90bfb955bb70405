"""SGLang's real scheduler on the CPU: the patched wheel, a tiny random Qwen3, one driver process per
scheduler mode, and the oracle/cache-core references the served results are checked against."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server import Engine, ReferenceServer
from bench.harness.servers import CPU_KV_SPLITS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STRICT = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
          "AKV_CHECK_HOST_ROWS": "1"}


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sglang-cpu") / "tiny-qwen3", seed=3)


def serve(site: Path, model: Path, waves: list[dict], **settings: Any) -> dict[str, Any]:
    """Run ``waves`` through a fresh scheduler in its own process; the driver's JSON report
    (``settings`` as :func:`serve_parts` takes them)."""
    return serve_parts(site, model, [waves], **settings)[0]


def serve_parts(site: Path, model: Path, parts: list[list[dict]], *, overlap: bool = False, chunk: int = 4,
                backend: str | None = "akv", env: dict[str, str] | None = None, max_total_tokens: int = 4096,
                timeout: int = 1500, server_args: dict[str, Any] | None = None,
                flashinfer_probe: bool = False, audit: bool = False, count_calls: bool = False) -> list[dict[str, Any]]:
    """Run each part's waves through one scheduler in its own process, the cache flushed between
    parts (each part meets the scheduler as a fresh one would); a report per part.
    ``server_args`` are extra ``ServerArgs`` fields (model-specific flags); ``flashinfer_probe`` also
    plans FlashInfer for every context forward (see flashinfer_probe.py); ``audit`` checks every
    cache read against the brute force while it runs; ``count_calls`` counts the cache core's calls per
    wave (``scheduler_driver.CoreCalls``)."""
    job = {"model": str(model), "overlap": overlap, "chunk": chunk, "backend": backend,
           "env": {**STRICT, **(env or {})}, "parts": parts, "max_total_tokens": max_total_tokens,
           "server_args": server_args or {}, "flashinfer_probe": flashinfer_probe, "audit": audit,
           "count_calls": count_calls}
    process_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(HERE / "scheduler_driver.py")], input=json.dumps(job),
                          capture_output=True, text=True, env=process_env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


SERVER_ARGS = ["--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--disable-cuda-graph",
               "--sampling-backend", "pytorch", "--max-total-tokens", "4096", "--chunked-prefill-size", "16",
               "--skip-server-warmup", "--mem-fraction-static", "0.5", "--triton-attention-num-kv-splits",
               str(CPU_KV_SPLITS)]
"""The CPU flags of a whole patched server (``python -m akv.system.launch_server``) on the tiny model."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    """A patched server process (its own session) and where it listens and logs."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def kill(self, sig: int = 9) -> None:
        """Signal the server's whole process group (HTTP server, scheduler, detokenizer)."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def wait_until_up(process: subprocess.Popen, url: str, log_path: Path, timeout: float = 600) -> None:
    """Until ``url`` answers; fails with the log's tail when the process exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, log_path.read_text()[-4000:]
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} did not answer in {timeout} s: {log_path.read_text()[-4000:]}")


@contextmanager
def patched_servers(site: Path, model: Path, log_dir: Path, count: int = 1, args: tuple[str, ...] = (),
                    each: list[tuple[str, ...]] | None = None,
                    env: dict[str, str] | None = None) -> Iterator[list[Server]]:
    """``count`` patched servers on the tiny model (``SERVER_ARGS`` and ``args``, then server i's
    ``each[i]`` where given: ``each`` sets the count), started side by side; stopped on exit. ``env``:
    the servers' environment (default: this process's, the strict memory checks, the CPU site)."""
    if env is None:
        env = {**os.environ, **STRICT, "PYTHONPATH": os.pathsep.join([str(HERE / "site"), str(site), str(ROOT)])}
    each = each if each is not None else [()] * count
    with ExitStack() as stack:
        servers = []
        for i, own in enumerate(each):
            port = free_port()
            log_path = log_dir / f"server-{i}.log"
            log = stack.enter_context(open(log_path, "w"))
            command = [sys.executable, "-m", "akv.system.launch_server", "--model-path", str(model), "--port", str(port),
                       *SERVER_ARGS, *args, *own]
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            server = Server(f"http://127.0.0.1:{port}", process, log_path)
            stack.callback(_stop, server)
            servers.append(server)
        for server in servers:
            wait_until_up(server.process, f"{server.url}/health", server.log_path)
        yield servers


def _stop(server: Server) -> None:
    server.kill(15)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill(9)
        server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def reference_url(tiny_qwen3: Path) -> Iterator[str]:
    """The exact CPU reference server on the tiny model, named as the patched servers' model."""
    server = ReferenceServer(Engine(tiny_qwen3, name="default", kv_slots=4096))
    with server.running():
        yield server.url
