"""A request that fails at any step after admission gives back everything it took: the pool's reference
counts and the tree are exactly as before it came, and the next request is served. A KV demand the
pool cannot meet is a 400 when it never fits and a 503 while other requests hold the slots."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import akv.system.reference_server.engine as engine_module
import akv.system.reference_server.server as server_module
from akv.system.cache import ActiveRequest
from akv.system.cache.occurrence import cold_plan
from akv.system.reference_server import Engine, ReferenceServer, parse_chat_request
from akv.system.reference_server.sampling import Sampler
from akv.system.reference_server.text import TextTracker
from http_client import post_text

MODEL = "tiny-test"


def body(topic: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": f"Tell me about {topic}."}]
    return {"model": MODEL, "messages": messages, "max_tokens": 6, **extra}


def snapshot(engine: Engine) -> tuple[list[int], dict[str, int], int]:
    """Every slot's reference count, the tree's shape, and the number of active requests."""
    refs = engine.pool.refcount(np.arange(1, engine.pool.size + 1)).tolist()
    return refs, engine.cache.tree.stats(), engine.cache.active


def nothing_held_outside_the_tree(engine: Engine, *active: ActiveRequest) -> bool:
    """Every slot reference belongs to the tree or to one of the ``active`` requests."""
    holders = [engine.cache.tree.resident_slots()] + [np.concatenate([a.plan.borrowed, a.plan.fresh]) for a in active]
    counted = np.bincount(np.concatenate(holders).astype(np.int64), minlength=engine.pool.size + 1)[1:]
    refs = engine.pool.refcount(np.arange(1, engine.pool.size + 1))
    return engine.cache.active == len(active) and bool((refs == counted).all())


def fail_on(call: int, original: Callable[..., Any], where: str) -> Callable[..., Any]:
    """``original``, except that call number ``call`` raises."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(f"injected fault in {where}")
        return original(*args, **kwargs)

    return wrapped


# Every step of Engine.generate after admission; the number is the call that fails.
FAULTS: dict[str, Callable[[pytest.MonkeyPatch, Engine], None]] = {
    "sampler setup": lambda mp, e: mp.setattr(engine_module, "Sampler", fail_on(1, Sampler, "sampler setup")),
    "text tracker setup": lambda mp, e: mp.setattr(engine_module, "TextTracker",
                                                   fail_on(1, TextTracker, "text tracker setup")),
    "prefill": lambda mp, e: mp.setattr(engine_module, "run_prefill",
                                        fail_on(1, engine_module.run_prefill, "prefill")),
    "sampling a later token": lambda mp, e: mp.setattr(Sampler, "pick", fail_on(3, Sampler.pick, "sampling")),
    "decoding text": lambda mp, e: mp.setattr(TextTracker, "update", fail_on(2, TextTracker.update, "decoding")),
    "decode forward": lambda mp, e: mp.setattr(engine_module, "forward_paged",
                                               fail_on(2, engine_module.forward_paged, "decode forward")),
    "publishing": lambda mp, e: mp.setattr(e.cache, "finish", fail_on(1, e.cache.finish, "publishing")),
    "streaming a chunk": lambda mp, e: mp.setattr(server_module, "logprob_entries",
                                                  fail_on(2, server_module.logprob_entries, "streaming")),
}


@pytest.fixture()
def no_eos(served: Any, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """Generation always runs to max_tokens, so every decode step is reached."""
    engine = served.engine
    monkeypatch.setattr(engine, "files", dataclasses.replace(engine.files, eos_token_ids=frozenset()))
    return engine


CASES = [(fault, stream) for fault in FAULTS for stream in (False, True) if stream or fault != "streaming a chunk"]


@pytest.mark.parametrize(("fault", "stream"), CASES, ids=[f"{f}-{'stream' if s else 'complete'}" for f, s in CASES])
def test_a_failure_after_admission_releases_everything(served: Any, no_eos: Engine, monkeypatch: pytest.MonkeyPatch,
                                                       fault: str, stream: bool) -> None:
    assert post_text(served.url, body("tea"))[0] == 200  # a resident prefix the failing request locks
    request = body(f"tea and {fault}", stream=stream, logprobs=True)
    before = snapshot(no_eos)
    with monkeypatch.context() as mp:
        FAULTS[fault](mp, no_eos)
        status, text = post_text(served.url, request)
    assert "injected fault" in text
    if status == 200:  # the stream had started: an error event and no [DONE]
        assert stream and "[DONE]" not in text
    else:
        assert status == 500
    assert snapshot(no_eos) == before
    assert post_text(served.url, request)[0] == 200


def test_a_failing_reply_after_publishing_holds_nothing(served: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "logprob_entries", fail_on(1, server_module.logprob_entries, "the reply"))
    status, text = post_text(served.url, body("coffee", logprobs=True))
    assert status == 500 and "injected fault in the reply" in text
    assert nothing_held_outside_the_tree(served.engine)
    monkeypatch.undo()
    assert post_text(served.url, body("coffee", logprobs=True))[0] == 200


def test_an_out_of_range_seed_is_refused_before_admission(served: Any) -> None:
    before = snapshot(served.engine)
    status, text = post_text(served.url, body("seeds", seed=10**30, temperature=1.0))
    assert status == 400 and json.loads(text)["error"]["param"] == "seed"
    assert snapshot(served.engine) == before
    for _ in range(3):  # the old leak: a few of these exhausted the pool for good
        assert post_text(served.url, body("seeds", seed=-(10**30), temperature=1.0))[0] == 400
    assert snapshot(served.engine) == before
    assert post_text(served.url, body("seeds", seed=2**64 - 1, temperature=1.0))[0] == 200


# --- KV capacity: a pool a little larger than one request ---------------------------------------------

def long_body(topic: str, **extra: Any) -> dict[str, Any]:
    text = " ".join(f"{topic} fact {i} is {i * 17 % 101}." for i in range(12))
    return body(topic, **extra) | {"messages": [{"role": "user", "content": text}]}


def prompt_tokens(engine: Engine, payload: dict[str, Any]) -> int:
    request = parse_chat_request(payload, MODEL, engine.content_format)
    return engine.prepare(request).program.n_tokens


@pytest.fixture(scope="module")
def small(tiny_model_dir: Path) -> Iterator[tuple[str, Engine]]:
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=8192)
    # Room for one long request and its decode, not for two at once.
    size = prompt_tokens(engine, long_body("tea")) + 40
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=size)
    server = ReferenceServer(engine)
    with server.running():
        yield server.url, engine


