"""A local HTTP server on 127.0.0.1 that replays scripted chat-completion responses."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Script:
    """What the next responses look like: `status`, then the body sent as HTTP chunks `pieces`; with
    `end` False the connection closes without the final chunk (a transfer cut short)."""

    status: int = 200
    pieces: list[bytes] = field(default_factory=list)
    content_type: str | None = "text/event-stream"
    extra_headers: dict[str, str] = field(default_factory=dict)
    end: bool = True
    requests: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)


@contextmanager
def serve(script: Script) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers["Content-Length"])
            script.requests.append(json.loads(self.rfile.read(length)))
            script.headers.append(dict(self.headers))
            self.send_response(script.status)
            if script.content_type is not None:
                self.send_header("Content-Type", script.content_type)
            for name, value in script.extra_headers.items():
                self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            for piece in script.pieces:
                if piece:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
            if script.end:
                self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
