"""`bench/simulate.py` writes the JSON (exact command, totals that are the sums of the per-call
columns, savings against Standard), the markdown table and both SVG plots; with ``--concurrency``
a row per method and level."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench.agent_replay.simulator import PriceTable
from bench.agent_replay.trajectories import SWE, generate, to_jsonl
from bench.simulate import main


def test_cli_outputs(tmp_path: Path):
    source = tmp_path / "t.jsonl"
    to_jsonl([generate(SWE, 1, "a", turns=30), generate(SWE, 2, "b", turns=20)], source)
    out = tmp_path / "sim.json"
    argv = ["--trajectories", str(source), "--standard-threshold", "20000", "--te-threshold", "10000",
            "--summary-tokens", "500", "--trim-keep", "4", "--akv-keep", "4", "--akv-reposition-tokens", "15000",
            "--price-input", "3", "--price-cached", "0.3", "--price-output", "15", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python bench/simulate.py " + " ".join(argv)
    names = ["full", "standard", "text_engineering", "trim", "akv_keep4", "akv_keep4_every_turn"]
    assert result["methods"] == names
    prices = PriceTable(3, 0.3, 15)
    per_call = json.loads(out.with_suffix(".calls.json").read_text())
    assert per_call["command"] == result["command"]
    for name in names:
        columns = [per_call["per_call"][t][name] for t in ("a", "b")]
        total = result["totals"][name]
        for key in ("prefilled", "cached", "repos", "skipped", "generated"):
            assert total[key] == sum(sum(c[key]) for c in columns)
        assert total["cost"] == pytest.approx(prices.cost(total["prefilled"], total["cached"] + total["repos"],
                                                          total["generated"]))
        base = result["totals"]["standard"]["cost"]
        assert total["saving_vs_standard"] == pytest.approx(1 - total["cost"] / base)
    assert result["totals"]["standard"]["summary_calls"] >= 2
    table = out.with_suffix(".md").read_text()
    assert all(f"| {name} |" in table for name in names)
    for suffix in (".calls.svg", ".totals.svg"):
        assert ET.fromstring(out.with_suffix(suffix).read_text()).tag.endswith("svg")


def test_concurrency_mode_writes_a_row_per_method_and_level(tmp_path):
    out = tmp_path / "shared.json"
    argv = ["--preset", "tiny", "--count", "2", "--start-turn", "1", "--pool-slots", "200000", "--concurrency", "1", "2",
            "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "shared" and result["in_place"] and result["pool_slots"] == 200000
    names = ["full", "standard", "text_engineering", "trim", "akv_keep12", "akv_keep12_every_turn", "akv_live_budget"]
    assert [(r["method"], r["concurrency"]) for r in result["rows"]] == [(n, c) for c in (1, 2) for n in names]
    for r in result["rows"]:  # every counted prompt token was prefilled, read or skipped by a drop
        assert r["prefilled"] + r["cached"] + r["repos"] <= r["prompt"] and r["waits"] == 0 and r["refused"] == []
    table = out.with_suffix(".md").read_text()
    assert all(f"| {n} | 2 |" in table for n in names)


@pytest.mark.parametrize("argv, says", [
    (["--methods", "akv_keep9"], "--methods: 'akv_keep9' is not one of full, standard"),
    (["--methods", "akv_live_budget"], "--methods: 'akv_live_budget' is not one of"),  # a --concurrency method only
    (["--concurrency", "4", "0"], "--concurrency: 0 is less than 1"),
    (["--start-turn", "-1"], "--start-turn: -1 is less than 0"),
])
def test_bad_arguments_are_refused_naming_the_flag(tmp_path, capsys, argv, says):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path / "x.json")])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_methods_keeps_only_the_named_ones(tmp_path):
    out = tmp_path / "shared.json"
    assert main(["--preset", "tiny", "--count", "1", "--concurrency", "1", "--methods", "standard", "akv_live_budget",
                 "--out", str(out)]) == 0
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["standard", "akv_live_budget"]
