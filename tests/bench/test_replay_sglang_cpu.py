"""The serving replay against real SGLang on the CPU (tiny random Qwen3): text methods on stock
SGLang 0.5.16, AKV on the patched server, through the replay's own client; every request's
served usage equals the simulator's counts for the token ids the server was sent (one simulator
per server, so the template scaffolding that all conversations share is counted on both sides).
Then bench/replay_suite.py's CPU dry run end to end on the same two servers: the suite's own
``make_model``, ``make_sites`` and ``make_servers`` made them, and one start of each serves both
tests (each start costs tens of seconds on the CPU)."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from akv.agent.tokens import ChatTemplateTokenCounter
from bench import replay_suite
from bench.agent_replay.chat import Filler, realize
from bench.agent_replay.methods import AKV, FullContext, Summarize, Trim, reference_policy
from bench.agent_replay.serve import payload, prepare, replay
from bench.agent_replay.simulator import Simulator
from bench.agent_replay.trajectories import TINY, from_messages, generate
from bench.harness import client
from bench.harness.servers import Server

pytestmark = pytest.mark.slow
STOCK = [FullContext(), Summarize(900, summary_tokens=60, name="standard"),
         Summarize(500, summary_tokens=60, name="text_engineering"), Trim(2)]
PATCHED = [AKV(reference_policy(2, 600), name="akv_keep2"), AKV(reference_policy(2), name="akv_keep2_every_turn")]


@dataclasses.dataclass(frozen=True)
class Servers:
    """The replay suite's dry-run servers, running, and the suite arguments that made them."""

    argv: list[str]
    model: Path
    out: Path
    running: dict[str, Server]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Stock and patched CPU servers as the suite's dry run makes them (pinned wheel, tiny model,
    logs under ``--out``), with a pool no request sequence here fills (no eviction on either side),
    started side by side."""
    root = tmp_path_factory.mktemp("replay-sglang-cpu")
    argv = ["--dry-run", "--work", str(root / "work"), "--out", str(root / "out"), "--pool-tokens", "65536"]
    args = replay_suite.parse_args(argv)
    replay_suite.make_model(args)
    replay_suite.make_sites(args)
    started = replay_suite.make_servers(args)
    try:
        for server in started:
            server.start()
        for server in started:
            server.wait(600)
        yield Servers(argv, args.model, args.out, {server.name: server for server in started})
    finally:
        for server in started:
            server.stop()


def test_served_usage_equals_the_simulators_counts_on_stock_and_patched_sglang(servers: Servers) -> None:
    counter = ChatTemplateTokenCounter.from_pretrained(str(servers.model))
    filler = Filler.for_tokenizer(counter.tokenizer)
    synthetic = generate(TINY, 5, "tiny-5")
    trajectory = from_messages("tiny-5", realize(synthetic, counter, filler), counter, {a: 1 for a in synthetic.calls})
    for name, methods in (("stock", STOCK), ("patched", PATCHED)):
        url = servers.running[name].url
        assert client.flush_cache(url) == 200  # the simulator starts from an empty cache, as the server does
        sim = Simulator()
        for method in methods:
            conversation = prepare(trajectory, method, [0], filler, run=f"{name}/{method.name}")[0]
            conversation = dataclasses.replace(conversation, requests=tuple(
                dataclasses.replace(r, generated=1) for r in conversation.requests))
            samples, _ = replay(url, [conversation], 1, "default", filler, timeout_s=300)
            assert [s.error for s in samples] == [None] * len(conversation.requests), method.name
            for sample, request in zip(samples, conversation.requests, strict=True):
                rendered = counter.render(payload(conversation, request, "default", filler)["messages"])
                pieces = tuple(dataclasses.replace(p, tokens=end - start)
                               for p, (start, end) in zip(request.pieces, rendered.layout.spans, strict=True))
                row = sim.run(dataclasses.replace(request, pieces=pieces), rendered.layout.generation_tokens,
                              token_ids=rendered.token_ids)
                assert (sample.prompt_tokens, sample.cached_tokens or 0, sample.repos_tokens or 0,
                        sample.drop_skipped_tokens or 0) == (row.prompt, row.cached, row.repos, row.skipped), \
                    (name, method.name, request.turn, request.kind)
            if isinstance(method, AKV):
                assert sum(s.repos_tokens or 0 for s in samples) > 0 and sum(s.drop_skipped_tokens or 0
                                                                             for s in samples) > 0
            else:
                assert all(s.drop_skipped_tokens is None for s in samples)  # stock reports no AKV usage


def test_dry_run_serves_text_methods_on_stock_and_akv_on_the_patched_server(servers: Servers) -> None:
    """The suite's --dry-run end to end on CPU, on the servers it made (attached: it neither starts nor
    stops them): trim runs on stock SGLang (plain requests: no AKV usage), AKV on the patched server (its
    usage shows the drops), each measured from its second request (primed), and the files are written."""
    argv = [*servers.argv, "--concurrency", "1", "--stock-methods", "trim", "--akv-methods", "akv_keep12",
            "--target-s", "600", "--deadline-s", "900"]
    assert replay_suite.main(argv, attached=servers.running) == 0
    out = servers.out
    result = json.loads((out / "replay_suite.json").read_text())
    assert {"command", "commit", "date", "machine"} <= set(result)  # bench/harness/results.py's header
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"trim", "akv_keep12"} and all(r["failed"] == 0 and r["requests"] == 3 for r in rows.values())
    assert rows["trim"]["server"] == "stock" and not rows["trim"]["server_reported_akv_usage"]
    assert rows["akv_keep12"]["server"] == "patched" and rows["akv_keep12"]["drop_skipped_tokens"] > 0
    assert [q["method"] for q in result["ratios"]] == []  # no Standard row to compare with
    assert {p.name for p in out.iterdir()} >= {"replay_suite.json", "replay_suite.md", "replay_suite.svg",
                                               "server-stock.log", "server-patched.log"}
    for name, server in servers.running.items():  # attached: warmed up, reported as such, left running
        assert result["servers"][name]["attached"] and result["servers"][name]["warmup"]["error"] is None, name
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as response:
            assert response.status == 200, name


def test_router_dry_run_pins_conversations_with_affinity_and_spreads_them_with_round_robin(servers: Servers) -> None:
    """Router mode's --dry-run (two workers: the module's patched server, attached, and one the suite
    starts) with akv_keep12 at concurrency 1 through smg with affinity, then round-robin: the workers' own
    request counters show the affinity run's conversation on one worker and the round-robin run's on both;
    the AKV fields pass through smg (the served usage shows drops), and affinity reads more of each prompt
    from the cache (round-robin's worker holds the conversation as of two turns before)."""
    out = servers.out.parent / "router-out"
    argv = [*servers.argv, "--out", str(out), "--router", "affinity,round_robin", "--concurrency", "1",
            "--akv-methods", "akv_keep12", "--target-s", "600", "--deadline-s", "900"]
    assert replay_suite.main(argv, attached={"worker-0": servers.running["patched"]}) == 0
    result = json.loads((out / "replay_suite.json").read_text())
    rows = {r["router"]: r for r in result["rows"]}
    assert set(rows) == {"affinity", "round_robin"}
    assert all(r["method"] == "akv_keep12" and r["failed"] == 0 and r["requests"] == 3 for r in rows.values())
    assert [n > 0 for n in rows["affinity"]["worker_requests"]].count(True) == 1, rows["affinity"]["worker_requests"]
    assert all(n > 0 for n in rows["round_robin"]["worker_requests"]), rows["round_robin"]["worker_requests"]
    assert rows["affinity"]["drop_skipped_tokens"] > 0 and rows["affinity"]["server_reported_akv_usage"]
    assert rows["affinity"]["prompt_tokens"] == rows["round_robin"]["prompt_tokens"]  # the same requests
    assert rows["affinity"]["cached_tokens"] > rows["round_robin"]["cached_tokens"]
    assert {"worker-1", "router-affinity", "router-round_robin"} <= set(result["servers"])
    with urllib.request.urlopen(f"{servers.running['patched'].url}/health", timeout=10) as response:
        assert response.status == 200  # attached: left running
