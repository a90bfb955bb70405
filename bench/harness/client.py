"""The HTTP client of every benchmark and check (standard library and ``akv.cli`` only): greedy chat
requests with log-probs, the server's Prometheus counters (and AKV's per-request breakdown of a
context request's server time from them), its cache flush and its load. A failed request raises
``akv.cli.RequestFailed`` with the server's answer and the request sent."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from akv import cli

TOOLS = [{"type": "function", "function": {"name": "read_record", "description": "Read one record",
                                          "parameters": {"type": "object", "properties": {"id": {"type": "string"}},
                                                         "required": ["id"]}}}]
"""The one tool of the record-chain conversations the checks send."""


def chat(url: str, body: dict[str, Any], max_tokens: int = 8, top_logprobs: int = 2,
         timeout: float = 600.0) -> dict[str, Any]:
    """A greedy ``/v1/chat/completions`` request (``body`` adds to and overrides model ``default``,
    temperature 0 and log-probs with ``top_logprobs`` alternatives); the reply, with ``seconds``
    (wall time of the request) added."""
    full = {"model": "default", "max_tokens": max_tokens, "temperature": 0.0, "logprobs": True,
            "top_logprobs": top_logprobs, **body}
    started = time.perf_counter()
    reply = cli.request_json(f"{url}/v1/chat/completions", full, timeout=timeout)
    reply["seconds"] = time.perf_counter() - started
    return reply


def tokens(reply: dict[str, Any]) -> list[str]:
    return [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


def logprobs(reply: dict[str, Any]) -> list[float]:
    return [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]


def read_metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """Every ``sglang:`` sample of ``/metrics`` (a server started with ``--enable-metrics``), summed
    over label sets, by name without the prefix."""
    with cli.open_request(f"{url}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sglang:"):
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("sglang:")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def read_load(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's own load (``/v1/loads?include=core``, its first entry): used and pool tokens,
    running and waiting requests."""
    with cli.open_request(f"{url}/v1/loads?include=core", timeout=timeout) as response:
        return json.loads(response.read())["loads"][0]


AKV_COUNTERS = ("context_requests", "admission_seconds", "kernel_first_launches", "prefill_forwards",
                "prefill_wait_seconds", "prefill_rounds_seconds", "prefill_forward_seconds", "prefill_copy_seconds",
                "prefill_host_seconds")
"""The patched server's counters (``akv.system.adapter.metrics``) a context request's time is read from."""

BREAKDOWN_MS = {"admission_ms": "admission_seconds", "wait_ms": "prefill_wait_seconds",
                "rounds_ms": "prefill_rounds_seconds", "forward_ms": "prefill_forward_seconds",
                "copy_ms": "prefill_copy_seconds", "host_ms": "prefill_host_seconds"}
"""Where a context request's server time went, in ms, and the counter each comes from: admission
(match, plan, lock, commit), queue wait, the span from its first prefill round to its last, device
time of its prefill forwards and of the re-rotation copies inside them, and the host time building
their metadata (akv.system.adapter.prefill_timing)."""


def akv_counters(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The :data:`AKV_COUNTERS` the server exports (none on a stock server)."""
    metrics = read_metrics(url, timeout)
    return {name: metrics[f"akv_{name}_total"] for name in AKV_COUNTERS if f"akv_{name}_total" in metrics}


def akv_counters_after(url: str, before: dict[str, float], seconds: float = 5.0) -> dict[str, float]:
    """The counters once a request that started after ``before`` was read has been released (its
    admission time is counted at its release, with its prefill's breakdown; up to ``seconds``)."""
    deadline = time.time() + seconds
    while True:
        now = akv_counters(url)
        if now.get("admission_seconds", 0.0) > before.get("admission_seconds", 0.0) or time.time() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.05)  # the release counts admission first, the breakdown right after
    return akv_counters(url)


def prefill_breakdown(before: dict[str, float], after: dict[str, float], requests: float = 1.0) -> dict[str, float]:
    """Per context request between two reads of :func:`akv_counters` (``requests`` of them): the
    :data:`BREAKDOWN_MS` fields, ``forwards`` and ``kernel_first_launches``."""
    def delta(name: str) -> float:
        return (after.get(name, 0.0) - before.get(name, 0.0)) / max(requests, 1.0)

    out = {field: round(1e3 * delta(name), 3) for field, name in BREAKDOWN_MS.items()}
    out["forwards"] = delta("prefill_forwards")
    out["kernel_first_launches"] = delta("kernel_first_launches")
    return out


def flush_cache(url: str, timeout: float = 60.0, wait_s: float = 10.0) -> int:
    """``POST /flush_cache``: its status; OSError where the server cannot be reached. SGLang refuses
    while its scheduler is not fully idle, which lasts a moment after the last reply arrives: a refusal
    is tried again for up to ``wait_s`` seconds, and the last status returned."""
    deadline = time.time() + wait_s
    while True:
        request = urllib.request.Request(f"{url}/flush_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            if time.time() >= deadline:
                return exc.code
        time.sleep(0.2)


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until the server holds no running or waiting request (``/get_load``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(r["num_reqs"] for r in cli.request_json(f"{url}/get_load", timeout=10)) == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} still busy after {timeout:.0f} s")


def healthy_workers(router: str, timeout: float = 5.0) -> int:
    """How many workers the router (smg) at ``router`` reports healthy; 0 while it does not answer."""
    try:
        with urllib.request.urlopen(f"{router}/workers", timeout=timeout) as response:
            return sum(bool(w.get("is_healthy")) for w in json.loads(response.read())["workers"])
    except (OSError, ValueError, KeyError):
        return 0
