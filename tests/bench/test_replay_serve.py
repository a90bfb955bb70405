"""The serving replay against the loopback stand-in: requests arrive in order with fixed output
lengths, text methods send their edits as text, AKV sends akv.agent's fields, and the CLI writes
JSON and markdown for every (method, concurrency)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from akv.agent import ApproximateTokenCounter, CachePolicy, ResultSelection, TurnReposition
from bench.agent_replay import loopback
from bench.agent_replay.chat import Filler, realize
from bench.agent_replay.methods import AKV, FullContext, Summarize, Trim, reference_policy
from bench.agent_replay.pool import parse_gauges
from bench.agent_replay.serve import PLACEHOLDER, TAG_UNITS, percentile, prepare, replay, summarize
from bench.agent_replay.trajectories import BROWSE, Trajectory, generate
from bench.serve_replay import main

FILLER = Filler.for_approximate()


def _trajectory(seed: int = 1, turns: int = 7) -> Trajectory:
    t = generate(BROWSE, seed, f"t{seed}", turns=turns)
    return Trajectory(t.name, t.specs, t.generation_tokens, tuple(realize(t, ApproximateTokenCounter(), FILLER)))


def _run(method, conversations: int = 3, concurrency: int = 2):
    trajectories = [_trajectory(1), _trajectory(2)]
    convs = [c for k in range(conversations) for c in prepare(trajectories[k % 2], method, [k], FILLER)]
    state = loopback.Loopback()
    with loopback.serve(state) as url:
        samples, wall = replay(url, convs, concurrency, "m", FILLER, timeout_s=30)
    system = {c.messages[0]["content"]: c.index for c in convs}
    by_conversation = defaultdict(list)
    for body in state.requests:
        by_conversation[system[body["messages"][0]["content"]]].append(body)
    return convs, samples, wall, by_conversation


def test_full_context_requests_arrive_in_order_with_fixed_output_lengths():
    convs, samples, wall, bodies = _run(FullContext())
    assert len(samples) == sum(len(c.requests) for c in convs) and all(s.error is None for s in samples)
    for conv in convs:
        sent = bodies[conv.index]
        assert [len(b["messages"]) for b in sent] == list(conv.trajectory.calls)
        assert [b["max_tokens"] for b in sent] == [conv.trajectory.specs[a].generated for a in conv.trajectory.calls]
        assert all(b["ignore_eos"] is True and "drop_message" not in b for b in sent)
        for b, a in zip(sent, conv.trajectory.calls):
            assert b["messages"] == [dict(m) for m in conv.messages[:a]]
    summary = summarize(samples, wall)
    assert summary["output_tokens"] == sum(b["max_tokens"] for v in bodies.values() for b in v)
    assert summary["requests"] == len(samples) and summary["failed"] == 0


def test_text_methods_send_their_edits_as_text():
    _, _, _, bodies = _run(Summarize(threshold=6000, summary_tokens=200), conversations=2)
    sent = bodies[0]
    summaries = [b for b in sent if b["messages"][-1]["content"].startswith("Summarize the conversation")]
    assert summaries and all(b["max_tokens"] == 200 for b in summaries)
    after = sent[sent.index(summaries[0]) + 1]
    assert after["messages"][2]["content"].startswith("Summary of the work so far:")
    _, _, _, bodies = _run(Trim(keep=2), conversations=1)
    last = bodies[0][-1]["messages"]
    tools = [m for m in last if m["role"] == "tool"]
    assert [m["content"] == PLACEHOLDER for m in tools].count(False) == 2
    assert all(m["content"] == PLACEHOLDER for m in tools[:-2])


def test_akv_sends_the_fields_akv_agent_decides():
    convs, _, _, bodies = _run(AKV(reference_policy(3)), conversations=2)
    policy = CachePolicy(selector=ResultSelection(3), reposition=TurnReposition())
    for conv in convs:
        history = None
        for body, a in zip(bodies[conv.index], conv.trajectory.calls):
            expected, history = policy.process({"model": "replay", "messages": list(conv.messages[:a])}, history)
            assert body.get("drop_message") == expected.get("drop_message")
            assert body.get("reposition") == expected.get("reposition")
    assert any("drop_message" in b for b in bodies[0])


def test_a_failed_request_ends_its_conversation():
    convs = prepare(_trajectory(1), FullContext(), [0], FILLER)
    calls = []

    def send(url, body, timeout):
        from akv.agent import HTTPStatusError

        calls.append(body)
        raise HTTPStatusError("HTTP 400: context too long", status=400, body="")

    samples, _ = replay("http://unused", convs, 1, "m", FILLER, send=send)
    assert len(calls) == 1 and len(samples) == 1 and "context too long" in samples[0].error
    assert summarize(samples, 1.0)["failed"] == 1


def test_percentile_interpolates():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 95) == 1.95
    assert percentile([], 50) is None


def test_cli_sweep_writes_json_and_markdown(tmp_path: Path):
    out = tmp_path / "replay.json"
    argv = ["--loopback", "--count", "1", "--max-turns", "5", "--concurrency", "1,2",
            "--methods", "full,trim,akv_keep12", "--samples", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python bench/serve_replay.py " + " ".join(argv)
    assert [(r["method"], r["concurrency"]) for r in result["rows"]] == [
        (m, c) for m in ("full", "trim", "akv_keep12") for c in (1, 2)]
    for row in result["rows"]:
        assert row["failed"] == 0 and row["flushed"] is True
        assert row["requests"] == 5 * row["conversations"] and row["output_tok_per_s"] > 0
        assert row["latency_p95_s"] >= row["latency_p50_s"]
    assert len(result["samples"]["full@2"]) == 10
    table = out.with_suffix(".md").read_text()
    assert table.count("| akv_keep12 |") == 2 and "P95 latency s" in table


def test_start_turn_skips_earlier_requests_and_keeps_akv_decisions():
    t = _trajectory(1, turns=9)
    whole = prepare(t, AKV(reference_policy(3)), [0], FILLER)[0].requests
    deep = prepare(t, AKV(reference_policy(3)), [0], FILLER, start_turn=5)[0].requests
    assert deep == tuple(r for r in whole if r.turn >= 5) and deep[0].turn == 5
    assert deep[0].drop_message  # the cumulative fields carry the decisions of turns not sent


def test_no_request_starts_after_run_seconds():
    convs = prepare(_trajectory(1), FullContext(), [0, 1], FILLER)
    sent = []
    samples, _ = replay("http://unused", convs, 2, "m", FILLER, send=lambda *a: sent.append(a), run_seconds=0)
    assert samples == [] and sent == []


def test_tags_make_every_conversation_of_every_run_distinct_and_are_counted(tiny_counter):
    filler = Filler.for_tokenizer(tiny_counter.tokenizer)
    t = generate(BROWSE, 3, "t3", turns=4)
    t = Trajectory(t.name, t.specs, t.generation_tokens, tuple(realize(t, tiny_counter, filler)))
    convs = [c for run in ("a", "b") for c in prepare(t, FullContext(), [0, 1, 2], filler, run=run)]
    assert len({c.messages[0]["content"] for c in convs}) == 6
    for c in convs:
        assert c.messages[0]["content"].endswith(t.messages[0]["content"])
        spans = tiny_counter.layout(list(c.messages)).spans
        assert [end - start for start, end in spans] == [s.tokens for s in c.trajectory.specs]
        assert c.trajectory.specs[0].tokens == t.specs[0].tokens + TAG_UNITS
        assert sum(p.tokens for p in c.requests[0].pieces) == sum(s.tokens for s in c.trajectory.specs[:t.calls[0]])


def test_cli_caps_output_lengths_and_sets_thresholds(tmp_path: Path):
    out = tmp_path / "replay.json"
    argv = ["--loopback", "--preset", "tiny", "--count", "1", "--concurrency", "1", "--methods", "full,standard,trim",
            "--standard-threshold", "300", "--keep", "1", "--max-output-tokens", "3", "--samples", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert all(s["completion_tokens"] <= 3 for v in result["samples"].values() for s in v)
    kinds = {s["kind"] for s in result["samples"]["standard@1"]}
    assert kinds == {"turn", "summary"}


def test_pool_gauges_are_read_from_prometheus_text():
    text = "\n".join(["# HELP sglang:token_usage The token usage.", "# TYPE sglang:token_usage gauge",
                      'sglang:token_usage{model_name="default",engine_type="unified"} 0.25',
                      'sglang:num_used_tokens{model_name="default"} 4096.0', "sglang:max_total_num_tokens 16384",
                      'sglang:gen_throughput{model_name="default"} 7.5', "sglang:token_usage_other 3"])
    assert parse_gauges(text) == {"token_usage": 0.25, "used_tokens": 4096.0, "pool_tokens": 16384.0}


def test_priming_sends_each_first_request_before_the_measured_run():
    convs = [c for k in range(3) for c in prepare(_trajectory(k + 1), FullContext(), [k], FILLER)]
    state = loopback.Loopback()
    with loopback.serve(state) as url:
        samples, _ = replay(url, convs, 3, "m", FILLER, timeout_s=30, prime=True)
    firsts = {c.messages[0]["content"]: len(c.requests[0].pieces) for c in convs}
    primed = sorted((b["messages"][0]["content"], len(b["messages"])) for b in state.requests[:3])
    assert primed == sorted(firsts.items())
    assert len(state.requests) == sum(len(c.requests) for c in convs)
    assert len(samples) == len(state.requests) - 3 and all(s.start_s >= 0 for s in samples)
    assert {(s.conversation, s.turn) for s in samples} == {(c.index, r.turn) for c in convs for r in c.requests[1:]}
    with pytest.raises(ValueError, match="more than the concurrency 2"):
        replay(url, convs, 2, "m", FILLER, prime=True)


def test_method_lists_name_methods_or_none():
    from bench.serve_replay import choose_methods, parse_args

    args = parse_args(["--url", "http://127.0.0.1:1", "--model-path", "unused", "--out", "unused.json"])
    assert [m.name for m in choose_methods("standard, akv_keep12", args)] == ["standard", "akv_keep12"]
    assert choose_methods("none", args) == []
    with pytest.raises(SystemExit, match="unknown"):
        choose_methods("standrd", args)
