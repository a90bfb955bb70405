"""The serving replay's plot: a run that did not happen is a gap, not a zero."""

from __future__ import annotations

import re

from bench.agent_replay import plots
from bench.agent_replay.suite_report import svg


def _row(method: str, concurrency: int, tok_s: float, p95: float) -> dict:
    return {"method": method, "concurrency": concurrency, "output_tok_per_s": tok_s, "latency_p95_s": p95}


def test_a_missing_run_draws_no_point_on_the_baseline() -> None:
    rows = [_row("akv", 4, 200.0, 3.0), _row("akv", 16, 300.0, 8.0), _row("standard", 4, 160.0, 4.0)]
    out = svg(rows, [4, 16])
    baseline = plots.TOP + plots.H - plots.TOP - plots.BOTTOM  # y of 0 in the first panel
    ys = [float(y) for y in re.findall(r'[ ,"](?:cy=")?[\d.]+,([\d.]+)', out)]
    ys += [float(y) for y in re.findall(r'cy="([\d.]+)"', out)]
    assert ys and all(abs(y - baseline) > 1e-6 for y in ys if y <= plots.H)
    # standard has one point per panel (a dot), akv a line in each
    assert out.count("<circle") == 2 and out.count("<polyline") == 2


def test_runs_split_at_gaps() -> None:
    assert plots._runs([1.0, None, 2.0, 3.0, None]) == [[(0, 1.0)], [(2, 2.0), (3, 3.0)]]
    assert plots._runs([None, None]) == []
