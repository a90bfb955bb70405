"""A real PD pair on the CPU: a prefill and a decode server (``python -m akv.system.launch_server
--disaggregation-mode prefill|decode``, FP32 tiny Qwen3) joined by Mooncake's transfer engine over TCP
(``mooncake_tcp``), against the exact CPU reference server. Every request goes to both servers with
the same bootstrap room, as a router sends it; the decode server's replies and usage must equal the
reference server's for plain turns and for context turns (a drop with a reposition, a drop alone, whose
next position is not the kept count, a later drop, a repeat that reuses the prefill server's cache, a
drop and reposition anchored at the last message and its repeat, streamed and not), and so must three
context turns through smg's PD router (``python -m akv.system.launch_router --pd-disaggregation``) as
the README starts it. Both servers run SGLang's strict memory checks (a leaked slot stops the
scheduler) and must still be up at the end.

Mooncake's engine needs libraries a CPU machine lacks (``tests/sglang_cpu/mooncake_cpu.py`` makes them
once per machine); without them the test skips and says which step failed."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from akv.system import _build
from bench import pd_check
from bench.harness.client import healthy_workers

from .conftest import STRICT, Server, free_port, patched_servers
from .mooncake_cpu import MooncakeCpu, prepare
from http_client import post_text

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MESSAGES, TURNS = pd_check.MESSAGES, pd_check.PAIR_TURNS


@pytest.fixture(scope="module")
def mooncake() -> MooncakeCpu:
    found = prepare(_build.default_cache_dir().parent / "mooncake-cpu")
    if isinstance(found, str):
        pytest.skip(f"Mooncake's transfer engine cannot run here: {found}")
    return found


@pytest.fixture(scope="module")
def pair(patched_site: Path, tiny_qwen3: Path, mooncake: MooncakeCpu,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, int]]:
    """The prefill and the decode server, and the prefill server's bootstrap port."""
    logs = tmp_path_factory.mktemp("pd-pair")
    env = mooncake.env({**os.environ, **STRICT,
                        # the early send of a cached prefix records a CUDA event
                        "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false",
                        "PYTHONPATH": os.pathsep.join([str(HERE / "site"), str(patched_site), str(ROOT)])})
    bootstrap = free_port()
    each = [("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)),
            ("--disaggregation-mode", "decode")]
    with patched_servers(patched_site, tiny_qwen3, logs, args=("--served-model-name", "default",
                         "--disaggregation-transfer-backend", "mooncake_tcp"), each=each, env=env) as (prefill, decode):
        yield prefill, decode, bootstrap


def _result(status: int, text: str, streamed: bool) -> tuple[int, Any]:
    if status != 200:
        return status, text
    if streamed:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        return status, {"content": content, "usage": next(e["usage"] for e in events if e.get("usage"))}
    reply = json.loads(text)
    return status, {"content": reply["choices"][0]["message"]["content"], "usage": reply["usage"]}


def _pd_post(pair: tuple[Server, Server, int], body: dict[str, Any]) -> dict[str, tuple[int, Any]]:
    """``body`` to both servers at once with one bootstrap room (as smg's PD router does)."""
    prefill, decode, bootstrap = pair
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
            "bootstrap_room": random.randrange(1, 2**62)}
    out: dict[str, tuple[int, Any]] = {}

    def send(name: str, url: str) -> None:
        out[name] = _result(*post_text(url, body, timeout=600), bool(body.get("stream")))

    threads = [threading.Thread(target=send, args=item) for item in (("prefill", prefill.url), ("decode", decode.url))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


@pytest.fixture(scope="module")
def served(pair: tuple[Server, Server, int], reference_url: str) -> list[tuple[str, Any, Any]]:
    out = []
    for name, fields in TURNS:
        body = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, **fields}
        got = _pd_post(pair, body)
        want = _result(*post_text(reference_url, body, timeout=600), bool(body.get("stream")))
        assert got["prefill"][0] == 200 and got["decode"][0] == 200 and want[0] == 200, (name, got, want)
        out.append((name, got["decode"][1], want[1]))
    return out


def test_replies_equal_the_reference_servers(served: list) -> None:
    for name, got, want in served:
        assert got["content"] == want["content"], name


def test_usage_equals_the_reference_servers(served: list) -> None:
    """The decode server reports the text's prompt_tokens and the prefill server's usage counters."""
    for name, got, want in served:
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"], name
        assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], name
        if name != "plain":
            assert got["usage"]["prompt_tokens_details"] == want["usage"]["prompt_tokens_details"], name
    repeat = dict((n, g) for n, g, _ in served)["drop-and-repos-again"]
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the repeat reuses the prefill server's cache"


@pytest.fixture(scope="module")
def router(pair: tuple[Server, Server, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """smg in PD mode in front of the pair (its URL)."""
    prefill, decode, bootstrap = pair
    port = free_port()
    command = [sys.executable, "-m", "akv.system.launch_router", "--pd-disaggregation", "--prefill", prefill.url,
               str(bootstrap), "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log_path = tmp_path_factory.mktemp("pd-router") / "router.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while healthy_workers(url) < 2:
            assert process.poll() is None and time.time() < deadline, log_path.read_text()[-4000:]
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait(timeout=30)


def test_context_turns_through_smgs_pd_router_equal_the_reference_servers(router: str, reference_url: str,
                                                                          served: list) -> None:
    for name, fields in TURNS[1:4]:
        body = {"model": "default", "messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, **fields}
        got = _result(*post_text(router, body, timeout=600), False)
        want = _result(*post_text(reference_url, body, timeout=600), False)
        assert got[0] == 200, (name, got)
        assert got[1]["content"] == want[1]["content"], name
        assert got[1]["usage"]["prompt_tokens"] == want[1]["usage"]["prompt_tokens"], name
        assert got[1]["usage"]["prompt_tokens_details"] == want[1]["usage"]["prompt_tokens_details"], name


def test_both_servers_are_up_after_everything(pair: tuple[Server, Server, int], served: list, router: str) -> None:
    """Their strict idle and busy memory checks stop a scheduler that leaked a slot."""
    for server in pair[:2]:
        assert server.process.poll() is None, server.log_path.read_text()[-4000:]
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as response:
            assert response.status == 200