def test_a_demand_that_never_fits_is_a_400_naming_the_field(small: tuple[str, Engine]) -> None:
    url, engine = small
    before = snapshot(engine)
    status, text = post_text(url, long_body("tea", max_tokens=engine.pool.size))
    assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"
    status, text = post_text(url, long_body("tea", max_tokens=None, max_completion_tokens=engine.pool.size))
    assert status == 400 and json.loads(text)["error"]["param"] == "max_completion_tokens"
    huge = long_body("tea") | {"messages": [{"role": "user", "content": "word " * engine.pool.size}]}
    status, text = post_text(url, huge)
    assert status == 400 and json.loads(text)["error"]["param"] == "messages"
    assert snapshot(engine) == before
    assert post_text(url, long_body("tea"))[0] == 200


def test_a_demand_that_fits_later_is_a_503_and_then_served(small: tuple[str, Engine]) -> None:
    url, engine = small
    other = parse_chat_request(long_body("coffee"), MODEL, engine.content_format)
    holder = engine.cache.admit(engine.prepare(other).program)  # another request, mid-flight
    try:
        for stream in (False, True):
            status, text = post_text(url, long_body("tea", stream=stream))
            assert status == 503 and json.loads(text)["error"]["code"] == 503
            assert nothing_held_outside_the_tree(engine, holder)
    finally:
        engine.cache.abort(holder)
    assert post_text(url, long_body("tea"))[0] == 200
    assert nothing_held_outside_the_tree(engine)


def record(name: str, following: str) -> str:
    lines = [f"line {k} of record {name}: {k * 7} crates of tea, seal {k * 131 % 997}" for k in range(6)]
    return "\n".join(lines + [f"next record: {following}"])


def tool_turn(i: int, name: str, following: str) -> list[dict[str, Any]]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "read_record",
                                                            "arguments": json.dumps({"record_id": name})}}
    return [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": record(name, following)}]


CONVERSATION = [{"role": "system", "content": "You follow shipment records."},
                {"role": "user", "content": "Where is shipment 7? Start at A."},
                *tool_turn(2, "A", "B"), *tool_turn(4, "B", "C"), *tool_turn(6, "C", "none; final stop is Dock 9")]
CONTEXT_STEPS = [  # each request's KV stays in the tree, so the tokens of messages 0..5 gain versions
    {"messages": CONVERSATION[:6]},
    {"messages": CONVERSATION, "drop_message": {"5": [3]}, "reposition": [5]},
    {"messages": CONVERSATION, "drop_message": {"5": [3], "7": [5]}, "reposition": [5, 7]},
]


def test_a_pool_just_big_enough_for_a_cold_start_serves_the_warm_request(tiny_model_dir: Path) -> None:
    """The last step matches messages 0..5 with every version the earlier steps left. Admission locks
    only the versions its plan reads, so in a pool just big enough for its cold start it evicts the
    rest (stale re-rotated copies among them) and is served with the matched prefix reused, instead
    of failing (the engine's cold fallback is not needed)."""
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=8192)
    payloads = [{"model": MODEL, "max_tokens": 2, **step} for step in CONTEXT_STEPS]
    last = engine.prepare(parse_chat_request(payloads[-1], MODEL, engine.content_format)).program
    cold_slots = cold_plan(last).n_slots + 1  # the prompt's slots, and one generated token's
    engine = Engine(tiny_model_dir, name=MODEL, kv_slots=cold_slots)
    server = ReferenceServer(engine)
    server.start_in_background()
    try:
        replies = [post_text(server.url, payload) for payload in payloads]
    finally:
        server.shutdown()
        server.server_close()
    assert [status for status, _ in replies] == [200, 200, 200], replies[-1][1]
    assert json.loads(replies[-1][1])["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert nothing_held_outside_the_tree(engine)
