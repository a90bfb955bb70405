"""The HTTP layer: a threaded stdlib server speaking the OpenAI chat-completions protocol.

Requests are parsed and answered concurrently, and the engine interleaves them token by token. A bad
request gets HTTP 400 naming the field before the engine is touched, so it cannot disturb the cache or
other requests. The engine never waits on a socket: a streamed reply goes through its own writer
thread and buffer, and only its own request waits while that buffer is full. Every read and write has
a deadline (the I/O timeout); a client past it is dropped and its request aborted with everything
released, so a slow, stalled or vanished client costs only its own request.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from akv.system.reference_server import anthropic
from akv.system.reference_server.engine import Engine, EngineBusy, Generation
from akv.system.reference_server.protocol import ChatRequest, RequestError, parse_chat_request
from akv.system.reference_server.responses import (
    ResponseIds,
    TokenStep,
    error_body,
    logprob_entries,
    stream_tool_call_deltas,
    usage_body,
)
from akv.system.reference_server.tool_calls import ContentStreamer, split_tool_calls

MAX_BODY_BYTES = 64 << 20
DEFAULT_IO_TIMEOUT = 60.0
DEFAULT_STREAM_BUFFER = 1 << 20


class ClientGone(Exception):
    """The client stopped reading (a write failed or timed out); its request is abandoned."""


class ReferenceServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` bound to one :class:`Engine`; ``url`` is its base URL. Each socket read or
    write that waits longer than ``io_timeout`` seconds drops that client. A stream keeps up to
    ``stream_buffer`` bytes the client has not read yet; beyond that its generation waits for the client."""

    daemon_threads = True
    request_queue_size = max(128, socket.SOMAXCONN)

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False,
                 io_timeout: float = DEFAULT_IO_TIMEOUT, stream_buffer: int = DEFAULT_STREAM_BUFFER) -> None:
        self.engine = engine
        self.verbose = verbose
        self.io_timeout = io_timeout
        self.stream_buffer = stream_buffer
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start_in_background(self) -> threading.Thread:
        """Serve from a daemon thread; stop with ``shutdown()`` then ``server_close()``."""
        thread = threading.Thread(target=self.serve_forever, name="akv-reference-server", daemon=True)
        thread.start()
        return thread

    @contextmanager
    def running(self) -> Iterator[ReferenceServer]:
        """Serve from a daemon thread for the ``with`` block; shut down and closed after it."""
        self.start_in_background()
        try:
            yield self
        finally:
            self.shutdown()
            self.server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or timed out is one log line; anything else keeps its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            sys.stderr.write(f"akv-reference: client {client_address[0]}:{client_address[1]} dropped: {error!r}\n")
        else:
            super().handle_error(request, client_address)


