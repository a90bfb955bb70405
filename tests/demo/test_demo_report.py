"""The demo's summary table and plot on hand-made step records (no server)."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from akv_demo.plot import nice_ticks, write_svg  # noqa: E402
from akv_demo.report import StepRecord, column_meanings, summary_table  # noqa: E402

# (step, messages, prompt, cached, re-rotated, hidden by a drop, computed):
# prompt = cached + re-rotated + computed + dropped unread
ROWS = [(1, 4, 900, 0, 0, 0, 900), (2, 6, 1400, 850, 0, 0, 550), (3, 8, 1900, 600, 700, 450, 300),
        (4, 10, 2400, 900, 1000, 900, 100)]


def records() -> list[StepRecord]:
    return [StepRecord(step, msgs, prompt, cached, repos, hidden, computed, 20, 0.5 + step, step - 1, step // 3,
                       "read_record")
            for step, msgs, prompt, cached, repos, hidden, computed in ROWS]


def test_computed_unread_and_hidden_are_separate_columns_each_explained() -> None:
    table = summary_table(records())
    header = table.splitlines()[0].split()
    assert header[:8] == ["step", "msgs", "sent", "cached", "re-rot", "computed", "unread", "hidden"]
    row3 = table.splitlines()[4].split()
    assert row3[:8] == ["3", "8", "1900", "600", "700", "300", "300", "450"]  # unread = 1900 - 600 - 700 - 300
    meanings = dict(line.split(None, 1) for line in column_meanings().splitlines())
    assert set(header) == set(meanings)
    assert "drop_skipped_tokens" in meanings["hidden"] and "computed_tokens" in meanings["computed"]


def test_a_plain_usage_without_computed_tokens_computed_what_it_did_not_read() -> None:
    usage = {"prompt_tokens": 120, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 80}}
    record = StepRecord.from_usage(1, 4, usage, 0.1, 0, 0, "plain")
    assert (record.computed_tokens, record.unread_tokens) == (40, 0)


def svg_root(tmp_path: Path):
    return ET.parse(write_svg(records(), tmp_path / "plot.svg", "demo")).getroot()


def texts(root) -> list[tuple[float, float, str, str]]:
    return [(float(e.get("x")), float(e.get("y")), e.get("text-anchor", "start"), e.text or "")
            for e in root.iter() if e.tag.endswith("text") and e.get("transform") is None]


def test_both_axes_carry_tick_values(tmp_path: Path) -> None:
    found = texts(svg_root(tmp_path))
    left = {t for x, _, anchor, t in found if anchor == "end"}
    right = {t for x, _, anchor, t in found if x > 600 and re.fullmatch(r"[\d.]+", t)}
    assert {"0", "500", "1k", "1.5k", "2k", "2.5k"} <= left  # tokens: the largest prompt is 2,400
    assert {"0", "1", "2", "3", "4", "5"} <= right  # seconds: the largest latency is 4.5


def test_the_legend_labels_do_not_overlap(tmp_path: Path) -> None:
    root = svg_root(tmp_path)
    swatches = [(float(e.get("x")), float(e.get("y"))) for e in root.iter()
                if e.tag.endswith("rect") and e.get("width") == "10"]
    labels = [(x, y, t) for x, y, _, t in texts(root) if any(abs(x - sx - 14) < 0.2 for sx, _ in swatches)]
    assert [t for *_, t in labels][-1] == "latency" and len(labels) == 6
    for (x1, y1, t1), (x2, y2, _) in zip(labels, labels[1:]):
        assert y2 > y1 or x2 - 14 >= x1 + 6.5 * len(t1), (t1, x1, x2)  # 6.5 px per character is generous
    assert all(x + 6.5 * len(t) <= 760 for x, _, t in labels)


def test_computed_and_dropped_unread_are_bars_of_their_own(tmp_path: Path) -> None:
    titles = [e.text for e in svg_root(tmp_path).iter() if e.tag.endswith("title")]
    assert "step 3 hidden by a drop (overlaps the stack): 450" in titles
    assert "step 3 computed: 300" in titles and "step 3 dropped unread: 300" in titles


@pytest.mark.parametrize("top", [0.3, 1, 4.5, 7, 99, 2400, 3301, 123456])
def test_nice_ticks_cover_the_top_with_round_steps(top: float) -> None:
    ticks = nice_ticks(top)
    step = ticks[1] - ticks[0]
    assert ticks[0] == 0 and ticks[-1] >= top > ticks[-2] and 3 <= len(ticks) - 1 <= 5
    mantissa = step / 10 ** int(f"{step:e}".split("e")[1])
    assert round(mantissa, 6) in (1, 2, 2.5, 5)
