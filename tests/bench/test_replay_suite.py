"""The replay suite: AKV vs Standard ratios at equal concurrency against the goals, each method's
best concurrency and the markdown table (hand-worked rows). Its CPU dry run end to end is in
test_replay_sglang_cpu.py, on the servers that module starts for its own test too."""

from __future__ import annotations

from bench.agent_replay import suite_report as report


def _row(method, concurrency, out, p95, server="stock", **extra):
    return {"method": method, "server": server, "concurrency": concurrency, "requests": 10, "failed": 0,
            "output_tok_per_s": out, "input_tok_per_s": out * 100, "latency_p50_s": p95 / 2, "latency_p95_s": p95,
            "ttft_p50_s": 1.0, "ttft_p95_s": 2.0, **extra}


ROWS = [_row("standard", 4, 100.0, 10.0), _row("standard", 16, 200.0, 40.0), _row("trim", 16, 250.0, 30.0),
        _row("akv_keep12", 4, 160.0, 4.0, "patched"), _row("akv_keep12", 16, 240.0, 32.0, "patched"),
        _row("akv_keep12", 1, 50.0, 1.0, "patched")]


def test_ratios_compare_akv_with_standard_at_equal_concurrency():
    got = {q["concurrency"]: q for q in report.ratios(ROWS)}
    assert set(got) == {4, 16}  # no Standard row at concurrency 1
    assert got[4]["output_tok_per_s"] == 1.6 and got[4]["latency_p95_s"] == 2.5
    assert got[4]["meets_output_goal"] and got[4]["meets_p95_goal"]
    assert got[16]["output_tok_per_s"] == 1.2 and got[16]["latency_p95_s"] == 1.25
    assert not got[16]["meets_output_goal"] and not got[16]["meets_p95_goal"]
    assert got[16]["input_tok_per_s"] == 1.2 and got[16]["ttft_p95_s"] == 1.0


def test_best_concurrency_and_markdown():
    assert report.best(ROWS, "akv_keep12")["concurrency"] == 16
    assert report.best(ROWS, "full") is None
    result = {"command": "python bench/replay_suite.py", "label": "test", "rows": ROWS,
              "ratios": report.ratios(ROWS), "best": {m: report.best(ROWS, m) for m in ("standard", "akv_keep12")},
              "notes": ["patched: akv_keep12 c=32 skipped"]}
    text = report.markdown(result)
    assert text.count("| akv_keep12 | patched |") == 3
    assert "| akv_keep12 | 4 | 1.60x | 1.60x | 2.50x | 2.50x | 1.00x | 1.00x | met | met |" in text
    assert "akv_keep12 c=16 240.0 tok/s" in text and "- patched: akv_keep12 c=32 skipped" in text
    assert "AKV server time per context request" not in text  # no row carries the patched server's counters


def test_markdown_shows_the_patched_servers_time_per_context_request():
    timed = _row("akv_keep12", 4, 160.0, 4.0, "patched", akv_context_requests=20, akv_per_request={
        "admission_ms": 12.5, "wait_ms": 3.0, "rounds_ms": 0.0, "forward_ms": 80.25, "copy_ms": 4.0, "host_ms": 1.5,
        "forwards": 1.0, "kernel_first_launches": 0.0})
    result = {"command": "c", "label": "l", "rows": [timed], "ratios": [], "best": {}}
    assert "| akv_keep12 | 4 | 20 | 12.5 | 3.0 | 0.0 | 80.2 | 4.0 | 1.5 | 1.00 |" in report.markdown(result)


def test_protect_live_starts_the_patched_server_with_the_flag(tmp_path, monkeypatch):
    """``AKV_REPLAY_PROTECT_LIVE=1`` (or ``--protect-live``) adds ``--akv-protect-live`` to the patched
    server's command line only; without it neither server gets it."""
    from bench import replay_suite

    for env, flags, wanted in (("", [], False), ("1", [], True), ("", ["--protect-live"], True)):
        monkeypatch.setenv("AKV_REPLAY_PROTECT_LIVE", env)
        stock, patched = replay_suite.make_servers(replay_suite.parse_args(["--dry-run", "--out", str(tmp_path / "o"),
                                                                             *flags]))
        assert ("--akv-protect-live" in patched.argv) == wanted and "--akv-protect-live" not in stock.argv
