"""The scripted demo against the patched SGLang server on a GPU, checked against the CPU reference server.

Needs the AKV SGLang build installed (``python -m akv.system._build --out dist --install``) and a CUDA
device; starts ``python -m akv.system.launch_server`` on a tiny random Qwen3 model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server import Engine, ReferenceServer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from akv_demo.harness import DemoConfig, run_demo  # noqa: E402

pytestmark = pytest.mark.gpu
READY_TIMEOUT_S = float(os.environ.get("AKV_SERVER_READY_TIMEOUT_S", "420"))
CHAIN = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpu-demo") / "tiny-qwen3", seed=5, vocab_size=4096,
                           hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=64, dtype="bfloat16")


@pytest.fixture(scope="module")
def sglang_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = (tmp_path_factory.mktemp("sglang-log") / "server.log").open("w")
    command = [sys.executable, "-m", "akv.system.launch_server", "--model-path", str(model_dir),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
               "--tool-call-parser", "qwen", "--max-total-tokens", "65536", "--disable-cuda-graph"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"launch_server exited with {process.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"launch_server not healthy after {READY_TIMEOUT_S} s; see {log.name}")
            time.sleep(2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _run(url: str, output: Path) -> list[dict]:
    result = run_demo(DemoConfig(base_url=url, model="tiny", output=output, policy="turn", scripted=True,
                                 steps=CHAIN, manifest_lines=5, max_tokens=6), log=lambda line: None)
    assert result.chain_completed
    return [json.loads((output / "steps" / f"{r.step:02d}" / "usage.json").read_text()) for r in result.records]


@pytest.fixture(scope="module")
def runs(sglang_url: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    out = tmp_path_factory.mktemp("demo-runs")
    gpu = _run(sglang_url, out / "gpu")
    reference = ReferenceServer(Engine(model_dir, name="tiny"))
    reference.start_in_background()
    try:
        cpu = _run(reference.url, out / "cpu")
    finally:
        reference.shutdown()
        reference.server_close()
    return gpu, cpu


def test_scripted_demo_on_sglang_renders_the_same_prompts_as_the_reference_server(runs) -> None:
    gpu, cpu = runs
    assert [u["prompt_tokens"] for u in gpu] == [u["prompt_tokens"] for u in cpu]


def test_scripted_demo_on_sglang_reports_the_reference_usage(runs) -> None:
    """Steps with drop_message/reposition report the same three counters as the reference server
    (plain steps report SGLang's own cache details, which the server prints only with
    --enable-cache-report)."""
    gpu, cpu = runs
    context = [i for i, u in enumerate(gpu) if "drop_skipped_tokens" in (u.get("prompt_tokens_details") or {})]
    assert context, "no step of the demo reported AKV usage"
    assert any(gpu[i]["prompt_tokens_details"]["drop_skipped_tokens"] > 0 for i in context)
    assert any(gpu[i]["prompt_tokens_details"]["repos_tokens"] > 0 for i in context)
    assert [gpu[i]["prompt_tokens_details"] for i in context] == [cpu[i]["prompt_tokens_details"] for i in context]
