"""bench/akv_soak.py's CPU dry run end to end (slow): agent conversations, branches, retries,
disconnects and bad requests on the patched CPU server with a pool a few times smaller than their
KV; the report shows evictions, no failure, the pool empty after the flush, and every sampled pair
within the bound against the exact reference server. After the flush, the copies wave sends every
lane's last request at once with two more copies of one context lane (three copies of a request
with drops and a reposition in flight on the 768-token pool, under pressure again): every reply
comes, with no failure, and the server is alive at the end. (The stall and out-of-memory abort that
issue #10's earlier dry runs showed with three copies mid-soak have their causes checked directly in
tests/sglang_cpu/test_scheduler.py: ``test_copies_of_a_request_near_the_pool_size_are_served_and_nothing_stalls``
and ``test_rounds_left_count_in_admission``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import akv_soak
from bench.harness import oracle


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    root = tmp_path_factory.mktemp("soak")
    rc = akv_soak.main(["--dry-run", "--work", str(root / "work"), "--out", str(root / "out")])
    return rc, json.loads((root / "out" / "akv_soak.json").read_text()), root / "out"


@pytest.mark.slow
def test_dry_run_soak_evicts_stays_exact_and_leaves_the_pool_empty(dry_run: tuple[int, dict, Path]) -> None:
    _, report, out = dry_run
    assert {"command", "commit", "date", "machine"} <= set(report)  # bench/harness/results.py's header
    before_copies = [f for f in report["failures"] if not f.startswith("copies: ")]
    assert before_copies == [], before_copies
    assert len(report["waves"]) == akv_soak.CPU.turns and "traffic_cut" not in report
    pool = report["pool_tokens"]
    evictions = report["evictions"]
    assert evictions["akv_evicted_tokens"] >= 2 * pool and evictions["kv_computed_tokens"] >= 3 * pool, evictions
    traffic = report["traffic"]
    assert traffic["five_xx"] == 0 and traffic["bad_requests"] == 2
    assert traffic["deliberate_disconnects"] == akv_soak.CPU.turns - 1
    assert traffic["drop_skipped_tokens"] > 0 and traffic["repos_tokens"] > 0 and traffic["streamed"] > 0
    reuse = [w["context_sample_reuse"] for w in report["waves"]]
    assert reuse[:2] == [None, None] and all(r["cached_tokens"] > 0 for r in reuse[2:]), reuse
    assert reuse[3]["repos_tokens"] > 0, reuse  # turn 3 repositions: the resident turn-2 KV is re-rotated
    after = report["after"]
    assert after["flush_status"] == 200 and after["pool_empty"], after
    assert after["final"] == {"used": 0, "pool": pool, "kv_available_tokens": pool, "kv_evictable_tokens": 0}
    oracle = report["oracle"]
    assert oracle["failures"] == [] and oracle["pairs"] == 2 * akv_soak.CPU.turns - 2  # no context pair before turn 2
    assert all(r["agree"] == r["n"] for r in oracle["rows"].values())  # FP32: every token as the reference's
    assert any(s["kv_evictable_tokens"] > 0 for s in report["timeline"])
    svg = (out / "akv_soak_pool.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 5


@pytest.mark.slow
def test_dry_run_soak_copies_wave_and_the_end_are_clean(dry_run: tuple[int, dict, Path]) -> None:
    rc, report, _ = dry_run
    assert report["copies"]["failures"] == [] and report["failures"] == [] and report["server_alive_at_end"]
    assert rc == 0 and report["ok"]


def test_lanes_fork_with_the_same_tokens_and_other_drops(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from akv.system.models.tiny import make_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path / "m", weights=False))
    agent = akv_soak.Lane("agent0", tokenizer, 1, "tool")
    for turn in range(3):
        agent.advance(turn, 12)
    branch = agent.fork("branch0", "assistant")
    for turn in range(3, 5):
        agent.advance(turn, 20)
        branch.advance(turn, 20)
    assert agent.messages == branch.messages and len(agent.messages) == 12
    assert agent.drops == {"7": [3], "9": [5], "11": [7]} and agent.repositions == [9]
    assert branch.drops == {"7": [3], "9": [2], "11": [4]} and branch.repositions == [9]
    assert len(tokenizer(agent.messages[-1]["content"]).input_ids) == 20
    assert agent.body(plain=True).keys() == {"messages", "tools"}
    assert agent.body()["drop_message"] == {"7": [3], "9": [5], "11": [7]}


def test_verdict_without_the_same_cache_compares_only_the_residency_free_counts() -> None:
    def row(cached: int, skipped: int) -> dict:
        return {"error": 0.0, "margin_at_split": None, "usage": {"prompt_tokens": 90, "prompt_tokens_details": {
            "cached_tokens": cached, "repos_tokens": 0, "drop_skipped_tokens": skipped}},
            "reference_usage": {"prompt_tokens": 90, "prompt_tokens_details": {
                "cached_tokens": 60, "repos_tokens": 0, "drop_skipped_tokens": 20}}}

    evicted, wrong = {"plain": row(60, 20), "context": row(5, 20)}, {"plain": row(60, 20), "context": row(60, 7)}
    assert oracle.verdict(evicted, same_cache=False)["failures"] == []
    assert len(oracle.verdict(evicted)["failures"]) == 1
    assert len(oracle.verdict(wrong, same_cache=False)["failures"]) == 1
