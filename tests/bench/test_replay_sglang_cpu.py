"""The serving replay against real SGLang on the CPU (tiny random Qwen3): text methods on stock
SGLang 0.5.16, AKV on the patched server, through the replay's own client; every request's
served usage equals the simulator's counts for the token ids the server was sent (one simulator
per server, so the template scaffolding that all conversations share is counted on both sides)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.agent_replay.chat import Filler, realize
from bench.agent_replay.methods import AKV, FullContext, Summarize, Trim, reference_policy
from bench.agent_replay.serve import payload, prepare, replay
from bench.agent_replay.simulator import Simulator
from bench.agent_replay.trajectories import TINY, from_messages, generate

from bench.replay_suite import CPU_FLAGS
from bench.harness.servers import Server, free_port_pair

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow
STOCK = [FullContext(), Summarize(900, summary_tokens=60, name="standard"),
         Summarize(500, summary_tokens=60, name="text_engineering"), Trim(2)]
PATCHED = [AKV(reference_policy(2, 600), name="akv_keep2"), AKV(reference_policy(2), name="akv_keep2_every_turn")]


@pytest.fixture(scope="module")
def servers(stock_site: Path, patched_site: Path, tiny_model_dir: Path, tmp_path_factory) -> Iterator[dict[str, str]]:
    logs = tmp_path_factory.mktemp("replay-sglang-cpu")
    cpu_site = str(ROOT / "tests" / "sglang_cpu" / "site")
    flags = [*CPU_FLAGS, "--attention-backend", "triton"]
    flags[flags.index("--max-total-tokens") + 1] = "65536"  # no eviction on either side
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    model = ["--model-path", str(tiny_model_dir)]
    port = free_port_pair()
    started = [Server("stock", [sys.executable, "-m", "sglang.launch_server", *model, *flags],
                      {**base, "PYTHONPATH": os.pathsep.join([cpu_site, str(stock_site)])}, port, logs / "stock.log"),
               Server("patched", [sys.executable, "-m", "akv.system.launch_server", *model, *flags],
                      {**base, "PYTHONPATH": os.pathsep.join([cpu_site, str(patched_site), str(ROOT)])}, port + 1,
                      logs / "patched.log")]
    try:
        for server in started:
            server.start()
        for server in started:
            server.wait(600)
        yield {s.name: s.url for s in started}
    finally:
        for server in started:
            server.stop()


def test_served_usage_equals_the_simulators_counts_on_stock_and_patched_sglang(servers, tiny_counter):
    filler = Filler.for_tokenizer(tiny_counter.tokenizer)
    synthetic = generate(TINY, 5, "tiny-5")
    trajectory = from_messages("tiny-5", realize(synthetic, tiny_counter, filler), tiny_counter,
                               {a: 1 for a in synthetic.calls})
    for name, methods in (("stock", STOCK), ("patched", PATCHED)):
        sim = Simulator()
        for method in methods:
            conversation = prepare(trajectory, method, [0], filler, run=f"{name}/{method.name}")[0]
            conversation = dataclasses.replace(conversation, requests=tuple(
                dataclasses.replace(r, generated=1) for r in conversation.requests))
            samples, _ = replay(servers[name], [conversation], 1, "default", filler, timeout_s=300)
            assert [s.error for s in samples] == [None] * len(conversation.requests), method.name
            for sample, request in zip(samples, conversation.requests, strict=True):
                rendered = tiny_counter.render(payload(conversation, request, "default", filler)["messages"])
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
