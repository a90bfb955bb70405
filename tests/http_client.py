"""The tests' one HTTP client for the servers' OpenAI-style endpoints (stdlib only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

CHAT = "/v1/chat/completions"


def post_text(url: str, body: Any, *, path: str = CHAT, timeout: float = 120) -> tuple[int, str]:
    """Status and body text of a POST; ``body`` is sent as is when it is ``bytes``, else as JSON.
    An HTTP error status is returned, not raised."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def post(url: str, body: Any, *, path: str = CHAT, timeout: float = 120) -> tuple[int, Any]:
    """Status and parsed JSON body of a POST (see ``post_text``)."""
    status, text = post_text(url, body, path=path, timeout=timeout)
    return status, json.loads(text)


def post_ok(url: str, body: Any, *, path: str = CHAT, timeout: float = 120) -> Any:
    """The parsed JSON body of a POST that must answer 200."""
    status, reply = post(url, body, path=path, timeout=timeout)
    assert status == 200, reply
    return reply