class _StreamWriter:
    """A reply stream's own writer thread and buffer. ``put`` returns at once while fewer than ``limit``
    bytes wait to be written, else it waits for the client to read (only this request waits: the
    engine is not held meanwhile). It raises :class:`ClientGone` once a write has failed or missed its
    deadline, which aborts the generation feeding it."""

    def __init__(self, handler: BaseHTTPRequestHandler, limit: int) -> None:
        self._handler = handler
        self._wfile = handler.wfile
        self._limit = limit
        self._changed = threading.Condition()
        self._chunks: deque[bytes] = deque()
        self._pending = 0  # bytes queued or being written
        self._closing = False
        self._failed = False
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        return self._thread is not None

    def put(self, data: bytes) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._failed or self._pending < self._limit)
            if self._failed:
                raise ClientGone("the client stopped reading the stream")
            self._chunks.append(data)
            self._pending += len(data)
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="akv-stream-writer", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Wait until everything queued is written or the client is dropped."""
        if self._thread is not None:
            with self._changed:
                self._closing = True
                self._changed.notify_all()
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._chunks or self._closing)
                if not self._chunks:
                    return
                data = self._chunks.popleft()
            try:
                self._wfile.write(data)
                self._wfile.flush()
            except (OSError, ValueError) as exc:  # ValueError: the file was closed under the writer
                with self._changed:
                    self._failed = True
                    self._chunks.clear()
                    self._changed.notify_all()
                self._handler.log_error("stream dropped: %r", exc)
                return
            with self._changed:
                self._pending -= len(data)
                self._changed.notify_all()


class _Handler(BaseHTTPRequestHandler):
    server: ReferenceServer
    server_version = "akv-reference"

    def setup(self) -> None:
        self.timeout = self.server.io_timeout
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        if self.server.verbose:
            super().log_message(format, *args)

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        super().log_message(format, *args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/v1/models":
            engine = self.server.engine
            self._json(HTTPStatus.OK, {"object": "list", "data": [{
                "id": engine.model_name, "object": "model", "owned_by": "akv-reference",
                "max_model_len": engine.max_context,
            }]})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route for GET {path}", param=None)

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/v1/messages", "/v1/messages/count_tokens"):
            self._anthropic(count_only=path.endswith("count_tokens"))
            return
        if path != "/v1/chat/completions":
            self._error(HTTPStatus.NOT_FOUND, f"no route for POST {path}", param=None)
            return
        try:
            body = self._read_json()
            request = parse_chat_request(body, self.server.engine.model_name, self.server.engine.content_format)
            dry_run = body.get("akv_dry_run", False)
            if type(dry_run) is not bool:
                raise RequestError("akv_dry_run", dry_run, "expected true or false")
            if dry_run:
                _, prompt = self.server.engine.preview(request)
                self._json(HTTPStatus.OK, {"object": "akv.dry_run", "model": request.model,
                                           "usage": usage_body(prompt, 0)})
            elif request.stream:
                self._stream(request)
            else:
                self._complete(request)
        except RequestError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc), param=exc.field)
        except _BodyTimeout as exc:
            self._error(HTTPStatus.REQUEST_TIMEOUT, str(exc), param="Content-Length")
        except EngineBusy as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"server busy, retry later: {exc}", param=None,
                        kind="server_error")
        except ClientGone:
            self.close_connection = True

    def _anthropic(self, *, count_only: bool) -> None:
        """`/v1/messages` and `/v1/messages/count_tokens`; errors in Anthropic's shape."""
        engine = self.server.engine
        try:
            converted = anthropic.parse(self._read_json(), engine, count_only=count_only)
            request = parse_chat_request(converted.chat, engine.model_name, engine.content_format)
            if count_only:
                _, prompt = engine.preview(request)
                self._json(HTTPStatus.OK, anthropic.count_tokens_body(prompt, converted.edits))
                return
            with engine.turn():
                prepared = engine.prepare(request)
            edits = anthropic.applied_edits(converted, prepared.program) if converted.edits is not None else None
            if converted.stream:
                self._anthropic_stream(converted, request, prepared, edits)
                return
            generation = engine.generate(prepared, request, on_token=None)
            content, calls = _final_message(request, generation)
            body = anthropic.message_body(request.model, anthropic.content_blocks(content, calls),
                                          _stop_reason(generation, calls),
                                          anthropic.usage(generation.usage, len(generation.steps)), edits)
            self._json(HTTPStatus.OK, body)
        except RequestError as exc:
            self._json(HTTPStatus.BAD_REQUEST, anthropic.error_body("invalid_request_error", str(exc)))
        except _BodyTimeout as exc:
            self._json(HTTPStatus.REQUEST_TIMEOUT, anthropic.error_body("request_timeout_error", str(exc)))
        except EngineBusy as exc:
            self._json(HTTPStatus.SERVICE_UNAVAILABLE, anthropic.error_body("overloaded_error", f"server busy: {exc}"))
        except ClientGone:
            self.close_connection = True

    def _anthropic_stream(self, converted: anthropic.AnthropicRequest, request: ChatRequest, prepared: Any,
                          edits: list[dict[str, Any]] | None) -> None:
        """The reply's events go out once it is complete (`message_start` with the first token)."""
        self.close_connection = True
        writer = _StreamWriter(self, self.server.stream_buffer)
        start = anthropic.message_body(request.model, [], "", {}, None)
        start.update(stop_reason=None, usage={"input_tokens": 0, "output_tokens": 0})

        def on_token(step: TokenStep, text: str) -> None:
            if not writer.started:
                writer.put(self._stream_head() + anthropic.sse("message_start", {"type": "message_start",
                                                                                  "message": start}))

        try:
            generation = self.server.engine.generate(prepared, request, on_token=on_token)
            content, calls = _final_message(request, generation)
            writer.put(anthropic.stream_events(start, anthropic.content_blocks(content, calls),
                                               _stop_reason(generation, calls),
                                               anthropic.usage(generation.usage, len(generation.steps)), edits))
        except Exception as exc:  # the engine failed: report it, keep serving
            if writer.started:
                writer.put(anthropic.sse("error", anthropic.error_body("api_error", "engine error")))
            else:
                self._json(HTTPStatus.INTERNAL_SERVER_ERROR, anthropic.error_body("api_error", "engine error"))
            if isinstance(exc, ClientGone):
                raise
        finally:
            writer.close()

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("Content-Length", length, "a JSON body with a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise RequestError("Content-Length", int(length), f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError as exc:
            self.close_connection = True
            raise _BodyTimeout(f"Content-Length: the body did not arrive within {self.server.io_timeout} s "
                               f"(expected {int(length)} bytes)") from exc
        if len(raw) < int(length):
            self.close_connection = True
            raise RequestError("Content-Length", int(length), f"the body ended after {len(raw)} bytes")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError("body", raw[:100].decode("utf-8", "replace"), f"not valid JSON ({exc})") from exc
        except RecursionError as exc:
            raise RequestError("body", raw[:100].decode("utf-8", "replace"), "JSON nested too deeply") from exc

    def _complete(self, request: ChatRequest) -> None:
        try:
            body = _completion(request, self.server.engine.serve(request, on_token=None))
        except (RequestError, EngineBusy):
            raise
        except Exception as exc:  # the engine or the reply failed: report it, keep serving
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine error: {exc!r}", param=None, kind="server_error")
            return
        self._json(HTTPStatus.OK, body)

    def _stream(self, request: ChatRequest) -> None:
        """Headers go out with the first token, so a failure before it is still a plain HTTP error."""
        self.close_connection = True
        ids = ResponseIds(request.model)
        streamer = ContentStreamer(request.parse_tool_calls)
        writer = _StreamWriter(self, self.server.stream_buffer)

        def on_token(step: TokenStep, text: str) -> None:
            head = b""
            if not writer.started:
                head = self._stream_head() + _event(ids.chunk({"role": "assistant", "content": ""}))
            delta = streamer.feed(text)
            logprobs = logprob_entries([step], request.top_logprobs) if request.logprobs else None
            chunk = _event(ids.chunk({"content": delta}, logprobs=logprobs)) if delta or logprobs else b""
            if head or chunk:
                writer.put(head + chunk)

        try:
            try:
                generation = self.server.engine.serve(request, on_token=on_token)
                tail = _stream_tail(request, ids, streamer, generation)
            except (RequestError, EngineBusy, ClientGone):
                raise
            except Exception as exc:  # the engine or the reply failed: report it, keep serving
                if not writer.started:
                    self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine error: {exc!r}", param=None,
                                kind="server_error")
                else:  # mid-stream: an error event, no [DONE]
                    writer.put(_event(error_body(f"engine error: {exc!r}", param=None, status=500,
                                                 kind="server_error")))
                return
            writer.put(tail)
        finally:
            writer.close()

    def _stream_head(self) -> bytes:
        self.log_request(HTTPStatus.OK)
        lines = [f"{self.protocol_version} 200 OK", f"Server: {self.version_string()}",
                 f"Date: {self.date_time_string()}", "Content-Type: text/event-stream", "Cache-Control: no-cache",
                 "Connection: close"]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == HTTPStatus.SERVICE_UNAVAILABLE:
            self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str, *, param: str | None,
               kind: str = "invalid_request_error") -> None:
        self._json(status, error_body(message, param=param, status=int(status), kind=kind))


