"""The tests' one HTTP client for the servers' OpenAI-style endpoints (stdlib only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

CHAT = "/v1/chat/completions"


def exchange(url: str, body: Any, *, path: str = CHAT, timeout: float = 120,
             headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    """Status, body text and response headers (names lower-cased) of a POST; ``body`` is sent as is
    when it is ``bytes``, else as JSON. An HTTP error status is returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, text, got = response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as error:
        status, text, got = error.code, error.read().decode(), error.headers
    return status, text, {name.lower(): value for name, value in got.items()}


def post_text(url: str, body: Any, *, path: str = CHAT, timeout: float = 120) -> tuple[int, str]:
    """Status and body text of a POST (see ``exchange``)."""
    status, text, _ = exchange(url, body, path=path, timeout=timeout)
    return status, text


def post(url: str, body: Any, *, path: str = CHAT, timeout: float = 120) -> tuple[int, Any]:
    """Status and parsed JSON body of a POST (see ``post_text``)."""
    status, text = post_text(url, body, path=path, timeout=timeout)
    return status, json.loads(text)


def post_ok(url: str, body: Any, *, path: str = CHAT, timeout: float = 120) -> Any:
    """The parsed JSON body of a POST that must answer 200."""
    status, reply = post(url, body, path=path, timeout=timeout)
    assert status == 200, reply
    return reply
