"""The HTTP client of every benchmark and check (standard library and ``akv.cli`` only): greedy chat
requests with log-probs, the server's Prometheus counters, its cache flush and its load. A failed
request raises ``akv.cli.RequestFailed`` with the server's answer and the request sent."""

from __future__ import annotations

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


def flush_cache(url: str, timeout: float = 60.0) -> int:
    """``POST /flush_cache``: its status (SGLang refuses while requests run); OSError where the server
    cannot be reached."""
    request = urllib.request.Request(f"{url}/flush_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until the server holds no running or waiting request (``/get_load``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if sum(r["num_reqs"] for r in cli.request_json(f"{url}/get_load", timeout=10)) == 0:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{url} still busy after {timeout:.0f} s")
