"""Loopback fuzzing of the reference server: mutated request bodies (JSON values of every kind, at
every field, lone surrogates, huge numbers, deletions, unknown fields) and malformed HTTP bodies
(truncated, binary, invalid UTF-8, a Content-Length that disagrees). Every reply is a 200 or a 4xx
whose JSON error names a field; never a 500, a reset or a hang. Afterwards no request holds a slot
and a normal request is served. Bounded: a few hundred examples, derandomised, on one small pool."""

from __future__ import annotations

import copy
import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from akv.system.reference_server import Engine, ReferenceServer

MODEL = "tiny-test"
CALL = {"id": "c1", "type": "function", "function": {"name": "read_record", "arguments": '{"record_id": "A"}'}}
TOOLS = [{"type": "function", "function": {"name": "read_record", "description": "read a record",
                                           "parameters": {"type": "object",
                                                          "properties": {"record_id": {"type": "string"}}}}}]
VALID = {
    "model": MODEL,
    "messages": [
        {"role": "system", "content": "Follow the records."},
        {"role": "user", "content": "Start at A."},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "record A says go to B"},
    ],
    "tools": TOOLS,
    "max_tokens": 3,
    "drop_message": {"3": [1]},
    "reposition": [3],
}
PATHS: list[tuple[Any, ...]] = [
    ("model",), ("messages",), ("messages", 0), ("messages", 1, "role"), ("messages", 1, "content"),
    ("messages", 1, "name"), ("messages", 2, "content"), ("messages", 2, "tool_calls"),
    ("messages", 2, "tool_calls", 0), ("messages", 2, "tool_calls", 0, "id"),
    ("messages", 2, "tool_calls", 0, "function"), ("messages", 2, "tool_calls", 0, "function", "name"),
    ("messages", 2, "tool_calls", 0, "function", "arguments"), ("messages", 3, "tool_call_id"),
    ("messages", 3, "content"), ("tools",), ("tools", 0), ("tools", 0, "type"), ("tools", 0, "function", "name"),
    ("tools", 0, "function", "parameters"), ("tool_choice",), ("max_tokens",), ("max_completion_tokens",),
    ("temperature",), ("top_p",), ("seed",), ("stop",), ("stream",), ("stream_options",),
    ("stream_options", "include_usage"), ("logprobs",), ("top_logprobs",), ("n",), ("presence_penalty",),
    ("frequency_penalty",), ("logit_bias",), ("chat_template_kwargs",), ("chat_template_kwargs", "messages"),
    ("chat_template_kwargs", "enable_thinking"), ("drop_message",), ("drop_message", "3"), ("drop_message", "2"),
    ("reposition",), ("reposition", 0), ("drop_rule",), ("user",), ("unknown_field",),
]
TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "<tool_call>", "{oops", "3", "-1", ""])
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.sampled_from([0, 1, 2, -1, 10**30, 2**64, 1.0, 0.5, 1e308, -0.0]) | st.floats(allow_nan=False) | TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
MUTATION = st.tuples(st.sampled_from(PATHS), st.none() | VALUES.map(lambda v: ("set", v)))


def mutate(body: dict[str, Any], path: tuple[Any, ...], change: tuple[str, Any] | None) -> None:
    """Set the value at ``path`` (or delete it when ``change`` is None); a path that no longer exists is skipped."""
    target: Any = body
    for key in path[:-1]:
        try:
            target = target[key]
        except (KeyError, IndexError, TypeError):
            return
    last = path[-1]
    if isinstance(target, dict) or (isinstance(target, list) and isinstance(last, int) and last < len(target)):
        if change is None:
            if isinstance(target, dict):
                target.pop(last, None)
            else:
                del target[last]
        else:
            target[last] = change[1]


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir: Path) -> Iterator[tuple[ReferenceServer, Engine]]:
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=640)  # small: any long generation is refused
    server = ReferenceServer(engine, io_timeout=5.0)
    with server.running():
        yield server, engine


def exchange(server: ReferenceServer, raw: bytes) -> tuple[int, bytes]:
    """POST ``raw`` as the body over a fresh connection; (status, body) of the reply."""
    host, port = server.server_address[:2]
    connection = http.client.HTTPConnection(host, port, timeout=60)
    try:
        connection.request("POST", "/v1/chat/completions", body=raw, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def assert_answered(status: int, data: bytes) -> None:
    event(f"HTTP {status}")
    if status == 200:
        if data.startswith(b"data: "):
            events = [line for line in data.split(b"\n\n") if line]
            assert events[-1] == b"data: [DONE]" and b'"error"' not in data, data[-300:]
        else:
            assert json.loads(data)["choices"]
        return
    assert 400 <= status < 500, data[:500]
    error = json.loads(data)["error"]
    event(f"param {str(error['param']).split('[')[0].split('.')[0]}")
    assert isinstance(error["param"], str) and error["param"], error
    assert error["message"].startswith(error["param"] + ":"), error


def nothing_held_outside_the_tree(engine: Engine) -> bool:
    counted = np.bincount(engine.cache.tree.resident_slots(), minlength=engine.pool.size + 1)[1:]
    refs = engine.pool.refcount(np.arange(1, engine.pool.size + 1))
    return engine.cache.active == 0 and bool((refs == counted).all())


FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_mutated_bodies_are_answered_with_200_or_a_named_4xx(fuzzed: tuple[ReferenceServer, Engine],
                                                            mutations: list[Any]) -> None:
    server, engine = fuzzed
    body = copy.deepcopy(VALID)
    for path, change in mutations:
        mutate(body, path, change)
    status, data = exchange(server, json.dumps(body).encode())
    assert_answered(status, data)
    assert nothing_held_outside_the_tree(engine)


RAW = st.one_of(
    st.binary(max_size=64),
    st.integers(0, len(json.dumps(VALID))).map(lambda n: json.dumps(VALID).encode()[:n]),
    st.integers(1, 3000).map(lambda n: b'{"a": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(1, 3000).map(lambda n: b"[" * n),
    st.sampled_from([b"\xff\xfe{}", b'{"model": "\xc3"}', b"null", b"[]", b"1e999", b'"\\ud800"', b"{}"]),
)


@FUZZ
@given(raw=RAW, shortfall=st.integers(0, 3))
def test_malformed_http_bodies_are_a_named_4xx(fuzzed: tuple[ReferenceServer, Engine], raw: bytes,
                                              shortfall: int) -> None:
    """The body, declared ``shortfall`` bytes longer than sent, then the write side closed."""
    server, engine = fuzzed
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw) + shortfall}\r\n\r\n").encode()
    with socket.create_connection(server.server_address[:2], timeout=60) as sock:
        sock.sendall(head + raw)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply, "the connection closed without a reply"
    status_line, _, rest = reply.partition(b"\r\n")
    status = int(status_line.split()[1])
    assert_answered(status, rest.partition(b"\r\n\r\n")[2])
    assert status != 200 or shortfall == 0
    assert nothing_held_outside_the_tree(engine)


def test_after_fuzzing_a_normal_request_is_served(fuzzed: tuple[ReferenceServer, Engine]) -> None:
    server, engine = fuzzed
    status, data = exchange(server, json.dumps(VALID).encode())
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] > 0
    engine.cache.flush()
    assert engine.pool.n_free == engine.pool.size  # with the tree emptied, every slot is free again
