"""Small inline-SVG charts for the demo report and the dashboard: no scripts, no CDN."""

from __future__ import annotations

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


def line_chart(
    title: str, series: dict[str, list[tuple[float, float]]], width: int = 640, height: int = 220
) -> str:
    """Lines over a shared x axis (e.g. seconds); each series is a list of (x, y)."""
    left, right, top, bottom = 50, 120, 30, 30
    points = [p for values in series.values() for p in values]
    if not points:
        points = [(0.0, 0.0), (1.0, 1.0)]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y1 = max(max(p[1] for p in points), 1)
    sx = (width - left - right) / ((x1 - x0) or 1)
    sy = (height - top - bottom) / y1
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" font-family="sans-serif" font-size="11">',
        f'<text x="0" y="16" font-size="14" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" '
        'stroke="#999"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#999"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{y1:,.0f}</text>',
        f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">0</text>',
    ]
    for j, (name, values) in enumerate(series.items()):
        color = _color(name, j)
        path = " ".join(
            f"{left + (x - x0) * sx:.1f},{height - bottom - y * sy:.1f}" for x, y in values
        )
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        parts.append(
            f'<text x="{width - right + 6}" y="{top + 14 * j + 10}" fill="{color}">'
            f"{escape(name)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)