class _BodyTimeout(Exception):
    """The request body did not arrive in time."""


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


def _completion(request: ChatRequest, generation: Generation) -> dict[str, Any]:
    content, calls = _final_message(request, generation)
    logprobs = logprob_entries(generation.steps, request.top_logprobs) if request.logprobs else None
    return ResponseIds(request.model).completion(content, calls, _finish_reason(generation, calls),
                                                 usage_body(generation.usage, len(generation.steps)), logprobs)


def _stream_tail(request: ChatRequest, ids: ResponseIds, streamer: ContentStreamer,
                 generation: Generation) -> bytes:
    content, calls = _final_message(request, generation)
    rest = streamer.rest(content)
    out = [_event(ids.chunk({"content": rest}))] if rest else []
    if calls:
        out.append(_event(ids.chunk({"tool_calls": stream_tool_call_deltas(calls)})))
    out.append(_event(ids.chunk({}, finish_reason=_finish_reason(generation, calls))))
    if request.include_usage:
        out.append(_event(ids.usage_chunk(usage_body(generation.usage, len(generation.steps)))))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _final_message(request: ChatRequest, generation: Generation) -> tuple[str | None, list[dict[str, Any]]]:
    if request.parse_tool_calls:
        return split_tool_calls(generation.text)
    return generation.text, []


def _stop_reason(generation: Generation, calls: list[dict[str, Any]]) -> str:
    return anthropic.STOP_REASONS[_finish_reason(generation, calls)]


def _finish_reason(generation: Generation, calls: list[dict[str, Any]]) -> str:
    return "tool_calls" if calls and generation.finish_reason == "stop" else generation.finish_reason
