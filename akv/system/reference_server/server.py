"""The HTTP layer: a threaded stdlib server speaking the OpenAI chat-completions protocol.

Requests are parsed and answered concurrently, but the engine runs one request at a time (a lock).
A bad request gets HTTP 400 naming the field before the engine is touched, so it cannot disturb the
cache or other requests.
"""

from __future__ import annotations

import json
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from akv.system.reference_server.engine import Engine, Generation, Prepared
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


class ReferenceServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` bound to one :class:`Engine`; ``url`` is its base URL."""

    daemon_threads = True

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False) -> None:
        self.engine = engine
        self.verbose = verbose
        self.engine_lock = threading.Lock()
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


class _Handler(BaseHTTPRequestHandler):
    server: ReferenceServer
    server_version = "akv-reference"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        if self.server.verbose:
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
        if path != "/v1/chat/completions":
            self._error(HTTPStatus.NOT_FOUND, f"no route for POST {path}", param=None)
            return
        try:
            request = parse_chat_request(self._read_json(), self.server.engine.model_name,
                                         self.server.engine.content_format)
            with self.server.engine_lock:
                try:
                    prepared = self.server.engine.prepare(request)
                except RequestError:
                    raise
                except Exception as exc:  # a bug, not the client's fault: report it, keep serving
                    self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine error: {exc!r}", param=None,
                                kind="server_error")
                    return
                if request.stream:
                    self._stream(request, prepared)
                else:
                    self._complete(request, prepared)
        except RequestError as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc), param=exc.field)
        except (BrokenPipeError, ConnectionResetError):
            return

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("Content-Length", length, "a JSON body with a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise RequestError("Content-Length", int(length), f"body larger than {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError("body", raw[:100].decode("utf-8", "replace"), f"not valid JSON ({exc})") from exc

    def _complete(self, request: ChatRequest, prepared: Prepared) -> None:
        try:
            generation = self.server.engine.generate(prepared, request, on_token=None)
        except Exception as exc:  # the engine failed: report it, keep serving
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"engine error: {exc!r}", param=None, kind="server_error")
            return
        content, calls = _final_message(request, generation)
        ids = ResponseIds(request.model)
        logprobs = logprob_entries(generation.steps, request.top_logprobs) if request.logprobs else None
        body = ids.completion(content, calls, _finish_reason(generation, calls),
                              usage_body(generation.usage, len(generation.steps)), logprobs)
        self._json(HTTPStatus.OK, body)

    def _stream(self, request: ChatRequest, prepared: Prepared) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        ids = ResponseIds(request.model)
        streamer = ContentStreamer(request.parse_tool_calls)
        self._event(ids.chunk({"role": "assistant", "content": ""}))

        def on_token(step: TokenStep, text: str) -> None:
            delta = streamer.feed(text)
            logprobs = logprob_entries([step], request.top_logprobs) if request.logprobs else None
            if delta or logprobs:
                self._event(ids.chunk({"content": delta}, logprobs=logprobs))

        try:
            generation = self.server.engine.generate(prepared, request, on_token=on_token)
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # the engine failed mid-stream: an error event, no [DONE]
            self._event(error_body(f"engine error: {exc!r}", param=None, status=500, kind="server_error"))
            return
        content, calls = _final_message(request, generation)
        rest = streamer.rest(content)
        if rest:
            self._event(ids.chunk({"content": rest}))
        if calls:
            self._event(ids.chunk({"tool_calls": stream_tool_call_deltas(calls)}))
        self._event(ids.chunk({}, finish_reason=_finish_reason(generation, calls)))
        if request.include_usage:
            self._event(ids.usage_chunk(usage_body(generation.usage, len(generation.steps))))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n")
        self.wfile.flush()

    def _json(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str, *, param: str | None,
               kind: str = "invalid_request_error") -> None:
        self._json(status, error_body(message, param=param, status=int(status), kind=kind))


def _final_message(request: ChatRequest, generation: Generation) -> tuple[str | None, list[dict[str, Any]]]:
    if request.parse_tool_calls:
        return split_tool_calls(generation.text)
    return generation.text, []


def _finish_reason(generation: Generation, calls: list[dict[str, Any]]) -> str:
    return "tool_calls" if calls and generation.finish_reason == "stop" else generation.finish_reason
