"""bench/next_turn.py's CPU dry run end to end (slow): the patched CPU server starts with SGLang's
warm-up (not skipped), which launches AKV's kernels (the first-launch counter is above zero when the
server is ready) so that no context request after it launches a kernel in a new specialization;
every next turn reports, from the server's counters, its admission time and where its prefill's time
went (one forward, its device and host time), and re-rotated and skipped tokens, and the floor and
trimmed-text requests are served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import next_turn


@pytest.mark.slow
def test_dry_run_first_context_request_launches_no_new_kernel(tmp_path: Path) -> None:
    out = tmp_path / "out" / "next_turn.json"
    rc = next_turn.main(["--dry-run", "--work", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and "error" not in report, report.get("error")
    assert {"command", "commit", "date", "machine"} <= set(report)  # bench/harness/results.py's header
    assert report["kernel_first_launches_at_ready"] > 0
    assert set(report["sizes"]["2"]["median_after_first"]) >= {"forward_ms", "host_ms", "wait_ms", "other_ms"}
    rows = report["sizes"]["2"]["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["kernel_first_launches"] == 0, row
        assert row["admission_ms"] > 0, row
        assert row["forwards"] == 1 and row["rounds_ms"] == 0, row  # one-pass prefill: one forward
        assert row["forward_ms"] > 0 and row["host_ms"] > 0 and row["wait_ms"] >= 0, row
        assert row["other_ms"] == pytest.approx(
            1e3 * row["akv_s"] - row["wait_ms"] - row["host_ms"] - row["forward_ms"], abs=1e-2), row
        assert row["akv_usage"]["repos_tokens"] > 0 and row["akv_usage"]["drop_skipped_tokens"] > 0, row
        assert row["live_tokens"] < row["prompt_tokens"], row
        assert min(row["akv_s"], row["floor_s"], row["trimmed_text_s"]) > 0, row
