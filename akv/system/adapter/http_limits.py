"""Hooks for the patched ``http_server.py``: a request body limit, an answer to a body cut short, and
validation errors that name the field without echoing the body or Python internals.

- :class:`BodyLimit` (ASGI middleware): a ``Content-Length`` over the limit is answered 413 before any
  of the body is read; a body without one is counted as it arrives; a body that ends before its
  ``Content-Length`` is answered 400. The limit is ``AKV_MAX_BODY_BYTES`` (default 64 MiB).
- :class:`EofProtocol` (uvicorn's h11 protocol): a client that sends part of its body and then
  half-closes its socket still gets that answer, instead of the socket being closed unanswered.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_BODY_ENV = "AKV_MAX_BODY_BYTES"
DEFAULT_MAX_BODY_BYTES = 64 << 20

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def max_body_bytes() -> int:
    """The body limit: ``AKV_MAX_BODY_BYTES`` when set (a positive integer), else 64 MiB."""
    text = os.environ.get(MAX_BODY_ENV)
    if text is None:
        return DEFAULT_MAX_BODY_BYTES
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{MAX_BODY_ENV}: must be a positive number of bytes, got {text!r}")
    return int(text)


def install(app: Any) -> None:
    """Add the body limit to the FastAPI ``app`` and answer its validation errors with the field's
    name and the problem (the stock handler stays for ``/v1/messages`` and ``/v1/responses``)."""
    from fastapi.exceptions import RequestValidationError

    limit = max_body_bytes()
    app.add_middleware(BodyLimit, limit=limit)
    stock = app.exception_handlers.get(RequestValidationError)

    async def validation_error(request: Any, exc: Any) -> Any:
        if stock is not None and request.url.path.startswith(("/v1/messages", "/v1/responses")):
            return await stock(request, exc)
        from fastapi.responses import JSONResponse

        param, message = validation_message(exc.errors())
        return JSONResponse(error_body(HTTPStatus.BAD_REQUEST, message, param), status_code=400)

    app.add_exception_handler(RequestValidationError, validation_error)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str]:
    """``(param, message)`` for pydantic errors: each as ``field.path: problem``, inputs left out."""
    parts = []
    for error in errors[:5]:
        if error.get("type") == "json_invalid":
            parts.append(f"body: not valid JSON ({(error.get('ctx') or {}).get('error', error.get('msg'))})")
            continue
        loc = _field_path(error)
        where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    first = _field_path(errors[0]) if errors and errors[0].get("type") != "json_invalid" else []
    param = str(first[0]) if first and not isinstance(first[0], int) else "body"
    extra = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return param, "; ".join(parts) + extra


def _field_path(error: dict[str, Any]) -> list[Any]:
    """The error's location less FastAPI's source marker (``body``, ``header``, ``query``, ``path``)."""
    loc = list(error.get("loc", ()))
    return loc[1:] if loc and loc[0] in ("body", "header", "query", "path") else loc


def error_body(status: HTTPStatus, message: str, param: str | None) -> dict[str, Any]:
    """SGLang's error response shape."""
    return {"object": "error", "message": message, "type": status.phrase, "param": param, "code": status.value}


class BodyLimit:
    """ASGI middleware: refuse a body over ``limit`` bytes (413) or shorter than its ``Content-Length`` (400)."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        text = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), None)
        if text is not None and not text.strip().isdigit():
            await _answer(send, HTTPStatus.BAD_REQUEST, f"Content-Length: {text[:40]!r} is not a number of bytes")
            return
        declared = None if text is None else int(text)
        if declared is not None and declared > self.limit:
            await _answer(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._over(f"{declared} bytes"))
            return
        answered = False
        received = 0

        async def counted() -> Message:
            nonlocal answered, received
            message = await receive()
            if message["type"] != "http.request" or answered:
                return message
            received += len(message.get("body", b""))
            refusal = None
            if received > self.limit:
                refusal = (HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._over(f"a body of more than {received} bytes"))
            elif declared is not None and received < declared and not message.get("more_body", False):
                refusal = (HTTPStatus.BAD_REQUEST,
                           f"Content-Length: the body ended after {received} of the {declared} bytes announced")
            if refusal is None:
                return message
            answered = True
            await _answer(send, *refusal)
            return {"type": "http.disconnect"}

        async def guarded(message: Message) -> None:
            if not answered:
                await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not answered:
                raise

    def _over(self, what: str) -> str:
        return f"Content-Length: {what} is over this server's body limit of {self.limit} bytes ({MAX_BODY_ENV})"


async def _answer(send: Send, status: HTTPStatus, message: str) -> None:
    data = json.dumps(error_body(status, message, "Content-Length")).encode()
    await send({"type": "http.response.start", "status": status.value,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


class EofProtocol(H11Protocol):
    """uvicorn's h11 protocol, except that the end of the client's stream in the middle of a request
    body ends that body (so :class:`BodyLimit` answers it) and leaves the socket open for the answer."""

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.more_body:
            return None
        cycle.more_body = False
        cycle.message_event.set()
        return True
