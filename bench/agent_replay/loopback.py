"""A loopback stand-in for an OpenAI-compatible server, for dry runs of the serving replay on CPU.

It streams exactly `max_tokens` one-word chunks (it requires `ignore_eos: true`, as the replay
sends for SGLang), reports usage with `cached_tokens` from a message-level prefix cache, serves
`POST /flush_cache`, and records every request body. No model: its timings mean nothing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from akv.agent import ApproximateTokenCounter

MAX_TOKENS_LIMIT = 100_000


@dataclass
class Loopback:
    """Server state: `requests` as received; `token_delay_s` sleeps per streamed token."""

    token_delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    flushes: int = 0
    _seen: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _counter: ApproximateTokenCounter = field(default_factory=ApproximateTokenCounter)

    def usage(self, messages: list[Any], completion: int) -> dict[str, Any]:
        """prompt_tokens by the approximate counter; cached = tokens of the longest message prefix seen before."""
        layout = self._counter.layout(messages)
        cached = 0
        with self._lock:
            prefix = ""
            for (start, end), message in zip(layout.spans, messages, strict=True):
                prefix += json.dumps(message, sort_keys=True)
                if prefix in self._seen:
                    cached = end
                else:
                    self._seen.add(prefix)
        return {"prompt_tokens": layout.prompt_tokens, "completion_tokens": completion,
                "total_tokens": layout.prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def flush(self) -> None:
        with self._lock:
            self._seen.clear()
            self.flushes += 1


def _problem(body: Any) -> str | None:
    if not isinstance(body, dict):
        return "body: expected a JSON object"
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        return "messages: expected a non-empty list"
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int or not 0 < max_tokens <= MAX_TOKENS_LIMIT:
        return f"max_tokens: expected an int in [1, {MAX_TOKENS_LIMIT}], got {max_tokens!r}"
    if body.get("ignore_eos") is not True:
        return f"ignore_eos: the replay must send true, got {body.get('ignore_eos')!r}"
    if body.get("stream") is not True:
        return "stream: expected true"
    return None


@contextmanager
def serve(state: Loopback) -> Iterator[str]:
    """Run the stand-in on 127.0.0.1 (a free port) and yield its base URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.path == "/flush_cache":
                state.flush()
                self._reply(200, b"ok", "text/plain")
                return
            if self.path != "/v1/chat/completions":
                self._reply(404, b"not found", "text/plain")
                return
            try:
                body = json.loads(raw)
            except json.JSONDecodeError:
                body = None
            problem = _problem(body)
            if problem is not None:
                self._reply(400, json.dumps({"error": {"message": problem}}).encode(), "application/json")
                return
            with state._lock:
                state.requests.append(body)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            n = body["max_tokens"]
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for _ in range(n):
                if state.token_delay_s:
                    time.sleep(state.token_delay_s)
                self._event({"choices": [{"index": 0, "delta": {"content": " tok"}}]})
            self._event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            self._event({"choices": [], "usage": state.usage(body["messages"], n)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

        def _event(self, obj: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def _reply(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
