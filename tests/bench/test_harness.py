"""bench/harness, the measuring scripts' shared pieces: every result starts with the exact command,
the commit, the date and the machine; results already committed still load; no device script
writes to a fixed path under /tmp (a work folder comes from mktemp or the checkout); a context
request's server time is read from the patched server's counters."""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from bench.harness import client, results

ROOT = Path(__file__).resolve().parents[2]


def test_the_header_names_the_command_commit_date_and_machine() -> None:
    head = results.header("bench/x.py", ["--out", "a b.json"])
    assert shlex.split(head["command"]) == ["python", "bench/x.py", "--out", "a b.json"]
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if git.returncode == 0:
        assert head["commit"].split("+")[0] == git.stdout.strip()
    when = datetime.datetime.strptime(head["date"], "%Y-%m-%dT%H:%M:%SZ")
    assert abs((datetime.datetime.utcnow() - when).total_seconds()) < 120
    assert head["machine"]["cpus"] == os.cpu_count() and len(head["machine"]["load_average"]) == 3


@pytest.mark.parametrize("gpus, named, other", [(["GPU 0: NVIDIA H100 80GB HBM3"], "H100 80GB HBM3", "H200"),
                                                 (["GPU 0: NVIDIA H200"], "H200", "H100")])
def test_a_replay_suite_result_names_the_gpu_it_ran_on_and_its_pool(gpus: list[str], named: str, other: str) -> None:
    from bench import replay_suite

    args = replay_suite.parse_args(["--servers", "in-turn", "--pool-tokens", "300000"])
    label = replay_suite.suite_label(args, {"gpus": gpus})
    assert label.startswith(f"{named}, Qwen3-8B shape") and other not in label
    assert "pool 300000 tokens each" in label


def test_a_result_is_written_and_copied_to_out_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    results.write({"a": 1}, tmp_path / "r" / "kept.json")
    results.write({"b": 2}, tmp_path / "r" / "copied.json", copy_to_out=True)
    assert json.loads((tmp_path / "r" / "kept.json").read_text()) == {"a": 1}
    assert [p.name for p in out.iterdir()] == ["copied.json"]
    assert json.loads((out / "copied.json").read_text()) == {"b": 2}


@pytest.mark.parametrize("path", sorted((ROOT / "bench" / "results").glob("*.json")), ids=lambda p: p.name)
def test_committed_results_still_load(path: Path) -> None:
    result = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(result, (dict, list))


DEVICE_SCRIPTS = sorted([*(ROOT / "tools" / "gpu").iterdir(), *(ROOT / "bench").glob("*.py"),
                         *(ROOT / "bench" / "harness").glob("*.py")])


def test_no_device_script_names_a_fixed_path_under_tmp() -> None:
    fixed = {}
    for path in DEVICE_SCRIPTS:
        text = path.read_text(encoding="utf-8").replace('mktemp -d "${TMPDIR:-/tmp}/', "mktemp -d ")
        found = re.findall(r"/tmp/[\w.-]+", text)
        if found:
            fixed[str(path.relative_to(ROOT))] = found
    assert fixed == {}
    assert (ROOT / "tools" / "gpu" / "run.sh") in DEVICE_SCRIPTS


METRICS = """# HELP sglang:akv_admission_seconds_total Host seconds.
# TYPE sglang:akv_admission_seconds_total counter
sglang:akv_admission_seconds_total{model_name="m"} 0.5
sglang:akv_prefill_forwards_total{model_name="m"} 3.0
sglang:akv_prefill_forward_seconds_total{model_name="m"} 0.25
sglang:akv_prefill_host_seconds_total{model_name="m"} 0.004
sglang:akv_context_requests_total{model_name="m"} 2.0
sglang:num_running_reqs{model_name="m"} 1.0
"""


def test_akv_counters_are_read_from_metrics_and_differenced_per_request(tmp_path: Path) -> None:
    import http.server
    import threading

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server hook
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        got = client.akv_counters(f"http://127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
    assert got == {"admission_seconds": 0.5, "prefill_forwards": 3.0, "prefill_forward_seconds": 0.25,
                   "prefill_host_seconds": 0.004, "context_requests": 2.0}
    before = {"admission_seconds": 0.1, "prefill_forwards": 1.0, "prefill_forward_seconds": 0.05}
    per = client.prefill_breakdown(before, got, requests=2)
    assert per == {"admission_ms": 200.0, "wait_ms": 0.0, "rounds_ms": 0.0, "forward_ms": 100.0, "copy_ms": 0.0,
                   "host_ms": 2.0, "forwards": 1.0, "kernel_first_launches": 0.0}


@pytest.mark.parametrize("refusals, wait_s, expected", [(3, 10.0, 200), (1000, 0.5, 400)])
def test_a_flush_refused_while_the_scheduler_settles_is_tried_again(refusals: int, wait_s: float,
                                                                    expected: int) -> None:
    """SGLang answers ``/flush_cache`` with a 400 until its scheduler is fully idle, a moment after the
    last reply (the next-turn dry run failed on it once): the flush is tried again, within ``wait_s``."""
    import http.server
    import threading

    posts = []

    class Flush(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server hook
            posts.append(self.path)
            self.send_response(400 if len(posts) <= refusals else 200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Flush)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        status = client.flush_cache(f"http://127.0.0.1:{server.server_port}", wait_s=wait_s)
    finally:
        server.shutdown()
    assert status == expected and set(posts) == {"/flush_cache"}
    assert len(posts) == refusals + 1 if expected == 200 else len(posts) > 1
