"""Line charts as inline SVG, drawn on the server: no JavaScript library, no CDN, readable without scripts,
and testable by reading the page's HTML (every point carries its values as data attributes)."""

from __future__ import annotations

import math
from html import escape

from markupsafe import Markup

WIDTH, HEIGHT, PAD = 640, 220, 56  # px


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def line_chart(points: list[tuple[int, float]], *, chart_id: str, title: str, y_label: str,
               limit: float | None = None, limit_label: str = "") -> Markup:
    """`points` are (round, value) with rounds ascending; `limit` draws a dashed horizontal line."""
    if not points:
        return Markup(f'<p class="empty" id="{escape(chart_id)}">{escape(title)}: nothing measured yet.</p>')
    xs = [x for x, _ in points]
    ys = [y for _, y in points] + ([limit] if limit is not None else [])
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    margin = (y1 - y0) * 0.08
    y0, y1 = y0 - margin, y1 + margin
    w, h = WIDTH - 2 * PAD, HEIGHT - 2 * PAD

    def sx(x: float) -> float:
        return PAD + (x - x0) / (x1 - x0) * w

    def sy(y: float) -> float:
        return PAD + (1 - (y - y0) / (y1 - y0)) * h

    parts = [f'<svg id="{escape(chart_id)}" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
             f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
             f'<title>{escape(title)}</title>',
             f'<line class="axis" x1="{PAD}" y1="{PAD + h}" x2="{PAD + w}" y2="{PAD + h}"/>',
             f'<line class="axis" x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{PAD + h}"/>']
    decimals = max(0, 1 - math.floor(math.log10((y1 - y0) / 4)))  # enough digits to tell the ticks apart
    for t in _ticks(y0, y1):
        parts.append(f'<text class="tick" x="{PAD - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.{decimals}f}</text>')
    step = max(1, len(xs) // 8)
    for x in xs[::step]:
        parts.append(f'<text class="tick" x="{sx(x):.1f}" y="{PAD + h + 16}" text-anchor="middle">{x}</text>')
    parts.append(f'<text class="label" x="{PAD}" y="{PAD - 12}">{escape(y_label)}</text>')
    parts.append(f'<text class="label" x="{PAD + w}" y="{HEIGHT - 4}" text-anchor="end">round</text>')
    if limit is not None:
        parts.append(f'<line class="limit" x1="{PAD}" y1="{sy(limit):.1f}" x2="{PAD + w}" y2="{sy(limit):.1f}"/>'
                     f'<text class="limit-label" x="{PAD + w}" y="{sy(limit) - 4:.1f}" text-anchor="end">'
                     f'{escape(limit_label)}</text>')
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts.append(f'<polyline class="series" points="{path}"/>')
    if len(points) <= 200:  # beyond that the line says it all and the page stays small
        for x, y in points:
            parts.append(f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" data-round="{x}" '
                         f'data-value="{y:.6g}"><title>round {x}: {y:.4f}</title></circle>')
    parts.append("</svg>")
    return Markup("".join(parts))
