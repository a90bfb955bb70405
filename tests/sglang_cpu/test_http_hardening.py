"""Bad input and faults against the whole patched server on the CPU (one server for the module):
every bad request is a 400 or 413 that names the field and the problem, at once, without echoing
the body or Python internals; a body cut short or over the limit is answered, never dropped; plain
requests keep SGLang's features (n > 1); the server keeps serving afterwards. And reply reuse: the
second turn of a conversation reads the same resident KV on the patched server as on the reference
server (the prompt and every reply token fed back, not the reply's last token)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from akv.system.models.tiny import make_tiny_model

from .test_http import MESSAGES, post, sglang_url  # noqa: F401  (module-scoped server)
import http_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both servers' model here: a tiny Qwen3 whose greedy reply to ``MESSAGES`` ("kisarenezomu")
    tokenizes back to the ids generated, so the next turn can match all of them."""
    return make_tiny_model(tmp_path_factory.mktemp("reply-reuse") / "tiny-qwen3", seed=1)


INTERNALS = ("Traceback", "NoneType", "range()", "TextEncodeInput", "Error(", "object has no attribute")
CALL_WITHOUT_NAME = [*MESSAGES[:2], {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "done"}]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "default", "messages": MESSAGES, "max_tokens": 2, **fields}).encode()


BAD = [
    ("json-array", b'[{"role": "user", "content": "hi"}]', "body",
     "body: the request body must be a JSON object, got an array"),
    ("json-string", b'"Record B"', "body", "body: the request body must be a JSON object, got a string"),
    ("kwargs-add-generation-prompt", body(chat_template_kwargs={"add_generation_prompt": False}),
     "chat_template_kwargs", "chat_template_kwargs['add_generation_prompt']: set by the server"),
    ("kwargs-messages", body(chat_template_kwargs={"messages": []}), "chat_template_kwargs",
     "chat_template_kwargs['messages']: set by the server"),
    ("kwargs-tools", body(chat_template_kwargs={"tools": []}), "chat_template_kwargs",
     "chat_template_kwargs['tools']: set by the server"),
    ("n-0", body(n=0), "n", "n: must be at least 1, got 0"),
    ("lone-surrogate", body(messages=[MESSAGES[0], {"role": "user", "content": "a \ud800 b"}]), "messages",
     "messages[1].content: a lone UTF-16 surrogate"),
    ("tool-call-without-name", body(messages=CALL_WITHOUT_NAME), "messages",
     "messages[2].tool_calls[0].function.name: missing"),
    ("seed-1e30", body(seed=10**30), "seed", "seed: must fit a signed 64-bit integer"),
    ("seed-1e30-streamed", body(seed=10**30, stream=True), "seed", "seed: must fit a signed 64-bit integer"),
    ("seed-2^63", body(seed=1 << 63), "seed", "got 9223372036854775808"),
    ("drop-with-kwargs-messages", body(drop_message={"4": [3]}, chat_template_kwargs={"messages": []}),
     "chat_template_kwargs", "chat_template_kwargs['messages']: set by the server"),
]


@pytest.mark.parametrize(("data", "param", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests_are_a_400_naming_the_field(sglang_url: str, data: bytes, param: str, needle: str) -> None:
    status, error = http_client.post(sglang_url, data)
    assert status == 400, error
    assert error["param"] == param and needle in error["message"], error
    assert not any(marker in error["message"] for marker in INTERNALS), error
    assert "Record B" not in error["message"], "the request body is echoed back"


def raw_exchange(url: str, head: bytes, payload: bytes, *, half_close: bool) -> tuple[int, dict[str, Any]]:
    """Send a request head and ``payload``, optionally half-close, and read the whole answer."""
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(head + payload)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    assert answer.startswith(b"HTTP/1.1 "), f"no HTTP answer, got {answer[:200]!r}"
    status = int(answer.split(b" ", 2)[1])
    return status, json.loads(answer.split(b"\r\n\r\n", 1)[1])


def head(length: int) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("half_close", [True, False], ids=["then-eof", "then-wait"])
def test_a_huge_content_length_is_a_413_before_the_body(sglang_url: str, half_close: bool) -> None:
    status, error = raw_exchange(sglang_url, head(100 * 10**9), b"", half_close=half_close)
    assert status == 413 and error["param"] == "Content-Length", error
    assert "100000000000 bytes is over this server's body limit of 67108864 bytes" in error["message"]


def test_a_body_cut_short_is_a_400(sglang_url: str) -> None:
    payload = body()[:90]
    status, error = raw_exchange(sglang_url, head(5000), payload, half_close=True)
    assert status == 400 and error["param"] == "Content-Length", error
    assert "the body ended after 90 of the 5000 bytes announced" in error["message"]


def test_plain_requests_keep_n_above_1(sglang_url: str) -> None:
    status, reply = http_client.post(sglang_url, body(n=2, temperature=0.0, seed=7))
    assert status == 200 and len(reply["choices"]) == 2, reply


def test_the_second_turn_reuses_the_same_kv_on_both_servers(sglang_url: str, reference_url: str) -> None:
    """Turn 2 carries turn 1's greedy reply; it drops message 3 and repositions at its new user
    message, so the reply's resident KV is read re-rotated. Both servers hold the KV of turn 1's
    prompt and of every reply token but the last (whose KV only an overlap step computes)."""
    first = {"model": "default", "messages": MESSAGES, "max_tokens": 4, "temperature": 0.0}
    (got_status, got), (want_status, want) = post(sglang_url, first), post(reference_url, first)
    assert got_status == want_status == 200 and got["content"] == want["content"], (got, want)
    messages = [*MESSAGES, {"role": "assistant", "content": got["content"]}, {"role": "user", "content": "Go on."}]
    second = {**first, "messages": messages, "drop_message": {"7": [3]}, "reposition": [7]}
    (got_status, got2), (want_status, want2) = post(sglang_url, second), post(reference_url, second)
    assert got_status == want_status == 200, (got2, want2)
    assert got2["usage"]["prompt_tokens_details"] == want2["usage"]["prompt_tokens_details"]
    details = got2["usage"]["prompt_tokens_details"]
    resident = got["usage"]["prompt_tokens"] + got["usage"]["completion_tokens"] - 1
    assert details["repos_tokens"] > 0 and details["cached_tokens"] + details["repos_tokens"] == resident, (
        details, resident)


def test_the_server_still_serves_after_the_bad_requests(sglang_url: str) -> None:
    status, reply = http_client.post(sglang_url, body(temperature=0.0, drop_message={"4": [3]}, reposition=[4]))
    assert status == 200 and reply["usage"]["prompt_tokens_details"]["drop_skipped_tokens"] > 0, reply
