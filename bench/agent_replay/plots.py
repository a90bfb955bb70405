"""Hand-written SVG plots (no plotting library needed): line panels per call and stacked bars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

COLOURS = ("#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 260, 70, 150, 30, 40


def _axis(parts: list[str], y0: float, title: str, y_max: float, x_max: float, x_label: str) -> None:
    plot_h = H - TOP - BOTTOM
    parts.append(f'<text x="{LEFT}" y="{y0 + 18}" font-size="13">{escape(title)}</text>')
    parts.append(f'<line x1="{LEFT}" y1="{y0 + TOP + plot_h}" x2="{W - RIGHT}" y2="{y0 + TOP + plot_h}" stroke="black"/>')
    parts.append(f'<line x1="{LEFT}" y1="{y0 + TOP}" x2="{LEFT}" y2="{y0 + TOP + plot_h}" stroke="black"/>')
    for k in range(5):
        v = y_max * k / 4
        y = y0 + TOP + plot_h - plot_h * k / 4
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4}" font-size="10" text-anchor="end">{_fmt(v)}</text>')
    for k in range(5):
        v = x_max * k / 4
        x = LEFT + (W - LEFT - RIGHT) * k / 4
        parts.append(f'<text x="{x}" y="{y0 + H - BOTTOM + 14}" font-size="10" text-anchor="middle">{_fmt(v)}</text>')
    parts.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{y0 + H - 8}" font-size="11" text-anchor="middle">'
                 f'{escape(x_label)}</text>')


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.1f}M"
    if v >= 1e3:
        return f"{v / 1e3:.0f}k"
    return f"{v:.2f}" if v < 10 else f"{v:.0f}"


def line_panels(panels: Sequence[tuple[str, Mapping[str, Sequence[float | None]]]], x_label: str) -> str:
    """One panel per (title, {series name: y values by call index}), stacked vertically; a None value
    is a gap (no point, the line broken there)."""
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H * len(panels)}" '
             f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>']
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    for p, (title, series) in enumerate(panels):
        y0 = p * H
        y_max = max((max((y for y in v if y is not None), default=0) for v in series.values()), default=0) or 1
        x_max = max((len(v) - 1 for v in series.values()), default=1) or 1
        _axis(parts, y0, title, y_max, x_max, x_label)
        for k, (name, values) in enumerate(series.items()):
            colour = COLOURS[k % len(COLOURS)]
            for run in _runs(values):
                xy = [(LEFT + plot_w * i / x_max, y0 + TOP + plot_h - plot_h * v / y_max) for i, v in run]
                if len(xy) == 1:
                    parts.append(f'<circle cx="{xy[0][0]:.1f}" cy="{xy[0][1]:.1f}" r="3" fill="{colour}"/>')
                else:
                    points = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
                    parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
            ly = y0 + TOP + 14 * k + 8
            parts.append(f'<line x1="{W - RIGHT + 10}" y1="{ly}" x2="{W - RIGHT + 28}" y2="{ly}" stroke="{colour}" '
                         f'stroke-width="2"/><text x="{W - RIGHT + 32}" y="{ly + 4}" font-size="11">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _runs(values: Sequence[float | None]) -> list[list[tuple[int, float]]]:
    """The (index, value) runs between None values."""
    runs: list[list[tuple[int, float]]] = [[]]
    for i, v in enumerate(values):
        if v is None:
            runs.append([])
        else:
            runs[-1].append((i, v))
    return [run for run in runs if run]


def stacked_bars(title: str, bars: Mapping[str, Mapping[str, float]], unit: str) -> str:
    """Horizontal bars, one per name, stacked by part ({bar: {part: value}})."""
    names = list(bars)
    part_names = list(dict.fromkeys(p for b in bars.values() for p in b))
    height = TOP + 28 * len(names) + 60
    total_max = max((sum(b.values()) for b in bars.values()), default=0) or 1
    left, width = 130, W - 130 - 90
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" font-family="sans-serif">'
             f'<rect width="100%" height="100%" fill="white"/><text x="10" y="18" font-size="13">{escape(title)}</text>']
    for row, name in enumerate(names):
        y = TOP + 28 * row
        x = float(left)
        parts.append(f'<text x="{left - 6}" y="{y + 15}" font-size="11" text-anchor="end">{escape(name)}</text>')
        for k, part in enumerate(part_names):
            w = width * bars[name].get(part, 0.0) / total_max
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="20" fill="{COLOURS[k % len(COLOURS)]}"/>')
            x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 15}" font-size="10">{sum(bars[name].values()):.3f} {escape(unit)}</text>')
    y = TOP + 28 * len(names) + 20
    for k, part in enumerate(part_names):
        parts.append(f'<rect x="{left + 120 * k}" y="{y}" width="12" height="12" fill="{COLOURS[k % len(COLOURS)]}"/>'
                     f'<text x="{left + 120 * k + 16}" y="{y + 10}" font-size="11">{escape(part)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
