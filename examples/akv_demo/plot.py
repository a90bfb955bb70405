"""A dependency-free SVG chart: per step, prompt tokens stacked by how the server served them (cached,
re-rotated, computed, dropped unread), the tokens a drop hid as a bar beside them (they overlap the
stack), and the step latency as a line on a second axis; both axes carry tick values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from xml.sax.saxutils import escape

from akv_demo.report import StepRecord

_STACKED = (
    ("cached", "cached_tokens", "#4c9f70"),
    ("re-rotated", "repos_tokens", "#3b7dd8"),
    ("computed", "computed_tokens", "#e0813a"),
    ("dropped unread", "unread_tokens", "#d9c7a7"),
)
_DROPPED = ("hidden by a drop (overlaps the stack)", "drop_skipped_tokens", "#9a9a9a")
_WIDTH, _HEIGHT = 760, 440
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 80, 40, 100
_CHAR_W = 6.5  # width of one 11px sans-serif character, generously


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top`` (about ``count`` intervals)."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [step * i for i in range(math.ceil(top / step - 1e-9) + 1)]


def _label(value: float) -> str:
    return f"{value:g}" if value < 1000 else f"{value / 1000:g}k"


def write_svg(records: Sequence[StepRecord], path: Path, title: str) -> Path:
    """Write the chart to ``path`` (an .svg file) and return it."""
    plot_w, plot_h = _WIDTH - _LEFT - _RIGHT, _HEIGHT - _TOP - _BOTTOM
    token_ticks = nice_ticks(max([r.prompt_tokens for r in records] + [1]))
    latency_ticks = nice_ticks(max([r.latency_s for r in records] + [1e-3]))
    max_tokens, max_latency = token_ticks[-1], latency_ticks[-1]
    base = _TOP + plot_h
    slot = plot_w / max(len(records), 1)
    bar_w, drop_w = slot * 0.45, slot * 0.2
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{_WIDTH}" height="{_HEIGHT}" fill="white"/>',
             f'<text x="{_WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for value in token_ticks:
        y = base - plot_h * value / max_tokens
        parts.append(f'<line x1="{_LEFT - 4}" y1="{y:.1f}" x2="{_LEFT + plot_w}" y2="{y:.1f}" stroke="#e6e6e6"/>'
                     f'<text x="{_LEFT - 7}" y="{y + 4:.1f}" text-anchor="end">{_label(value)}</text>')
    for value in latency_ticks:
        y = base - plot_h * value / max_latency
        parts.append(f'<line x1="{_LEFT + plot_w}" y1="{y:.1f}" x2="{_LEFT + plot_w + 4}" y2="{y:.1f}" stroke="black"/>'
                     f'<text x="{_LEFT + plot_w + 7}" y="{y + 4:.1f}">{value:g}</text>')
    parts += [f'<line x1="{_LEFT}" y1="{base}" x2="{_LEFT + plot_w}" y2="{base}" stroke="black"/>',
              f'<line x1="{_LEFT}" y1="{_TOP}" x2="{_LEFT}" y2="{base}" stroke="black"/>',
              f'<line x1="{_LEFT + plot_w}" y1="{_TOP}" x2="{_LEFT + plot_w}" y2="{base}" stroke="black"/>',
              f'<text x="18" y="{_TOP + plot_h / 2}" transform="rotate(-90 18 {_TOP + plot_h / 2})" '
              f'text-anchor="middle">prompt tokens</text>',
              f'<text x="{_WIDTH - 18}" y="{_TOP + plot_h / 2}" transform="rotate(90 {_WIDTH - 18} '
              f'{_TOP + plot_h / 2})" text-anchor="middle">latency (s)</text>']
    points = []
    for i, record in enumerate(records):
        x = _LEFT + slot * i + (slot - bar_w - drop_w) / 2
        y = base
        values = record.as_dict()
        for name, key, color in _STACKED:
            h = plot_h * values[key] / max_tokens
            if h > 0:
                y -= h
                parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}" fill="{color}">'
                             f'<title>step {record.step} {name}: {values[key]}</title></rect>')
        name, key, color = _DROPPED
        h = plot_h * values[key] / max_tokens
        if h > 0:
            parts.append(f'<rect x="{x + bar_w:.1f}" y="{base - h:.1f}" width="{drop_w:.1f}" height="{h:.1f}" '
                         f'fill="{color}"><title>step {record.step} {name}: {values[key]}</title></rect>')
        center = x + (bar_w + drop_w) / 2
        parts.append(f'<text x="{center:.1f}" y="{base + 15}" text-anchor="middle">{record.step}</text>')
        points.append(f"{center:.1f},{base - plot_h * record.latency_s / max_latency:.1f}")
    if points:
        parts.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="black" stroke-width="2"/>')
    parts.append(f'<text x="{_LEFT + plot_w / 2}" y="{base + 32}" text-anchor="middle">step</text>')
    parts += _legend([*_STACKED, _DROPPED, ("latency", "", "black")], base + 50)
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


def _legend(entries: Sequence[tuple[str, str, str]], top: float) -> list[str]:
    """Swatches and labels in rows that fit the chart's width, each label's width measured."""
    parts, x, y = [], float(_LEFT), top
    for name, _, color in entries:
        width = 14 + _CHAR_W * len(name) + 18
        if x + width > _WIDTH - 10 and x > _LEFT:
            x, y = float(_LEFT), y + 18
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{x + 14:.1f}" y="{y + 9:.1f}">{escape(name)}</text>')
        x += width
    return parts
