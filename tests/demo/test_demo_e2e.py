"""The demo runs end to end against the reference server with a tiny random model (--scripted)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from akv.system.models.tiny import make_tiny_model
from akv.system.reference_server import Engine, ReferenceServer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from akv_demo.harness import DemoConfig, DemoResult, record_tokens, run_demo  # noqa: E402
from akv_demo.records import ShipmentChain  # noqa: E402
from akv_demo.server_wait import ServerNotReady, wait_for_model  # noqa: E402

STEP_FILES = ("payload_before", "payload_after", "history", "reply", "usage", "action")
CHAIN = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("demo-model") / "tiny", seed=11)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ReferenceServer]:
    server = ReferenceServer(Engine(model_dir, name="tiny", kv_slots=16384))
    with server.running():
        yield server


@pytest.fixture()
def server_url(server: ReferenceServer) -> str:
    """The shared server, with an empty cache: each run starts cold, so its usage is its own."""
    server.engine.cache.flush()
    return server.url


def run(server_url: str, output: Path, policy: str, tokenizer_dir: Path | None = None) -> tuple[DemoResult, list[str]]:
    lines: list[str] = []
    config = DemoConfig(base_url=server_url, model="tiny", output=output, policy=policy, scripted=True,
                        steps=CHAIN, manifest_lines=5, max_tokens=6, tokenizer_dir=tokenizer_dir)
    return run_demo(config, log=lines.append), lines


def load(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("policy", ["turn", "token", "token-exact", "model"])
def test_scripted_demo_follows_the_chain_and_the_cache_ops_take_effect(server_url: str, model_dir: Path,
                                                                       tmp_path: Path, policy: str) -> None:
    out = tmp_path / "run"
    exact = policy == "token-exact"
    result, lines = run(server_url, out, "token" if exact else policy, model_dir if exact else None)
    chain = ShipmentChain.generate(CHAIN, manifest_lines=5, seed=7)

    # The chain was followed to its end: every record in order, then the final answer.
    assert result.chain_completed
    assert result.records_read == chain.ids
    assert chain.final_location in (result.final_answer or "")
    steps = sorted((out / "steps").iterdir())
    assert len(steps) == len(result.records) == CHAIN + 1
    last_record = [m for m in load(steps[-1] / "payload_before.json")["messages"]
                   if m["role"] == "tool" and "FINAL DESTINATION" in m["content"]]
    assert len(last_record) == 1 and chain.final_location in last_record[0]["content"]

    # Drops and repositions were sent, and the server reported them back in usage.
    sent = [load(step / "payload_after.json") for step in steps]
    assert any(p.get("drop_message") for p in sent) and any(p.get("reposition") for p in sent)
    usages = [load(step / "usage.json") for step in steps]
    assert any(u["prompt_tokens_details"]["drop_skipped_tokens"] > 0 for u in usages)
    assert any(u["prompt_tokens_details"]["repos_tokens"] > 0 for u in usages)
    assert any(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages)

    for step, payload in zip(steps, sent, strict=True):
        before = load(step / "payload_before.json")
        assert "drop_message" not in before and "reposition" not in before
        assert payload["messages"] == before["messages"], "the policy must never edit messages"
        reply = load(step / "reply.json")
        assert reply["message"]["role"] == "assistant" and isinstance(reply["message"]["content"], str)
        assert reply["finish_reason"] in ("stop", "length")
        assert load(step / "usage.json")["completion_tokens"] >= 1
    for i in range(1, CHAIN + 2):
        assert sum(line.startswith(f"[step {i:2d}] sending") for line in lines) == 1
        assert sum(line.startswith(f"[step {i:2d}] served") for line in lines) == 1


def test_artifacts_are_complete_and_valid(server_url: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result, _ = run(server_url, out, "turn")
    run_info = load(out / "run.json")
    assert run_info["policy"] == "turn" and run_info["scripted"] is True
    for step in sorted((out / "steps").iterdir()):
        for name in STEP_FILES:
            load(step / f"{name}.json")
        trace = step / "trace"
        assert trace.is_dir() and any(trace.iterdir()), f"{trace} holds no call trace"
    summary = load(out / "summary.json")
    assert summary["chain_completed"] is True
    assert [s["step"] for s in summary["steps"]] == list(range(1, CHAIN + 2))
    for row in summary["steps"]:
        usage = load(out / "steps" / f"{row['step']:02d}" / "usage.json")
        assert row["prompt_tokens"] == usage["prompt_tokens"]
        details = usage["prompt_tokens_details"]
        assert row["drop_skipped_tokens"] == details["drop_skipped_tokens"]
        assert row["computed_tokens"] == details["computed_tokens"]
        # The dropped tokens nothing read are among the tokens a drop hid.
        assert 0 <= row["unread_tokens"] <= details["drop_skipped_tokens"]
    assert summary["totals"]["prompt_tokens"] == sum(r.prompt_tokens for r in result.records)
    table, meanings = (out / "summary.txt").read_text().split("\n\nColumns:\n")
    assert len(table.splitlines()) == 2 + (CHAIN + 1) + 2
    assert [line.split()[0] for line in meanings.splitlines()] == table.splitlines()[0].split()
    svg = ET.parse(out / "plot.svg").getroot()
    assert svg.tag.endswith("svg")
    assert len([e for e in svg.iter() if e.tag.endswith("rect")]) > CHAIN + 1


def test_cli_with_embedded_server(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    command = [sys.executable, str(ROOT / "examples" / "demo.py"), "--model-path", str(model_dir),
               "--output", str(out), "--scripted", "--steps", "2", "--manifest-lines", "3", "--max-tokens", "3"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "chain completed: True" in done.stdout
    assert load(out / "summary.json")["chain_completed"] is True
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 2 and "not empty" in again.stderr


def test_cli_checks_the_output_folder_before_loading_the_model(tmp_path: Path) -> None:
    out = tmp_path / "used"
    out.mkdir()
    (out / "summary.txt").write_text("an earlier run\n")
    # the model path is missing too: the output folder must be refused first, before any model load
    command = [sys.executable, str(ROOT / "examples" / "demo.py"), "--model-path", str(tmp_path / "missing"),
               "--output", str(out), "--scripted"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert "--output" in done.stderr and "not empty" in done.stderr
    assert "starting the embedded reference server" not in done.stdout and "is not a directory" not in done.stderr
    assert (out / "summary.txt").read_text() == "an earlier run\n"


def test_cli_reports_a_bad_model_path_without_a_traceback(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "examples" / "demo.py"), "--model-path", str(tmp_path / "missing"),
               "--output", str(tmp_path / "out"), "--scripted"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "missing" in done.stderr and "is not a directory" in done.stderr


def test_record_size_is_counted_in_a_conversation_a_qwen3_style_template_accepts(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    from akv.agent.tokens import ChatTemplateTokenCounter

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Qwen3's template refuses a message list without a user query; a lone tool message is such a list.
    tokenizer.chat_template = (
        "{%- set ns = namespace(query=false) %}{%- for m in messages %}{%- if m.role == 'user' %}"
        "{%- set ns.query = true %}{%- endif %}{%- endfor %}"
        "{%- if not ns.query %}{{- raise_exception('No user query found in messages.') }}{%- endif %}"
        + tokenizer.chat_template)
    chain = ShipmentChain.generate(CHAIN, manifest_lines=5, seed=7)
    counted = record_tokens(chain, ChatTemplateTokenCounter(tokenizer))
    record = tokenizer(chain.read(chain.first_id), add_special_tokens=False)["input_ids"]
    assert len(record) <= counted <= len(record) + 16


def models_server(port: int, models: list[str]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps({"object": "list", "data": [{"id": m} for m in models]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def test_demo_waits_for_a_server_started_in_the_background() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started: list[ThreadingHTTPServer] = []

    def start_late() -> None:
        time.sleep(1.0)
        server = models_server(port, ["smollm2"])
        started.append(server)
        server.serve_forever()

    thread = threading.Thread(target=start_late, daemon=True)
    thread.start()
    lines: list[str] = []
    try:
        wait_for_model(f"http://127.0.0.1:{port}", "smollm2", 30, log=lines.append)
        with pytest.raises(ServerNotReady, match=r"--model 'other' is not served at .*; it serves \['smollm2'\]"):
            wait_for_model(f"http://127.0.0.1:{port}/v1", "other", 30, log=lines.append)
    finally:
        while not started:
            time.sleep(0.1)
        started[0].shutdown()
        started[0].server_close()
    assert lines == [f"waiting for the server at http://127.0.0.1:{port} (up to 30 s) ..."]
    with pytest.raises(ServerNotReady, match="no answer from .* within 1 s"):
        wait_for_model(f"http://127.0.0.1:{port}", "smollm2", 1, log=lines.append)
