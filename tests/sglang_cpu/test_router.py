"""Many workers behind a router: smg 1.13, started by ``python -m akv.system.launch_router``, in front of
two patched CPU servers on the tiny model. Two conversations with drops and repositions, four turns
each, keyed by their routing key (``akv.agent.routing_key``, what ``send_chat_request`` sends): every
turn reaches its conversation's worker (the router's ``x-smg-routed-worker-id``) and equals, in
tokens and usage, the exact reference server that mirrors that worker (it was sent the same requests
in the same order). Then the first conversation's worker is killed: the next turn is still answered
(no request lost), on the other worker, exact, and it reads from the cache only what that worker held
(less than the killed worker's mirror would have: the rest was recovered by prefill). Each worker's
``/server_info`` names its live and cached KV and its context requests."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from akv.agent import ROUTING_HEADER, routing_key
from akv.system.reference_server import Engine, ReferenceServer
from bench.harness.client import healthy_workers

from .conftest import ROOT, Server, free_port, patched_servers
from .test_http import post
from http_client import exchange

pytestmark = pytest.mark.slow

WORKER_HEADER = "x-smg-routed-worker-id"
FIELDS = [  # after turn k (messages 0 .. 2k+1): drops and repositions so far
    {"drop_message": {"3": [2]}, "reposition": [3]},
    {"drop_message": {"3": [2], "5": [3]}, "reposition": [3]},
    {"drop_message": {"3": [2], "5": [3], "7": [5]}, "reposition": [3, 7]},
    {"drop_message": {"3": [2], "5": [3], "7": [5], "9": [4, 7]}, "reposition": [3, 7]},
]


def conversation(name: str, turn: int) -> dict[str, Any]:
    """Turn ``turn`` (1-4) of conversation ``name``: a system message, the task, then per turn an
    assistant message and a record."""
    messages = [{"role": "system", "content": "You follow record chains."},
                {"role": "user", "content": f"Read record {name}1 and follow the chain."}]
    for k in range(1, turn + 1):
        messages += [{"role": "assistant", "content": f"Reading {name}{k}."},
                     {"role": "user", "content": f"Record {name}{k}: crate {k} of chain {name} moved; see {name}{k + 1}."}]
    return {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0.0, **FIELDS[turn - 1]}


def server_info(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/server_info", timeout=60) as response:
        return json.loads(response.read())["internal_states"][0]["akv"]


@pytest.fixture(scope="module")
def fleet(patched_site: Path, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[str, list[Server], dict[str, str]]]:
    """The router's URL, the two workers and, per worker URL, the URL of its mirroring reference server."""
    log_dir = tmp_path_factory.mktemp("router")
    with patched_servers(patched_site, tiny_qwen3, log_dir, count=2, args=("--served-model-name", "default")) as workers:
        port = free_port()
        command = [sys.executable, "-m", "akv.system.launch_router", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *(w.url for w in workers), "--policy", "round_robin",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        log_path = log_dir / "router.log"
        with open(log_path, "w") as log:
            router = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        mirrors = [ReferenceServer(Engine(tiny_qwen3, name="default", kv_slots=4096)) for _ in workers]
        try:
            deadline = time.time() + 120
            while healthy_workers(url) < len(workers):
                assert router.poll() is None and time.time() < deadline, log_path.read_text()[-4000:]
                time.sleep(1)
            with mirrors[0].running(), mirrors[1].running():
                yield url, workers, {w.url: m.url for w, m in zip(workers, mirrors)}
        finally:
            with contextlib.suppress(ProcessLookupError):  # a router that exited (e.g. refused) has no group left
                os.killpg(router.pid, 9)
            router.wait(timeout=30)


def routed(router: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Send ``body`` through the router with its conversation's routing key: the worker and the reply's
    content and usage."""
    status, text, headers = exchange(router, body, timeout=600, headers={ROUTING_HEADER: routing_key(body)})
    assert status == 200, text
    reply = json.loads(text)
    return headers[WORKER_HEADER], {"content": reply["choices"][0]["message"]["content"], "usage": reply["usage"]}


def same_as_mirror(reply: dict[str, Any], mirror: str, body: dict[str, Any]) -> dict[str, Any]:
    """Assert ``reply`` equals the mirror's answer to ``body``, tokens and usage; the mirror's usage."""
    status, want = post(mirror, body)
    assert status == 200, want
    assert reply["content"] == want["content"]
    for key in ("prompt_tokens", "completion_tokens", "prompt_tokens_details"):
        assert reply["usage"][key] == want["usage"][key], key
    return want["usage"]


@pytest.fixture(scope="module")
def before_the_kill(fleet: tuple[str, list[Server], dict[str, str]]) -> dict[str, Any]:
    """Turns 1 and 2 of A and B through the router, each checked against its worker's mirror; then
    each worker's load report at rest."""
    router, workers, mirrors = fleet
    served: dict[str, list[str]] = {"A": [], "B": []}
    last_prompt: dict[str, int] = {}
    for turn in (1, 2):
        for name in ("A", "B"):
            body = conversation(name, turn)
            worker, reply = routed(router, body)
            same_as_mirror(reply, mirrors[worker], body)
            served[name].append(worker)
            last_prompt[worker] = reply["usage"]["prompt_tokens"]
    return {"served": served, "last_prompt": last_prompt, "info": {w.url: server_info(w.url) for w in workers}}


def test_each_conversation_stays_on_its_worker_and_equals_its_mirror(before_the_kill: dict[str, Any]) -> None:
    served = before_the_kill["served"]
    assert len(set(served["A"])) == 1 and len(set(served["B"])) == 1, served
    assert served["A"][0] != served["B"][0], "round_robin puts the second new key on the other worker"


def test_server_info_splits_each_workers_kv_at_rest(before_the_kill: dict[str, Any]) -> None:
    for url, info in before_the_kill["info"].items():
        assert info["kv_live_tokens"] == 0 and info["requests_running"] == info["context_requests_running"] == 0
        assert info["kv_cached_tokens"] + info["kv_free_tokens"] == info["kv_capacity_tokens"]
        assert info["kv_cached_tokens"] >= before_the_kill["last_prompt"][url], "its conversation's KV is resident"


def test_a_dead_workers_conversation_moves_and_is_recovered_exactly(
        fleet: tuple[str, list[Server], dict[str, str]], before_the_kill: dict[str, Any]) -> None:
    router, workers, mirrors = fleet
    dead_url = before_the_kill["served"]["A"][0]
    survivor = next(w.url for w in workers if w.url != dead_url)
    next(w for w in workers if w.url == dead_url).kill()
    usage = []
    for turn in (3, 4):
        for name in ("A", "B"):
            body = conversation(name, turn)
            worker, reply = routed(router, body)
            assert worker == survivor, (name, turn)
            same_as_mirror(reply, mirrors[worker], body)
            if name == "A":
                usage.append(reply["usage"]["prompt_tokens_details"])
            if (name, turn) == ("A", 3):  # what the killed worker would have read from its cache
                would = post(mirrors[dead_url], body)[1]["usage"]["prompt_tokens_details"]
                assert usage[0]["cached_tokens"] + usage[0]["repos_tokens"] < would["cached_tokens"] + would["repos_tokens"]
    assert usage[1]["cached_tokens"] > usage[0]["cached_tokens"], "the next turn reads the recovered KV from the cache"


def test_server_info_counts_a_running_context_request(fleet: tuple[str, list[Server], dict[str, str]],
                                                       before_the_kill: dict[str, Any]) -> None:
    router, workers, mirrors = fleet
    body = {**conversation("A", 4), "max_tokens": 12}
    seen: list[dict[str, int]] = []
    done: list[tuple[str, dict[str, Any]]] = []
    sender = threading.Thread(target=lambda: done.append(routed(router, body)))
    sender.start()
    alive = [w.url for w in workers if w.process.poll() is None]
    while sender.is_alive():
        seen += [info for info in map(server_info, alive) if info["context_requests_running"]]
        time.sleep(0.2)
    sender.join()
    worker, reply = done[0]
    same_as_mirror(reply, mirrors[worker], body)
    assert seen, "the request was never seen running"
    for info in seen:
        assert info["context_requests_running"] == 1 and info["requests_running"] >= 1
        assert 0 < info["kv_live_tokens"] <= info["kv_capacity_tokens"] - info["kv_free_tokens"]
