"""The replay suite: AKV vs Standard (against the goals) and vs Text Engineering ratios at equal
concurrency, --merge of runs from one machine, each method's
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


def test_ratios_against_text_engineering_and_their_table():
    rows = [*ROWS, _row("text_engineering", 16, 300.0, 16.0)]
    got = report.ratios(rows, against="text_engineering")
    assert [(q["concurrency"], q["output_tok_per_s"], q["latency_p95_s"]) for q in got] == [(16, 0.8, 0.5)]
    result = {"command": "c", "label": "test", "rows": rows, "ratios": report.ratios(rows),
              "ratios_text_engineering": got}
    text = report.markdown(result)
    assert "AKV vs Text Engineering" in text
    assert "| akv_keep12 | 16 | 0.80x | 0.80x | 0.50x | 0.50x | 1.00x | 1.00x |" in text


def _run(tmp_path, name, rows, gpu="GPU 0: NVIDIA H100 80GB HBM3", commit="abc", notes=()):
    import json

    path = tmp_path / name
    path.write_text(json.dumps({"command": "python bench/replay_suite.py", "commit": commit, "date": "d",
                                "machine": {"gpus": [gpu]}, "label": f"label {name}", "rows": rows,
                                "notes": list(notes), "knobs": {}}))
    return path


def test_merge_joins_runs_of_one_machine_and_keeps_the_later_point(tmp_path):
    from bench import replay_suite

    first = _run(tmp_path, "a.json", [_row("akv_keep12", 8, 240.0, 5.0, "patched"), _row("standard", 8, 30.0, 30.0),
                                      {**_row("text_engineering", 8, 0.0, 1.0), "requests": 0}],
                 notes=["stock: text_engineering c=8 skipped"])
    second = _run(tmp_path, "b.json", [_row("standard", 8, 40.0, 20.0), _row("text_engineering", 8, 200.0, 8.0)])
    assert replay_suite.main(["--merge", str(first), str(second), "--out", str(tmp_path / "out")]) == 0
    import json

    got = json.loads((tmp_path / "out" / "replay_suite.json").read_text())
    by = {(r["method"], r["concurrency"]): r for r in got["rows"]}
    assert len(got["rows"]) == 3 and by[("standard", 8)]["output_tok_per_s"] == 40.0
    assert by[("text_engineering", 8)]["output_tok_per_s"] == 200.0
    assert [q["output_tok_per_s"] for q in got["ratios"]] == [6.0]
    assert [q["output_tok_per_s"] for q in got["ratios_text_engineering"]] == [1.2]
    assert any("standard c=8 measured again in run 2: 30.0 then 40.0" in n for n in got["notes"])
    assert not any("text_engineering c=8 measured again" in n for n in got["notes"])  # run 1 had no requests there


def test_merge_refuses_runs_of_different_gpus(tmp_path, capsys):
    from bench import replay_suite

    first = _run(tmp_path, "a.json", [_row("standard", 8, 30.0, 30.0)])
    second = _run(tmp_path, "b.json", [_row("standard", 8, 40.0, 20.0)], gpu="GPU 0: NVIDIA H200")
    assert replay_suite.main(["--merge", str(first), str(second), "--out", str(tmp_path / "out")]) == 2
    assert "b.json has machine" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_point_with_under_two_requests_per_conversation_is_flagged():
    rows = [{**_row("standard", 16, 28.0, 72.0), "requests": 16, "conversations": 16},
            {**_row("akv_keep12", 4, 188.0, 3.6, "patched"), "requests": 46, "conversations": 4}]
    text = report.markdown({"command": "c", "label": "t", "rows": rows, "ratios": report.ratios(rows)})
    assert "- standard c=16: 16 requests for 16 conversations: the first turns after priming" in text
    assert "akv_keep12 c=4: 46" not in text


def test_router_ratios_compare_affinity_with_round_robin_at_equal_concurrency():
    rows = [_row("akv_keep12", 16, 120.0, 10.0, "router-affinity", router="affinity", cached_fraction=0.9,
                 read_fraction=0.8),
            _row("akv_keep12", 16, 100.0, 25.0, "router-round_robin", router="round_robin", cached_fraction=0.3,
                 read_fraction=0.4),
            _row("akv_keep12", 4, 50.0, 2.0, "router-affinity", router="affinity", cached_fraction=0.9,
                 read_fraction=0.9)]
    got = report.router_ratios(rows)
    assert [(q["concurrency"], q["cached_fraction"], q["read_fraction"], q["output_tok_per_s"], q["latency_p95_s"])
            for q in got] == [(16, 3.0, 2.0, 1.2, 2.5)]  # no round-robin row at 4
    assert got[0]["meets_read_goal"] and got[0]["meets_p95_goal"]
    text = report.markdown({"command": "c", "label": "l", "rows": rows, "ratios": [], "router_ratios": got})
    assert "| akv_keep12 | 16 | 3.00x | 2.00x | 1.20x | 2.50x | 2.50x | 1.00x | met | met |" in text
    assert "AKV vs Standard" not in text  # router mode runs no Standard
    slower = [{**rows[0], "latency_p95_s": 30.0, "read_fraction": 0.7}, rows[1]]
    assert [(q["meets_read_goal"], q["meets_p95_goal"]) for q in report.router_ratios(slower)] == [(False, False)]


def test_router_mode_starts_workers_and_one_router_per_policy(tmp_path, monkeypatch):
    """``--router affinity,round_robin``: --workers patched workers with the patched server's flags, smg
    with affinity through akv.system.launch_router (which adds sticky routing keys) and round-robin as
    smg itself, without sticky keys; an unknown policy is refused naming it."""
    import pytest

    from bench import replay_suite

    monkeypatch.delenv("AKV_REPLAY_ROUTER", raising=False)
    args = replay_suite.parse_args(["--dry-run", "--out", str(tmp_path / "o"), "--router", "affinity,round_robin",
                                    "--workers", "3"])
    workers = replay_suite.make_workers(args)
    patched = replay_suite.make_servers(args)[1]
    assert [w.name for w in workers] == ["worker-0", "worker-1", "worker-2"]
    assert all(w.argv == patched.argv for w in workers) and len({w.port for w in workers}) == 3
    affinity, round_robin = (replay_suite.make_router(args, p, workers) for p in args.routers)
    assert affinity.argv[1:3] == ["-m", "akv.system.launch_router"] and "--policy" not in affinity.argv
    assert round_robin.argv[1:6] == ["-m", "smg", "launch", "--policy", "round_robin"]
    assert "--routing-key-override" not in round_robin.argv
    for router in (affinity, round_robin):
        urls = router.argv[router.argv.index("--worker-urls") + 1:][:3]
        assert urls == [w.url for w in workers]
    with pytest.raises(SystemExit):
        replay_suite.parse_args(["--dry-run", "--out", str(tmp_path / "p"), "--router", "cache_aware"])
