"""The reference is bit-reproducible: the same request gives bitwise the same log-probs cold and over
its own cached prompt, whichever slots hold its KV, whatever thread count the process is set to, and
in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from akv.system.reference_server import Engine, Generation, parse_chat_request

MODEL = "tiny-test"
CHUNK = 7  # prompts run in forwards of 7 queries, a shape whose BLAS sums are split by thread count
CONVERSATION = [
    {"role": "system", "content": "You follow shipment records."},
    {"role": "user", "content": "Where is shipment 7? Start at A."},
    {"role": "assistant", "content": "Reading A."},
    {"role": "user", "content": "line 1 of record A: 7 crates of tea\nnext record: B"},
    {"role": "assistant", "content": "Reading B."},
    {"role": "user", "content": "line 1 of record B: 14 crates of tea\nnext record: none"},
]
BODIES = {
    "plain": {"model": MODEL, "messages": CONVERSATION, "max_tokens": 8, "logprobs": True, "top_logprobs": 5},
    "drop and reposition": {"model": MODEL, "messages": CONVERSATION, "max_tokens": 8, "logprobs": True,
                            "top_logprobs": 5, "drop_message": {"5": [3]}, "reposition": [5]},
}
# A fresh interpreter serving one request cold: prints its log-probs as JSON (floats round-trip exactly).
FRESH = """
import json, sys
from akv.system.reference_server import Engine, parse_chat_request
engine = Engine(sys.argv[1], name=sys.argv[2], kv_slots=2048, prefill_chunk=int(sys.argv[3]))
generation = engine.serve(parse_chat_request(json.loads(sys.argv[4]), sys.argv[2], engine.content_format), None)
print(json.dumps([[s.chosen.logprob] + [t.logprob for t in s.top] for s in generation.steps]))
"""


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(tiny_model_dir, name=MODEL, kv_slots=2048, prefill_chunk=CHUNK)


def serve(engine: Engine, body: dict[str, Any]) -> Generation:
    return engine.serve(parse_chat_request(body, MODEL, engine.content_format), None)


def bits(generation: Generation) -> bytes:
    """The chosen and top log-probs of every step, as the bytes of their float64 values."""
    return np.array([[s.chosen.logprob] + [t.logprob for t in s.top] for s in generation.steps]).tobytes()


@pytest.mark.parametrize("name", BODIES)
def test_the_same_request_is_bitwise_the_same_cold_warm_and_in_other_slots(engine: Engine, name: str) -> None:
    body = BODIES[name]
    engine.cache.flush()
    cold = serve(engine, body)
    warm = serve(engine, body)
    assert warm.usage.cached_tokens > 0  # the second run read its prompt from the cache
    assert bits(warm) == bits(cold)
    engine.cache.flush()
    held = engine.pool.alloc(5)  # the next cold run gets other slots, handed out in another order
    try:
        assert bits(serve(engine, body)) == bits(cold)
    finally:
        engine.pool.decref(held)


def test_the_process_thread_count_does_not_matter(engine: Engine) -> None:
    previous = torch.get_num_threads()
    runs = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            engine.cache.flush()
            runs.append(bits(serve(engine, BODIES["plain"])))
    finally:
        torch.set_num_threads(previous)
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_a_fresh_process_gives_the_same_bits(engine: Engine, tiny_model_dir: Path) -> None:
    body = BODIES["drop and reposition"]
    engine.cache.flush()
    here = bits(serve(engine, body))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", FRESH, str(tiny_model_dir), MODEL, str(CHUNK), json.dumps(body)],
                         env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    assert np.array(json.loads(out)).tobytes() == here
