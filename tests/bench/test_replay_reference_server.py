"""The simulator's counts equal the CPU reference server's usage for the same conversation: the
same payloads (real chat messages, AKV fields from akv.agent) sent to `akv.system.reference_server`
with a tiny random model (a fresh server per case), one output token per call (so neither side
publishes generated KV); for every method, also through the serving replay's client."""

from __future__ import annotations

import dataclasses

import pytest

from akv.agent import send_chat_request
from bench.agent_replay.chat import Filler, realize
from bench.agent_replay.methods import AKV, FullContext, Summarize, Trim, reference_policy
from bench.agent_replay.serve import Conversation, payload, prepare, replay
from bench.agent_replay.simulator import Simulator
from bench.agent_replay.trajectories import TINY, Range, TrajectoryStats, from_messages, generate

pytest.importorskip("transformers")

SMALL = TrajectoryStats(
    turns=(6, 6), tool_result=Range(40, 0.4, 15, 90), reasoning=Range(12, 0.3, 4, 30), reply=Range(4, 0.3, 0, 10),
    call_arguments=Range(40, 0.2, 30, 60), batch_sizes=((1, 0.4), (2, 0.6)), system_tokens=30,
    task_tokens=Range(15, 0.2, 8, 30), final_reply=Range(10, 0.2, 5, 20), tools=("search", "read"))


@pytest.fixture
def served(tiny_model_dir):
    from akv.system.reference_server import Engine, ReferenceServer

    server = ReferenceServer(Engine(tiny_model_dir, name="tiny-test", kv_slots=8192))
    with server.running():
        yield server.url


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


def _served_request(request, body, counter):
    """`request` with each piece's tokens as the served body renders them (the chat template's
    spans), and the rendered prompt's token ids."""
    rendered = counter.render(body["messages"])
    layout = rendered.layout
    pieces = tuple(dataclasses.replace(p, tokens=end - start) for p, (start, end) in zip(request.pieces, layout.spans,
                                                                                         strict=True))
    return dataclasses.replace(request, pieces=pieces), layout.generation_tokens, rendered.token_ids


EDIT_SHARED_BOUND = 24
EVERY_METHOD = [FullContext(), Summarize(900, summary_tokens=60, name="standard"),
                Summarize(500, summary_tokens=60, name="text_engineering"), Trim(2),
                AKV(reference_policy(2, 600), name="akv_keep2"), AKV(reference_policy(2), name="akv_keep2_every_turn")]


@pytest.mark.parametrize("method", EVERY_METHOD, ids=lambda m: m.name)
def test_serving_replay_usage_equals_the_simulators_counts(served, tiny_counter, method):
    """A tagged conversation per method replayed through `replay` (the benchmark's own client path)
    against the reference server: every request's served usage equals the simulator's counts for
    the same conversation (its real token ids), and only the texts a text method writes itself
    (summaries, instructions, placeholders) differ in size from what the method declared. With
    synthetic ids (one range per piece, as in the cost tables) the simulator is exact for Full and
    AKV and misses, per request of a text method, the few tokens a server still shares across an
    edit (the edited message's leading scaffolding, the summary's fixed first words)."""
    filler = Filler.for_tokenizer(tiny_counter.tokenizer)
    synthetic = generate(TINY, 5, "tiny-5")
    messages = realize(synthetic, tiny_counter, filler)
    trajectory = from_messages("tiny-5", messages, tiny_counter, {a: 1 for a in synthetic.calls})
    conversations = [dataclasses.replace(c, requests=tuple(dataclasses.replace(r, generated=1) for r in c.requests))
                     for c in prepare(trajectory, method, [0], filler, run="usage-test")]
    samples, _ = replay(served, conversations, 1, "tiny-test", filler, timeout_s=120, ignore_eos=False)
    assert [s.error for s in samples] == [None] * sum(len(c.requests) for c in conversations)
    sim, synthetic, gaps = Simulator(), Simulator(), []
    by_conversation = {c.index: iter(c.requests) for c in conversations}
    for sample in samples:
        conversation = conversations[sample.conversation]
        request = next(by_conversation[sample.conversation])
        body = payload(conversation, request, "tiny-test", filler, ignore_eos=False)
        seen, generation, token_ids = _served_request(request, body, tiny_counter)
        assert generation == trajectory.generation_tokens
        resized = {p.key[0] for p, q in zip(request.pieces, seen.pieces) if p.tokens != q.tokens}
        assert resized <= {"s", "i", "p"}, (method.name, request.turn, resized)
        row = sim.run(seen, generation, token_ids=token_ids)
        gaps.append(row.cached - synthetic.run(seen, generation).cached)
        assert (sample.prompt_tokens, sample.cached_tokens or 0, sample.repos_tokens or 0,
                sample.drop_skipped_tokens or 0) == (row.prompt, row.cached, row.repos, row.skipped), \
            (method.name, sample.conversation, request.turn, request.kind)
    if isinstance(method, (Summarize, Trim)):  # an edited message's leading scaffolding and the summaries'
        assert all(0 <= g <= EDIT_SHARED_BOUND for g in gaps) and any(gaps)  # fixed first words are still shared
    else:
        assert not any(gaps)
    kinds = {r.kind for c in conversations for r in c.requests}
    if isinstance(method, Summarize):
        assert "summary" in kinds
    if isinstance(method, AKV):
        assert sum(s.repos_tokens or 0 for s in samples) > 0 and sum(s.drop_skipped_tokens or 0 for s in samples) > 0
