"""A dependency-free SVG chart: per step, prompt tokens stacked by how the server served them
(cached, re-rotated, new), with the step latency as a line on a second axis."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

from akv_demo.report import StepRecord

_SERIES = (
    ("cached", "cached_tokens", "#4c9f70"),
    ("re-rotated", "repos_tokens", "#3b7dd8"),
    ("new (computed or dropped unread)", "new_tokens", "#e0813a"),
)
_WIDTH, _HEIGHT = 720, 400
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 70, 40, 60


def write_svg(records: Sequence[StepRecord], path: Path, title: str) -> Path:
    """Write the chart to ``path`` (an .svg file) and return it."""
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    max_tokens = max([r.prompt_tokens for r in records] + [1])
    max_latency = max([r.latency_s for r in records] + [1e-9])
    slot = plot_w / max(len(records), 1)
    bar_w = slot * 0.6
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
             f'<text x="{_WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<line x1="{_LEFT}" y1="{_TOP + plot_h}" x2="{_LEFT + plot_w}" y2="{_TOP + plot_h}" stroke="black"/>',
             f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{_TOP + plot_h}" stroke="black"/>',
             f'<text x="15" y="{_TOP + plot_h / 2}" transform="rotate(-90 15 {_TOP + plot_h / 2})" '
             f'text-anchor="middle">prompt tokens (max {max_tokens})</text>',
             f'<text x="{_WIDTH - 15}" y="{_TOP + plot_h / 2}" transform="rotate(90 {_WIDTH - 15} '
             f'{_TOP + plot_h / 2})" text-anchor="middle">latency (max {max_latency:.2f} s)</text>']
    points = []
    for i, record in enumerate(records):
        x = _LEFT + slot * i + (slot - bar_w) / 2
        y = _TOP + plot_h
        values = record.as_dict()
        for name, key, color in _SERIES:
            h = plot_h * values[key] / max_tokens
            if h > 0:
                y -= h
                parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" fill="{color}">'
                             f'<title>step {record.step} {name}: {values[key]}</title></rect>')
        parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{_TOP + plot_h + 15}" '
                     f'text-anchor="middle">{record.step}</text>')
        points.append(f"{x + bar_w / 2:.1f},{_TOP + plot_h * (1 - record.latency_s / max_latency):.1f}")
    if points:
        parts.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="black" stroke-width="2"/>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{_TOP + plot_h + 32}" text-anchor="middle">step</text>')
    for j, (name, _, color) in enumerate([*_SERIES, ("latency", "", "black")]):
        lx = _LEFT + j * 125
        parts.append(f'<rect x="{lx}" y="{_HEIGHT - 18}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{_HEIGHT - 9}">{escape(name)}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path
