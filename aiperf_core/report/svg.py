"""Plots as inline SVG text: line charts and a timeline. No plotting library, no script, no network:
the report must open anywhere, offline, years later."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Callable, Sequence

WIDTH, HEIGHT = 760, 280
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 150, 30, 42
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]  # (x, y), x increasing
    color: str | None = None
    step: bool = False  # a running best: hold each value until the next point


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        high = low + 1.0
    raw = (high - low) / max(count, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 12))
    return ticks


def _tick_text(value: float) -> str:
    return f"{value:.6g}"


def line_chart(title: str, series: Sequence[Series], x_label: str, y_label: str,
               x_min: float | None = 0.0, y_min: float | None = 0.0, y_max: float | None = None,
               y_text: Callable[[float], str] = _tick_text) -> str:
    """A titled line chart; an empty chart says 'no data' instead of drawing axes over nothing."""
    points = [p for s in series for p in s.points]
    head = (f'<svg role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'width="{WIDTH}" height="{HEIGHT}" class="chart"><title>{escape(title)}</title>'
            f'<text x="{MARGIN_LEFT}" y="18" class="chart-title">{escape(title)}</text>')
    if not points:
        return head + f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no data</text></svg>'
    x_lo = min(p[0] for p in points) if x_min is None else min(x_min, min(p[0] for p in points))
    xs = nice_ticks(x_lo, max(p[0] for p in points))
    lo = min(p[1] for p in points) if y_min is None else y_min
    hi = max(p[1] for p in points) if y_max is None else y_max
    ys = nice_ticks(min(lo, hi), max(lo, hi, lo + 1e-12))
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def px(x: float) -> float:
        return MARGIN_LEFT + (x - xs[0]) / (xs[-1] - xs[0]) * plot_w

    def py(y: float) -> float:
        return MARGIN_TOP + plot_h - (y - ys[0]) / (ys[-1] - ys[0]) * plot_h

    parts = [head]
    for y in ys:
        parts.append(f'<line x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                     f'class="grid"/><text x="{MARGIN_LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">'
                     f'{escape(y_text(y))}</text>')
    for x in xs:
        parts.append(f'<text x="{px(x):.1f}" y="{MARGIN_TOP + plot_h + 16}" text-anchor="middle">'
                     f'{escape(_tick_text(x))}</text>')
    parts.append(f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    parts.append(f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{HEIGHT - 6}" text-anchor="middle">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<text transform="translate(14 {MARGIN_TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">'
                 f'{escape(y_label)}</text>')
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        coords = []
        for j, (x, y) in enumerate(s.points):
            if s.step and j:
                coords.append(f"{px(x):.1f},{py(s.points[j - 1][1]):.1f}")
            coords.append(f"{px(x):.1f},{py(y):.1f}")
        if len(s.points) == 1:
            x, y = s.points[0]
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        elif coords:
            parts.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{color}" '
                         f'stroke-width="2"><title>{escape(s.label)}</title></polyline>')
        legend_y = MARGIN_TOP + 14 + 18 * i
        parts.append(f'<line x1="{WIDTH - MARGIN_RIGHT + 12}" x2="{WIDTH - MARGIN_RIGHT + 32}" y1="{legend_y - 4}" '
                     f'y2="{legend_y - 4}" stroke="{color}" stroke-width="3"/>'
                     f'<text x="{WIDTH - MARGIN_RIGHT + 38}" y="{legend_y}">{escape(s.label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


@dataclass(frozen=True)
class Bar:
    start: float
    end: float
    color: str
    tooltip: str


def timeline_chart(title: str, rows: Sequence[tuple[str, Sequence[Bar]]], x_max: float, x_label: str,
                   legend: Sequence[tuple[str, str]] = (), marker: tuple[float, str] | None = None) -> str:
    """One row of bars per label (a replica's trials), time along x from 0 to x_max; `marker` is a
    labelled vertical line (the deadline)."""
    row_h = 14 if len(rows) <= 32 else max(3, 448 // max(len(rows), 1))
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT
    plot_h = max(row_h * len(rows), 18 * len(legend) + 8, row_h)
    height = MARGIN_TOP + plot_h + MARGIN_BOTTOM
    xs = nice_ticks(0.0, max(x_max, 1e-9))
    scale = plot_w / xs[-1]
    parts = [f'<svg role="img" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
             f'height="{height}" class="chart"><title>{escape(title)}</title>'
             f'<text x="{MARGIN_LEFT}" y="18" class="chart-title">{escape(title)}</text>']
    for x in xs:
        parts.append(f'<line x1="{MARGIN_LEFT + x * scale:.1f}" x2="{MARGIN_LEFT + x * scale:.1f}" '
                     f'y1="{MARGIN_TOP}" y2="{MARGIN_TOP + plot_h}" class="grid"/>'
                     f'<text x="{MARGIN_LEFT + x * scale:.1f}" y="{MARGIN_TOP + plot_h + 16}" '
                     f'text-anchor="middle">{escape(_tick_text(x))}</text>')
    label_every = max(1, math.ceil(12 / row_h))  # keep row labels from overlapping
    for r, (label, bars) in enumerate(rows):
        top = MARGIN_TOP + r * row_h
        if r % label_every == 0:
            parts.append(f'<text x="{MARGIN_LEFT - 6}" y="{top + row_h - 3}" text-anchor="end">{escape(label)}</text>')
        for bar in bars:
            x0 = MARGIN_LEFT + max(bar.start, 0.0) * scale
            width = max((min(bar.end, xs[-1]) - max(bar.start, 0.0)) * scale, 1.0)
            # A thin white edge keeps back-to-back trials of the same outcome apart.
            parts.append(f'<rect x="{x0:.1f}" y="{top + 1}" width="{width:.1f}" height="{max(row_h - 2, 1)}" '
                         f'fill="{bar.color}" stroke="#fff" stroke-width="0.6">'
                         f'<title>{escape(bar.tooltip)}</title></rect>')
    if marker is not None:
        x = MARGIN_LEFT + marker[0] * scale
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{MARGIN_TOP - 4}" y2="{MARGIN_TOP + plot_h}" stroke="#000" '
                     f'stroke-dasharray="4 3"/><text x="{x:.1f}" y="{MARGIN_TOP - 7}" text-anchor="middle">'
                     f'{escape(marker[1])}</text>')
    parts.append(f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    parts.append(f'<text x="{MARGIN_LEFT + plot_w / 2}" y="{height - 6}" text-anchor="middle">{escape(x_label)}</text>')
    for i, (name, color) in enumerate(legend):
        y = MARGIN_TOP + 14 + 18 * i
        parts.append(f'<rect x="{WIDTH - MARGIN_RIGHT + 12}" y="{y - 10}" width="20" height="10" fill="{color}"/>'
                     f'<text x="{WIDTH - MARGIN_RIGHT + 38}" y="{y}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)
