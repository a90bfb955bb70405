"""Every command a user can run: ``--help`` works without a server, a GPU or environment variables
and shows the defaults; a failed request prints the server's answer and the request sent and exits
non-zero; a result file is never replaced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for folder in ("bench", "tools/gpu", "examples") for p in (ROOT / folder).glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__main__")
                 for p in (ROOT / "akv").rglob("*.py") if 'if __name__ == "__main__":' in p.read_text(encoding="utf-8"))
ENTRY_POINTS = [*SCRIPTS, *(f"-m {m}" for m in MODULES)]
NO_DEFAULTS = {"bench/segment_serialization.py": "its only option is --out", "-m akv.system.models": "subcommands"}


def bare_env() -> dict[str, str]:
    """No server URL, model or output folder in the environment, no GPU, and this checkout's akv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AKV_", "SGLANG_")) and k not in ("OUT", "MODEL_DIR")}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """``--help`` of every entry point, run side by side from an empty folder."""
    cwd = tmp_path_factory.mktemp("help")

    def run(entry: str) -> subprocess.CompletedProcess:
        argv = entry.split() if entry.startswith("-m ") else [str(ROOT / entry)]
        return subprocess.run([sys.executable, *argv, "--help"], cwd=cwd, env=bare_env(), capture_output=True,
                              text=True, timeout=300)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(ENTRY_POINTS, pool.map(run, ENTRY_POINTS)))


def test_the_entry_points_are_found() -> None:
    for expected in ("bench/plain_backend.py", "bench/akv_config_matrix.py", "bench/akv_served_check.py",
                     "examples/demo.py", "-m akv.system.launch_server", "-m akv.system.reference_server"):
        assert expected in ENTRY_POINTS


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_help_works_bare_and_shows_defaults(helps: dict[str, subprocess.CompletedProcess], entry: str) -> None:
    done = helps[entry]
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:") and "Traceback" not in done.stderr
    if entry not in NO_DEFAULTS:
        assert "(default" in done.stdout or "default:" in done.stdout, done.stdout


class _Refusing(BaseHTTPRequestHandler):
    """Lists one model; every other request gets a 400 with a body (or all do, with ``refuse_all``)."""

    refuse_all = False
    body = {"object": "error", "message": "akv-test-answer: reposition[1] is out of order", "code": 400}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models" and not self.refuse_all:
            self._send(200, {"data": [{"id": "m"}]})
        else:
            self._send(400, self.body)

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(400, self.body)

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("refuse_all", [False, True], ids=["chat-requests-refused", "every-request-refused"])
def test_a_refused_request_prints_the_answer_and_the_request_and_exits_nonzero(refuse_all: bool) -> None:
    handler = type("Handler", (_Refusing,), {"refuse_all": refuse_all})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tools/gpu/smoke_client.py"), "--base",
                               f"http://127.0.0.1:{server.server_address[1]}", "--timeout", "20"],
                              env=bare_env(), capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    printed = done.stdout + done.stderr
    assert done.returncode != 0
    assert "akv-test-answer: reposition[1] is out of order" in printed and "HTTP 400" in printed
    if not refuse_all:  # the chat requests' bodies are printed with their answers
        assert "request body: " in printed and '"messages"' in printed


@pytest.fixture()
def refusing_url():
    """A server that lists one model and answers every other request with a 400 and a body."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_replay_whose_requests_are_refused_prints_them_and_exits_nonzero(refusing_url: str, tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench/serve_replay.py"), "--url", refusing_url, "--model-path",
                           str(tiny_model_dir), "--count", "1", "--max-turns", "2", "--concurrency", "1",
                           "--methods", "full", "--out", str(tmp_path / "replay.json")],
                          env=bare_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "akv-test-answer: reposition[1] is out of order" in done.stderr and "request body: " in done.stderr
    assert '"messages"' in done.stderr


def test_a_result_file_is_never_replaced(tmp_path: Path) -> None:
    existing = tmp_path / "result.json"
    existing.write_text("{}")
    done = subprocess.run([sys.executable, str(ROOT / "bench/agent_process.py"), "--out", str(existing)],
                          env=bare_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "exists; results are never replaced" in done.stderr
    assert existing.read_text() == "{}"


def test_the_console_scripts_name_callables() -> None:
    import importlib
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert set(scripts) == {"akv-server", "akv-router", "akv-reference-server", "akv-demo"}
    sys.path.insert(0, str(ROOT / "examples"))  # where the packaging finds akv_demo
    try:
        for target in scripts.values():
            module, _, name = target.partition(":")
            assert callable(getattr(importlib.import_module(module), name)), target
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.mark.parametrize("entry", ["-m akv.system.launch_server", "-m akv.system.launch_router", "-m akv.system.reference_server",
                                   "examples/demo.py"])
def test_version(entry: str) -> None:
    from akv import __version__

    argv = entry.split() if entry.startswith("-m ") else [str(ROOT / entry)]
    done = subprocess.run([sys.executable, *argv, "--version"], env=bare_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(f"akv {__version__}"), done.stdout + done.stderr
