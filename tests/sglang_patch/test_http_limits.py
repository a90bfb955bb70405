"""The HTTP hooks on a real uvicorn server in this process (a small FastAPI app, no SGLang): the body
limit, a body cut short by the client's end of stream, validation errors without the body; and the
request checks every OpenAI request passes before SGLang converts it."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, model_validator

from akv.system.adapter import http_limits, request_checks
from akv.system.adapter.protocol import note_unknown_fields
from akv.system.adapter.serving import error_param

LIMIT = 1000


class Chat(BaseModel):
    messages: list[dict[str, Any]]
    n: int = 1

    @model_validator(mode="before")
    @classmethod
    def _first(cls, values: Any) -> Any:
        return note_unknown_fields(values)


@pytest.fixture(scope="module")
def address(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    monkeypatch_module.setenv(http_limits.MAX_BODY_ENV, str(LIMIT))
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Chat) -> dict[str, Any]:
        return {"messages": len(request.messages), "n": request.n}

    http_limits.install(app)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=http_limits.EofProtocol,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield "127.0.0.1", port
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def exchange(address: tuple[str, int], data: bytes, *, half_close: bool = True) -> tuple[int, dict[str, Any]]:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1]), json.loads(answer.split(b"\r\n\r\n", 1)[1])


def request(payload: bytes, length: int | None = None, *, chunked: bool = False) -> bytes:
    size = len(payload) if length is None else length
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\n{framing}\r\n\r\n")
    if chunked:
        parts = (payload[i : i + 600] for i in range(0, len(payload), 600))
        payload = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"
    return head.encode() + payload


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.mark.parametrize("half_close", [True, False], ids=["then-eof", "then-wait"])
def test_a_content_length_over_the_limit_is_a_413_before_any_body(address: tuple[str, int], half_close: bool) -> None:
    status, error = exchange(address, request(b"", 10**11), half_close=half_close)
    assert status == 413 and error["param"] == "Content-Length", error
    assert error["message"] == (f"Content-Length: 100000000000 bytes is over this server's body limit of {LIMIT} "
                                f"bytes ({http_limits.MAX_BODY_ENV})")


def test_a_body_ended_by_the_client_before_its_content_length_is_a_400(address: tuple[str, int]) -> None:
    status, error = exchange(address, request(GOOD[:20], 500))
    assert status == 400 and error["param"] == "Content-Length", error
    assert error["message"] == "Content-Length: the body ended after 20 of the 500 bytes announced"


def test_a_chunked_body_over_the_limit_is_a_413(address: tuple[str, int]) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 2 * LIMIT}]}).encode()
    status, error = exchange(address, request(big, chunked=True), half_close=False)
    assert status == 413 and "a body of more than" in error["message"], error


@pytest.mark.parametrize("half_close", [True, False], ids=["then-eof", "then-wait"])
def test_a_complete_body_is_served(address: tuple[str, int], half_close: bool) -> None:
    assert exchange(address, request(GOOD, chunked=not half_close), half_close=half_close) == (
        200, {"messages": 1, "n": 1})


@pytest.mark.parametrize(("payload", "param", "message"), [
    (b"[1, 2]", "body", "body: the request body must be a JSON object, got an array"),
    (b'"secret text"', "body", "body: the request body must be a JSON object, got a string"),
    (b'{"messages": [{"role": "user"}], "n": "secret text"}', "n",
     "n: Input should be a valid integer, unable to parse string as an integer"),
    (b'{"messages": [', "body", "body: not valid JSON"),
])
def test_validation_errors_name_the_field_without_the_body(address: tuple[str, int], payload: bytes, param: str,
                                                            message: str) -> None:
    status, error = exchange(address, request(payload), half_close=False)
    assert status == 400 and error["param"] == param and error["message"].startswith(message), error
    assert "secret" not in error["message"]


def test_a_body_that_is_not_json_is_a_400_naming_the_content_type() -> None:
    error = {"type": "value_error", "loc": ["header", "content-type"], "msg": "Unsupported Media Type"}
    assert http_limits.validation_message([error]) == ("content-type", "content-type: Unsupported Media Type")


def test_the_limit_must_be_a_positive_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(http_limits.MAX_BODY_ENV, "0")
    with pytest.raises(ValueError, match="AKV_MAX_BODY_BYTES: must be a positive number of bytes, got '0'"):
        http_limits.max_body_bytes()


def _call(name: str | None) -> SimpleNamespace:
    return SimpleNamespace(function=SimpleNamespace(name=name, arguments="{}"))


@pytest.mark.parametrize(("fields", "where", "problem"), [
    ({"n": 0}, "n", "must be at least 1, got 0"),
    ({"n": -3}, "n", "must be at least 1, got -3"),
    ({"seed": 1 << 63}, "seed", "got 9223372036854775808"),
    ({"seed": -(1 << 63) - 1}, "seed", "got -9223372036854775809"),
    ({"seed": 10**50}, "seed", "got 10000000000000000000... (51 digits)"),
    ({"chat_template_kwargs": {"enable_thinking": False, "tools": []}}, "chat_template_kwargs['tools']",
     "set by the server"),
    ({"messages": [SimpleNamespace(content="ok", tool_calls=[_call("f"), _call(None)])]},
     "messages[0].tool_calls[1].function.name", "missing"),
    ({"messages": [SimpleNamespace(content="ok", tool_calls=[_call("")])]},
     "messages[0].tool_calls[0].function.name", "missing"),
])
def test_request_checks_name_the_field_and_the_problem(fields: dict, where: str, problem: str) -> None:
    with pytest.raises(request_checks.RequestFieldError) as caught:
        request_checks.check(SimpleNamespace(**fields))
    assert str(caught.value).startswith(f"{where}: ") and problem in str(caught.value)
    assert error_param(caught.value) == where.split("[")[0]


def test_a_lone_surrogate_is_found_where_it_is() -> None:
    message = Chat.model_validate({"messages": [{"role": "user", "content": "ok"},
                                                {"role": "user", "content": ["é", {"text": "\udc00"}]}]})
    with pytest.raises(request_checks.RequestFieldError, match=r"^messages\[1\]\['content'\]\[1\]\['text'\]: a lone"):
        request_checks.check(message)
    paired = Chat.model_validate({"messages": [{"role": "user", "content": json.loads('"\\ud83d\\ude00"')}]})
    request_checks.check(paired)


def test_plain_values_pass() -> None:
    request_checks.check(SimpleNamespace(n=4, seed=(1 << 63) - 1, chat_template_kwargs={"enable_thinking": True},
                                         messages=[SimpleNamespace(content="ok", tool_calls=[_call("f")])]))
