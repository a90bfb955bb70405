"""Per-call trace directory: request, raw SSE, parsed events and timings of one chat request."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from akv.agent.errors import ConfigError
from akv.agent.results import GenerationResult

_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "api-key", "x-api-key", "openai-api-key"})


def redact_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers with credential values replaced by "<redacted>"."""
    return {k: ("<redacted>" if k.lower() in _SECRET_HEADERS else v) for k, v in headers.items()}


class CallTrace:
    """Records one call into `directory`, which must not exist yet (so a retry never overwrites a
    trace). Files: request.json (the exact body), response.sse (raw bytes received),
    events.jsonl (one parsed event per line with its arrival time), call.json (summary)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigError(f"trace must be a path, got {type(directory).__name__}")
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=False, mode=0o700)
        except FileExistsError:
            raise ConfigError(f"trace: {str(self.directory)!r} already exists; a trace is never overwritten, "
                              f"give a new directory") from None
        except OSError as exc:
            raise ConfigError(f"trace: cannot create {str(self.directory)!r}: {exc}") from None
        self._raw = bytearray()
        self._events: list[dict[str, Any]] = []
        self._call: dict[str, Any] = {}
        self._started = time.monotonic()

    def request(self, url: str, headers: Mapping[str, str], body: bytes, timeout: float) -> None:
        self._started = time.monotonic()
        self._write("request.json", body)
        self._call = {"url": url, "headers": redact_headers(headers), "timeout_s": timeout,
                      "request_bytes": len(body), "started_unix": time.time()}

    def chunk(self, data: bytes) -> None:
        self._raw.extend(data)

    def event(self, data: str, kind: str | None, output: bool) -> None:
        try:
            parsed: Any = json.loads(data)
        except (ValueError, RecursionError):
            parsed = data
        self._events.append({"index": len(self._events), "elapsed_s": time.monotonic() - self._started,
                             "event": kind, "output": output, "data": parsed})

    def finish(self, result: GenerationResult | None, error: BaseException | None) -> None:
        """Write the response files and call.json; called once, on success or failure."""
        self._write("response.sse", bytes(self._raw))
        self._write("events.jsonl", "".join(json.dumps(e, ensure_ascii=False) + "\n"
                                            for e in self._events).encode("utf-8"))
        summary = dict(self._call)
        summary.update({
            "status": "completed" if error is None else "failed",
            "response_bytes": len(self._raw),
            "sse_events": len(self._events),
            "duration_s": time.monotonic() - self._started,
            "timings": asdict(result.timings) if result is not None else None,
            "result": asdict(result) if result is not None else None,
            "error": None if error is None else {"type": type(error).__name__, "message": str(error),
                                                 "http_status": getattr(error, "status", None),
                                                 "body": getattr(error, "body", "")},
        })
        self._write("call.json", json.dumps(summary, indent=2, ensure_ascii=False, default=str).encode("utf-8"))

    def _write(self, name: str, data: bytes) -> None:
        path = self.directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
