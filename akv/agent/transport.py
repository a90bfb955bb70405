"""`send_chat_request`: streaming chat completion over HTTP(S) + SSE, standard library only."""

from __future__ import annotations

import http.client
import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from akv.agent.assembly import StreamAssembler, is_context_length_error
from akv.agent.errors import ContextLengthError, HTTPStatusError, TransportError
from akv.agent.results import GenerationResult, Timings
from akv.agent.sse import SSEParser
from akv.agent.trace import CallTrace

_CHUNK = 65536


def chat_completions_url(base_url: str) -> str:
    """`http(s)://host[:port][/prefix]` -> the `/v1/chat/completions` URL under it (kept if already there)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"base_url must be an http(s) URL with a host, got {base_url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"base_url must not carry credentials, a query or a fragment, got {base_url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions" if path.endswith("/v1") else "/v1/chat/completions"
    return f"{parts.scheme}://{parts.netloc}{path}"


def send_chat_request(base_url: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None,
                      timeout: float = 600.0, trace: str | os.PathLike[str] | None = None) -> GenerationResult:
    """POST `payload` with `stream: true` (and `stream_options: {"include_usage": true}` when the payload
    has no `stream_options`) and assemble the SSE reply. `timeout` bounds each socket operation. With
    `trace`, a new directory of that name records the call. Raises HTTPStatusError, ContextLengthError,
    StreamError, IncompleteStreamError or TransportError (all BackendError)."""
    if payload.get("stream") is False:
        raise ValueError("send_chat_request is streaming-only; payload has stream=false")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    url = chat_completions_url(base_url)
    body_obj = dict(payload)
    body_obj["stream"] = True
    body_obj.setdefault("stream_options", {"include_usage": True})
    body = json.dumps(body_obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
    all_headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}
    recorder = CallTrace(trace) if trace is not None else None
    result: GenerationResult | None = None
    error: BaseException | None = None
    try:
        if recorder is not None:
            recorder.request(url, all_headers, body, float(timeout))
        result = _exchange(url, body, all_headers, float(timeout), recorder)
        return result
    except BaseException as exc:
        error = exc
        raise
    finally:
        if recorder is not None:
            recorder.finish(result, error)


def _exchange(url: str, body: bytes, headers: dict[str, str], timeout: float,
              recorder: CallTrace | None) -> GenerationResult:
    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname, parts.port, timeout=timeout)
    path = parts.path
    started = time.monotonic()
    try:
        try:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"request to {url} failed: {exc}") from exc
        if response.status >= 400:
            text = _read_error(response)
            if recorder is not None:
                recorder.chunk(text.encode("utf-8"))
            kind = ContextLengthError if is_context_length_error(text) else HTTPStatusError
            raise kind(f"HTTP {response.status} from {url}: {text[:500]}", status=response.status, body=text)
        return _read_stream(response, started, recorder)
    finally:
        connection.close()


def _read_error(response: http.client.HTTPResponse) -> str:
    try:
        raw = response.read()
    except (OSError, http.client.HTTPException):
        raw = b""
    return raw.decode("utf-8", "replace")


def _read_stream(response: http.client.HTTPResponse, started: float, recorder: CallTrace | None) -> GenerationResult:
    parser = SSEParser()
    assembler = StreamAssembler()
    first_output: float | None = None
    last_output: float | None = None
    while True:
        try:
            chunk = response.read1(_CHUNK)
        except (OSError, http.client.HTTPException) as exc:
            raise TransportError(f"stream broke after {assembler.events} events: {exc}") from exc
        if recorder is not None and chunk:
            recorder.chunk(chunk)
        events = parser.feed(chunk) if chunk else parser.close()
        for event in events:
            output = assembler.accept(event)
            if recorder is not None:
                recorder.event(event.data, event.event, output)
            if output:
                last_output = time.monotonic()
                first_output = first_output or last_output
        if not chunk:
            break
    total = time.monotonic() - started
    tokens = assembler.completion_tokens
    tpot = None
    if first_output is not None and last_output is not None and tokens is not None and tokens > 1:
        tpot = (last_output - first_output) / (tokens - 1)
    ttft = first_output - started if first_output is not None else None
    return assembler.result(Timings(ttft, tpot, total))

