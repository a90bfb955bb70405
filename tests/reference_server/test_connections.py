"""Misbehaving connections cost only themselves: a client that stops reading a stream does not block
other clients (nor does a long request: requests take turns token by token) and is dropped after the
I/O timeout with its request released; bursts of simultaneous connections are all served; half-open
or vanished connections end with one log line, no traceback."""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from akv.system.reference_server import Engine, ReferenceServer, parse_chat_request

MODEL = "tiny-test"
IO_TIMEOUT = 1.0
STREAM_BUFFER = 16 << 10  # a few tokens with 20 alternatives each
WAIT = 60.0  # an upper bound for things that must happen, never a performance claim


class SmallBuffers(ReferenceServer):
    """Small kernel send buffers, so that a client which stops reading stalls the server's writes soon."""

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        return connection, address


@dataclasses.dataclass(frozen=True)
class Live:
    server: ReferenceServer
    engine: Engine

    @property
    def port(self) -> int:
        return self.server.server_address[1]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=8192)
    server = SmallBuffers(engine, io_timeout=IO_TIMEOUT, stream_buffer=STREAM_BUFFER)
    with server.running():
        yield Live(server, engine)


def payload(**extra: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say something."}],
                       "max_tokens": 4, **extra}).encode()


def post_bytes(body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


def complete(live: Live, timeout: float = WAIT) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{live.port}/v1/chat/completions", data=payload(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(WAIT)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def wait_until(condition: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def writing() -> bool:
    """A reply stream is being written (its writer thread is alive)."""
    return any(thread.name == "akv-stream-writer" for thread in threading.enumerate())


def nothing_held_outside_the_tree(engine: Engine) -> bool:
    counted = np.bincount(engine.cache.tree.resident_slots(), minlength=engine.pool.size + 1)[1:]
    refs = engine.pool.refcount(np.arange(1, engine.pool.size + 1))
    return engine.cache.active == 0 and bool((refs == counted).all())


def reset(sock: socket.socket) -> None:
    """Vanish: close with an RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def open_stream(live: Live, max_tokens: int, content: str) -> socket.socket:
    """A streamed request with 20 alternatives per token (a few kB each) on a small receive buffer,
    once the engine holds it; nothing is read from it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", live.port))
    active = live.engine.cache.active
    sock.sendall(post_bytes(payload(stream=True, max_tokens=max_tokens, logprobs=True, top_logprobs=20,
                                    messages=[{"role": "user", "content": content}])))
    wait_until(lambda: live.engine.cache.active > active)
    return sock


@pytest.fixture()
def no_eos(live: Live, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """Generation always runs to max_tokens."""
    engine = live.engine
    monkeypatch.setattr(engine, "files", dataclasses.replace(engine.files, eos_token_ids=frozenset()))
    return engine


def test_a_stalled_reader_holds_up_only_itself(live: Live, no_eos: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Far more tokens than the stream's buffer and the socket buffers hold: the stalled request waits
    for its reader while another client's request is served; it still holds its KV when that reply
    arrives, and gives everything back when its client goes."""
    monkeypatch.setattr(live.server, "io_timeout", WAIT)  # only the client's reset may release it
    stalled = open_stream(live, 4000, "A stream nobody reads.")
    assert complete(live) == 200
    assert no_eos.cache.active == 1  # served before the stalled request was released
    tree = no_eos.cache.tree.stats()
    reset(stalled)
    wait_until(lambda: no_eos.cache.active == 0)
    assert no_eos.cache.tree.stats() == tree  # the aborted request published nothing
    assert nothing_held_outside_the_tree(no_eos)
    assert complete(live) == 200


def test_a_long_request_does_not_hold_up_a_short_one(live: Live, no_eos: Engine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A long stream whose client reads everything: a short request is served while it runs."""
    monkeypatch.setattr(live.server, "io_timeout", WAIT)
    long = open_stream(live, 6000, "A long stream, read as it comes.")
    stop = threading.Event()
    received: list[bytes] = []

    def read() -> None:
        long.settimeout(WAIT)
        while not stop.is_set() and (chunk := long.recv(65536)):
            received.append(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert complete(live) == 200
        assert no_eos.cache.active == 1  # the long request is still generating
    finally:
        stop.set()
        reader.join()
        reset(long)
    assert b"".join(received).startswith(b"HTTP/1.0 200")
    wait_until(lambda: no_eos.cache.active == 0)
    assert nothing_held_outside_the_tree(no_eos)


def test_a_request_that_does_not_fit_beside_a_running_one_waits_for_it(live: Live, no_eos: Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled stream holds every slot of the pool: the next request waits for it (no 503), and is
    served once the stalled one is gone."""
    monkeypatch.setattr(live.server, "io_timeout", WAIT)
    no_eos.cache.flush()
    content = "A stream that holds every slot."
    body = json.loads(payload(max_tokens=1, messages=[{"role": "user", "content": content}]))
    prompt_slots = no_eos.prepare(parse_chat_request(body, MODEL, no_eos.content_format)).kv_slots
    stalled = open_stream(live, no_eos.pool.size - prompt_slots + 1, content)
    statuses: list[int] = []
    waiting = threading.Thread(target=lambda: statuses.append(complete(live)))
    waiting.start()
    wait_until(lambda: no_eos.waiting == 1)
    reset(stalled)
    waiting.join()
    assert statuses == [200]
    wait_until(lambda: no_eos.cache.active == 0)
    assert nothing_held_outside_the_tree(no_eos)


def test_a_stalled_reader_is_dropped_at_its_deadline(live: Live, no_eos: Engine,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    tree = no_eos.cache.tree.stats()
    stalled = open_stream(live, 4000, "A stream nobody reads until it is dropped.")
    wait_until(lambda: no_eos.cache.active == 0 and not writing())  # no help from the client
    received = read_all(stalled)
    stalled.close()
    assert received.startswith(b"HTTP/1.0 200") and b"data: [DONE]" not in received  # dropped mid-stream
    assert capsys.readouterr().err.count("stream dropped: TimeoutError") == 1
    assert no_eos.cache.tree.stats() == tree
    assert nothing_held_outside_the_tree(no_eos)
    assert complete(live) == 200


def test_a_vanished_stream_client_releases_its_request(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = live.engine
    monkeypatch.setattr(engine, "files", dataclasses.replace(engine.files, eos_token_ids=frozenset()))
    start = engine.pool.refcount(np.arange(1, engine.pool.size + 1)).tolist(), engine.cache.tree.stats()
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(post_bytes(payload(stream=True, max_tokens=2000, messages=[
        {"role": "user", "content": "A request nobody will read."}])))
    head = b""
    while len(head) < 12:
        head += sock.recv(12 - len(head))
    assert head == b"HTTP/1.0 200"  # the stream has started
    reset(sock)
    wait_until(lambda: engine.cache.active == 0)
    # Abandoned before it finished: nothing published, every slot back.
    assert (engine.pool.refcount(np.arange(1, engine.pool.size + 1)).tolist(), engine.cache.tree.stats()) == start
    assert complete(live) == 200


def test_a_burst_of_connections_is_served(tiny_model_dir: Path) -> None:
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=256)
    server = ReferenceServer(engine, io_timeout=IO_TIMEOUT)
    n = 64
    sockets: list[socket.socket | None] = [None] * n

    def connect(i: int) -> None:
        try:
            sockets[i] = socket.create_connection(server.server_address[:2], timeout=2.0)
        except OSError:
            pass

    try:
        # All connect while the server is not accepting yet: they wait in the listen backlog.
        threads = [threading.Thread(target=connect, args=(i,)) for i in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        server.start_in_background()
        replies = []
        for sock in sockets:
            if sock is None:
                replies.append(b"")
                continue
            sock.settimeout(WAIT)
            sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            replies.append(read_all(sock))
            sock.close()
    finally:
        server.shutdown()
        server.server_close()
    assert [r.split(b"\r\n", 1)[0] for r in replies] == [b"HTTP/1.0 200 OK"] * n


def test_a_half_open_connection_is_closed_after_the_timeout(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.sendall(b"POST /v1/chat/co")  # then nothing more
        assert read_all(sock) == b""  # the server hung up
    with socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.sendall(post_bytes(payload()[:10], content_length=len(payload())))
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.0 408")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["param"] == "Content-Length"
    assert complete(live) == 200
    assert "Traceback" not in capsys.readouterr().err


def test_a_body_shorter_than_its_content_length_is_a_400(live: Live) -> None:
    with socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.sendall(post_bytes(payload()[:10], content_length=len(payload())))
        sock.shutdown(socket.SHUT_WR)
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.0 400")
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == "Content-Length" and "ended after 10 bytes" in error["message"]


def test_a_vanished_connection_is_one_log_line(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    for partial in (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",  # inside the headers
                    post_bytes(b'{"model": ', content_length=500)):  # inside the body
        sock = socket.create_connection(("127.0.0.1", live.port))
        sock.sendall(partial)
        time.sleep(0.2)  # let the server start reading before the reset arrives
        reset(sock)
    err = [""]

    def two_lines() -> bool:
        err[0] += capsys.readouterr().err
        return err[0].count("akv-reference: client") >= 2

    wait_until(two_lines)
    assert complete(live) == 200
    err[0] += capsys.readouterr().err
    assert "Traceback" not in err[0]
    dropped = [line.split(" dropped: ")[1] for line in err[0].splitlines() if line.startswith("akv-reference: client")]
    assert dropped == ["ConnectionResetError(104, 'Connection reset by peer')"] * 2
