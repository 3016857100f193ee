"""Small inline-SVG charts for the demo report and the dashboard: no scripts, no CDN."""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape

PALETTE = ("#2563eb", "#16a34a", "#dc2626", "#d97706", "#7c3aed", "#0891b2", "#db2777")
# Series named after an outcome keep that outcome's colour in every chart.
OUTCOME_COLORS = {"delivered": "#16a34a", "failed": "#dc2626", "missing": "#7c3aed"}


def _color(name: str, index: int) -> str:
    for outcome, color in OUTCOME_COLORS.items():
        if name.startswith(outcome):
            return color
    return PALETTE[index % len(PALETTE)]


def bar_chart(
    title: str, labels: list[str], series: dict[str, list[float]], width: int = 640
) -> str:
    """Grouped horizontal bars: one group per label, one bar per series."""
    bar_h, gap, left, top = 12, 10, 190, 30
    n_series = max(len(series), 1)
    group_h = n_series * bar_h + gap
    height = top + len(labels) * group_h + 30
    peak = max([v for values in series.values() for v in values] + [1])
    scale = (width - left - 60) / peak
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{escape(title)}</text>',
    ]
    for i, label in enumerate(labels):
        y0 = top + i * group_h
        parts.append(
            f'<text x="{left - 6}" y="{y0 + n_series * bar_h / 2 + 4}" '
            f'text-anchor="end">{escape(label)}</text>'
        )
        for j, (_name, values) in enumerate(series.items()):
            value = values[i]
            y = y0 + j * bar_h
            w = max(value * scale, 0)
            color = _color(_name, j)
            parts.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" fill="{color}"/>'
                f'<text x="{left + w + 4:.1f}" y="{y + bar_h - 3}">{value:,.0f}</text>'
            )
    legend_y = height - 10
    for j, name in enumerate(series):
        x = left + j * 130
        parts.append(
            f'<rect x="{x}" y="{legend_y - 9}" width="10" height="10" '
            f'fill="{_color(name, j)}"/><text x="{x + 14}" y="{legend_y}">'
            f"{escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _nice(top: float) -> float:
    if top <= 0:
        return 1.0
    step = 10 ** len(str(int(top))) / 10
    for m in (1, 2, 2.5, 5, 10):
        if top <= step * m:
            return step * m
    return top


def line_chart(
    title: str, series: dict[str, list[tuple[float, float]]], unit: str, width: int = 640
) -> str:
    """Lines over time as inline SVG in a card with its legend: ``series`` maps a label to
    (unix time, value) points. The dashboard's stylesheet gives the classes their look."""
    height, left, right, top, bottom = 220, 56, 12, 28, 30
    pts = [p for points in series.values() for p in points if p[1] is not None]
    esc = escape
    head = (
        f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">'
        f'<text x="{left}" y="16" class="title">{esc(title)}</text>'
    )
    if not pts:
        empty = f'<text x="{left}" y="{height // 2}" class="empty">no data yet</text></svg>'
        return f'<div class="card">{head}{empty}</div>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    x1 = x1 if x1 > x0 else x0 + 1
    ymax = _nice(max(p[1] for p in pts))
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y / ymax) * ph

    parts = [head]
    for i in range(5):
        v = ymax * i / 4
        y = sy(v)
        label = f"{v:,.0f}" if ymax >= 10 else f"{v:.2g}"
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" class="axis" text-anchor="end">{label}</text>'
        )
    for x, anchor in ((x0, "start"), (x1, "end")):
        stamp = datetime.fromtimestamp(x, UTC).strftime("%H:%M:%S")
        parts.append(
            f'<text x="{sx(x):.1f}" y="{height - 10}" class="axis" text-anchor="{anchor}">'
            f"{stamp} UTC</text>"
        )
    parts.append(
        f'<text x="{width - right}" y="16" class="axis" text-anchor="end">{esc(unit)}</text>'
    )
    for i, (label, points) in enumerate(sorted(series.items())):
        color = _color(label, i)
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points if y is not None)
        if coords:
            parts.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{coords}" '
                f'data-series="{esc(label)}"><title>{esc(label)}</title></polyline>'
            )
    parts.append("</svg>")
    legend = "".join(
        f'<span class="key"><i style="background:{_color(label, i)}"></i>{esc(label)}</span>'
        for i, label in enumerate(sorted(series))
    )
    return f'<div class="card">{"".join(parts)}<div class="legend">{legend}</div></div>'
