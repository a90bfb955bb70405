"""What every AKV command line shares: help that shows each option's default, ``--version``, result
files that are never replaced, and HTTP requests whose failure shows the server's answer and the
request sent."""

from __future__ import annotations

import argparse
import copy
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from akv import __version__


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; an option's help ends with its default unless it names one already
    (or the default is None, False or a flag's absence)."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    return bool(action.option_strings) and not any(
        action.default is skip for skip in (None, False, argparse.SUPPRESS))


def parser(prog: str | None = None, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """An ArgumentParser with :class:`HelpFormatter` and ``--version``."""
    made = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kwargs)
    made.add_argument("--version", action="version", version=f"akv {__version__}")
    return made


def new_file(text: str) -> Path:
    """An argparse type: a path that does not exist yet (a command never replaces a result file)."""
    path = Path(text)
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} exists; results are never replaced: give a new file name")
    return path


class RequestFailed(OSError):
    """An HTTP request failed; the message holds the status, the server's answer and the request sent
    (each truncated). An OSError, as urllib's own errors are, so handlers of those still catch it."""


def open_request(url: str, body: Any = None, timeout: float = 600.0, method: str | None = None) -> Any:
    """Send ``body`` as JSON (a GET without one) and return the open response (a context manager);
    :class:`RequestFailed` on an HTTP error status or a connection that fails."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    sent = f"\n  request body: {_cut(data.decode())}" if data else ""
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        answer = exc.read().decode(errors="replace")
        raise RequestFailed(f"{request.get_method()} {url}: HTTP {exc.code}: {_cut(answer)}{sent}") from None
    except OSError as exc:
        raise RequestFailed(f"{request.get_method()} {url}: {exc}{sent}") from None


def request_json(url: str, body: Any = None, timeout: float = 600.0, method: str | None = None) -> Any:
    """:func:`open_request`, and the answer decoded from JSON (None when empty)."""
    with open_request(url, body, timeout, method) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else None


def _cut(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
