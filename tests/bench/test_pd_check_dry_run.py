"""bench/pd_check.py's CPU dry run end to end (slow): the single patched server, then the PD pair over
Mooncake TCP (tests/sglang_cpu/mooncake_cpu.py prepares the engine; where it cannot, the test skips and
names the failed step), the record-chain matrix and the CPU pair test's turns through the pair. In FP32
every decoded token and every usage count must be the single server's, both PD servers alive with no
token held after the flush, and the expected live-KV bytes the model's K and V per kept token."""

from __future__ import annotations

import json

import pytest

from bench import pd_check


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("pd-check")
    rc = pd_check.main(["--dry-run", "--work", str(root / "work"), "--out", str(root / "out")])
    found = json.loads((root / "out" / "pd_check.json").read_text())
    engine = [f for f in found["failures"] if "mooncake_cpu.prepare" in f]
    if engine:
        pytest.skip(f"Mooncake's transfer engine cannot run here: {engine[0]}")
    assert rc == (0 if found["ok"] else 1)
    return found


@pytest.mark.slow
def test_dry_run_pd_pair_equals_the_single_server_and_leaks_nothing(report: dict) -> None:
    assert {"command", "commit", "date", "machine"} <= set(report)
    assert report["failures"] == [], report["failures"]
    names = [name for name, _ in pd_check.matrix(dry_run=True) if not name.endswith("-streamed")]
    assert sorted(report["rows"]) == sorted(names)
    for name, row in report["rows"].items():
        assert row["agree"] == row["n"] == 8, (name, row)  # FP32: every token as the single server's
        assert row["usage"]["prompt_tokens"] == row["reference_usage"]["prompt_tokens"], name
        assert row["usage"].get("prompt_tokens_details") == row["reference_usage"].get("prompt_tokens_details"), name
    details = report["rows"]["context-pair-drop-and-repos-again"]["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > 0, "the repeat reuses the prefill server's cache"
    for name in ("prefill", "decode"):
        after = report["after"][name]
        assert after["alive"] and after["used"] == 0 and after["running"] == after["waiting"] == 0, after


@pytest.mark.slow
def test_dry_run_prints_the_live_kv_of_every_request(report: dict) -> None:
    config = report["model"]["config"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4  # FP32
    assert report["kv_bytes_per_token"] == per_token
    for name, row in report["transfers"].items():
        usage = report["rows"][name]["usage"]
        skipped = (usage.get("prompt_tokens_details") or {}).get("drop_skipped_tokens") or 0
        assert row["expected_live_kv_bytes"] == (usage["prompt_tokens"] - skipped) * per_token, name
        assert row["sent_bytes"] is None  # not counted by SGLang or Mooncake: the note says so
    dropped = report["transfers"]["context-pair-drop-only"]["kept_tokens"]
    assert dropped < report["rows"]["context-pair-drop-only"]["usage"]["prompt_tokens"]
    assert "not counted" in report["sent_bytes_note"]
