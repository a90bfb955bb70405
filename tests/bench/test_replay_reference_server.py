"""The simulator's counts equal the CPU reference server's usage for the same conversation: the
same payloads (real chat messages, AKV fields from akv.agent) sent to `akv.system.reference_server`
with a tiny random model (a fresh server per case), one output token per call (so neither side
publishes generated KV)."""

from __future__ import annotations

import dataclasses

import pytest

from akv.agent import send_chat_request
from bench.agent_replay.chat import Filler, realize
from bench.agent_replay.methods import AKV, FullContext, reference_policy
from bench.agent_replay.serve import Conversation, payload
from bench.agent_replay.simulator import Simulator
from bench.agent_replay.trajectories import Range, TrajectoryStats, from_messages, generate

pytest.importorskip("transformers")

SMALL = TrajectoryStats(
    turns=(6, 6), tool_result=Range(40, 0.4, 15, 90), reasoning=Range(12, 0.3, 4, 30), reply=Range(4, 0.3, 0, 10),
    call_arguments=Range(40, 0.2, 30, 60), batch_sizes=((1, 0.4), (2, 0.6)), system_tokens=30,
    task_tokens=Range(15, 0.2, 8, 30), final_reply=Range(10, 0.2, 5, 20), tools=("search", "read"))


@pytest.fixture
def served(tiny_model_dir):
    from akv.system.reference_server import Engine, ReferenceServer

    server = ReferenceServer(Engine(tiny_model_dir, name="tiny-test", kv_slots=8192))
    server.start_in_background()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("method", [FullContext(), AKV(reference_policy(2), name="akv_keep2")], ids=lambda m: m.name)
def test_simulator_counts_equal_the_reference_servers_usage(served, tiny_counter, method):
    synthetic = generate(SMALL, 11)
    messages = realize(synthetic, tiny_counter, Filler.for_tokenizer(tiny_counter.tokenizer))
    t = from_messages("ref", messages, tiny_counter, {a: 1 for a in synthetic.calls})
    conversation = Conversation(0, t, tuple(messages), ())
    requests = method.requests(t, messages) if isinstance(method, AKV) else method.requests(t)
    sim = Simulator()
    served_counts, simulated = [], []
    for request in requests:
        request = dataclasses.replace(request, generated=1)
        body = payload(conversation, request, "tiny-test", Filler((" x",)))
        del body["ignore_eos"]
        reply = send_chat_request(served, body, timeout=120)
        usage = reply.usage
        served_counts.append((usage.prompt_tokens, usage.cached_tokens, usage.repos_tokens, usage.drop_skipped_tokens))
        row = sim.run(request, t.generation_tokens)
        simulated.append((row.prompt, row.cached, row.repos, row.skipped))
    assert simulated == served_counts
    if isinstance(method, AKV):
        assert sum(c[2] for c in simulated) > 0 and sum(c[3] for c in simulated) > 0
