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
from akv.agent.errors import (
    ConfigError,
    ContextLengthError,
    HTTPStatusError,
    IncompleteStreamError,
    PayloadError,
    RedirectError,
    TransportError,
    UnexpectedResponseError,
)
from akv.agent.results import GenerationResult, Timings
from akv.agent.routing import ROUTING_HEADER, routing_key
from akv.agent.sse import SSEParser
from akv.agent.trace import CallTrace

_CHUNK = 65536
_MAX_BODY = 1 << 20


def chat_completions_url(base_url: str) -> str:
    """`http(s)://host[:port][/prefix]` -> the `/v1/chat/completions` URL under it (kept if already there)."""
    if not isinstance(base_url, str):
        raise ConfigError(f"base_url must be a string, got {type(base_url).__name__}")
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"base_url must be an http(s) URL with a host, got {base_url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(f"base_url must not carry credentials, a query or a fragment, got {base_url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions" if path.endswith("/v1") else "/v1/chat/completions"
    return f"{parts.scheme}://{parts.netloc}{path}"


def send_chat_request(base_url: str, payload: Mapping[str, Any], *, headers: Mapping[str, str] | None = None,
                      timeout: float = 600.0, trace: str | os.PathLike[str] | None = None) -> GenerationResult:
    """POST `payload` with `stream: true` (and `stream_options: {"include_usage": true}` when the payload
    has no `stream_options`) and assemble the SSE reply. `timeout` bounds each socket operation. With
    `trace`, a new directory of that name records the call (ConfigError, before anything is sent, if
    it exists). Bad arguments raise ConfigError or PayloadError; a failed call raises HTTPStatusError
    (RedirectError for a 3xx, which is not followed), ContextLengthError, UnexpectedResponseError (a
    success status without an SSE stream), StreamError, IncompleteStreamError or TransportError (all
    BackendError). The conversation's routing key goes in the `x-smg-routing-key` header (see
    `akv.agent.routing`) unless `headers` names one or the payload has no messages."""
    url = chat_completions_url(base_url)
    body, all_headers = _request(payload, headers, timeout)
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


def _request(payload: object, headers: object, timeout: object) -> tuple[bytes, dict[str, str]]:
    """The request body and headers, after checking every argument."""
    if not isinstance(payload, Mapping):
        raise PayloadError(f"payload must be a mapping, got {type(payload).__name__}")
    if payload.get("stream") is False:
        raise PayloadError("send_chat_request is streaming-only; payload has stream=false", field="stream")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise ConfigError(f"timeout must be a positive finite number of seconds, got {timeout!r}")
    if headers is not None and (not isinstance(headers, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in headers.items())):
        raise ConfigError(f"headers must map strings to strings, got {headers!r}")
    body_obj = dict(payload)
    body_obj["stream"] = True
    body_obj.setdefault("stream_options", {"include_usage": True})
    try:
        body = json.dumps(body_obj, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"payload cannot be sent as JSON: {exc}", field="payload") from None
    except RecursionError:
        raise PayloadError("payload nests too deeply to be sent as JSON", field="payload") from None
    all_headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **(headers or {})}
    if not any(name.lower() == ROUTING_HEADER for name in all_headers) and payload.get("messages"):
        all_headers[ROUTING_HEADER] = routing_key(payload)
    return body, all_headers


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
        status = response.status
        media_type = (response.getheader("Content-Type") or "").partition(";")[0].strip().lower()
        if status == 200 and media_type == "text/event-stream":
            return _read_stream(response, started, recorder)
        text = _read_body(response)
        if recorder is not None:
            recorder.chunk(text.encode("utf-8"))
        if 300 <= status < 400:
            location = response.getheader("Location")
            raise RedirectError(f"HTTP {status} from {url}: redirected to {location!r}, not followed; use the "
                                f"final URL as base_url", status=status, body=text, location=location)
        if status >= 400:
            kind = ContextLengthError if is_context_length_error(text) else HTTPStatusError
            raise kind(f"HTTP {status} from {url}: {text[:500]}", status=status, body=text)
        raise UnexpectedResponseError(f"HTTP {status} from {url} is not an SSE stream (Content-Type "
                                      f"{media_type or 'missing'!r}): {text[:500]}", status=status, body=text)
    finally:
        connection.close()


def _read_body(response: http.client.HTTPResponse) -> str:
    """The body of a non-stream answer (at most `_MAX_BODY` bytes; what arrived if the read fails)."""
    raw = bytearray()
    try:
        while len(raw) < _MAX_BODY:
            chunk = response.read1(_CHUNK)
            if not chunk:
                break
            raw += chunk
    except (OSError, http.client.HTTPException):
        pass
    return raw[:_MAX_BODY].decode("utf-8", "replace")


def _read_stream(response: http.client.HTTPResponse, started: float, recorder: CallTrace | None) -> GenerationResult:
    parser = SSEParser()
    assembler = StreamAssembler()
    first_output: float | None = None
    last_output: float | None = None
    while True:
        try:
            chunk = response.read1(_CHUNK)
        except http.client.IncompleteRead as exc:
            raise IncompleteStreamError(f"the server closed the stream mid-transfer after {assembler.events} "
                                        f"events (no [DONE])", body=exc.partial.decode("utf-8", "replace")) from exc
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

