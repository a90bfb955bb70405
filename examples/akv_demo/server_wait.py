"""Waiting for a server that was just started in the background (``... &`` in the quick start)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable


class ServerNotReady(RuntimeError):
    """The server did not answer ``GET /v1/models`` in time, or does not serve the model asked for."""


def wait_for_model(base_url: str, model: str, wait_s: float, log: Callable[[str], None] = print) -> None:
    """Poll ``{base_url}/v1/models`` until it answers (at most ``wait_s`` seconds), then check that it
    lists ``model`` (a server without that endpoint is taken as ready)."""
    url = f"{base_url.rstrip('/').removesuffix('/v1')}/v1/models"
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                served = [m.get("id") for m in json.load(response).get("data", [])]
            break
        except urllib.error.HTTPError:
            return
        except (OSError, ValueError) as exc:
            if time.monotonic() >= deadline:
                raise ServerNotReady(f"no answer from {url} within {wait_s:g} s ({exc}); is the server running?") \
                    from None
            if not said:
                log(f"waiting for the server at {base_url} (up to {wait_s:g} s) ...")
                said = True
            time.sleep(0.5)
    if model not in served:
        raise ServerNotReady(f"--model {model!r} is not served at {base_url}; it serves {served}")
