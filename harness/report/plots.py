"""Small SVG charts for the HTML report, written by hand: a few shapes (lines, points, box plots, stacked
bars, lines over time) need no plotting library, stay a few kilobytes each, render the same in every
browser and carry the page's fonts. Every function returns one <svg> element as text; sizes are in CSS
pixels and the viewBox lets the browser scale the chart to the column.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#edc948", "#ff9da7",
           "#9c755f", "#bab0ac"]
"""Tableau 10: distinct for the usual forms of colour blindness; configurations take them in order."""
CATEGORY_COLORS = {"copy": "#e15759", "communication": "#4e79a7", "moe": "#f28e2b", "attention": "#59a14f",
                   "gemm": "#76b7b2", "norm": "#b07aa1", "elementwise": "#edc948", "other": "#bab0ac",
                   "idle": "#e8e8e8"}
WIDTH = 720
FONT = 12


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) covering lo..hi."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1)
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    return [round(first + i * step, 10) for i in range(int(math.ceil((hi - first) / step)) + 1)]


def tick_label(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 or v == int(v) else f"{v:g}"


def _text(x: float, y: float, s: str, anchor: str = "start", cls: str = "") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"'
            f'{f" class={chr(34)}{cls}{chr(34)}" if cls else ""}>{escape(s)}</text>')


def _svg(height: float, body: list[str], label: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {WIDTH} {height:.0f}" '
            f'width="{WIDTH}" height="{height:.0f}" role="img" aria-label="{escape(label)}" '
            f'font-size="{FONT}">' + "".join(body) + "</svg>")


def _x_axis(ticks: list[float], scale, top: float, bottom: float, label: str, fmt=tick_label) -> list[str]:
    out = []
    for t in ticks:
        x = scale(t)
        out.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" y2="{bottom:.1f}"/>')
        out.append(_text(x, bottom + 15, fmt(t), "middle", "tick"))
    out.append(_text((scale(ticks[0]) + scale(ticks[-1])) / 2, bottom + 32, label, "middle", "axis"))
    return out


def _frame(yticks: list[float], xticks: list[float], sx, sy, *, left: float, right: float, top: float,
           height: float, xlabel: str, ylabel: str) -> list[str]:
    """The grid, the ticks and the axis labels of a chart of x against y."""
    body = []
    for t in yticks:
        body.append(f'<line class="grid" x1="{left}" x2="{WIDTH - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>')
        body.append(_text(left - 6, sy(t) + 4, tick_label(t), "end", "tick"))
    for t in xticks:
        body.append(_text(sx(t), top + height + 15, tick_label(t), "middle", "tick"))
    body.append(_text((left + WIDTH - right) / 2, top + height + 32, xlabel, "middle", "axis"))
    body.append(f'<text class="axis" transform="translate(14 {top + height / 2:.0f}) rotate(-90)" '
                f'text-anchor="middle">{escape(ylabel)}</text>')
    return body


def _legend_entry(i: int, name: str, color: str, *, right: float, top: float) -> list[str]:
    ly = top + 8 + i * 18
    return [f'<rect x="{WIDTH - right + 16}" y="{ly - 8}" width="12" height="12" rx="2" fill="{color}"/>',
            _text(WIDTH - right + 34, ly + 2, name)]


def line_chart(series: dict[str, list[tuple[float, float]]], colors: dict[str, str], *, xlabel: str,
               ylabel: str) -> str:
    """One line per series over x on a log2 axis (concurrency doubles), y from zero."""
    left, right, top, height = 64, 180, 12, 260
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ymax = max((y for pts in series.values() for _, y in pts), default=1)
    yticks = nice_ticks(0, ymax)
    lx = [math.log2(x) for x in xs]
    span = (lx[-1] - lx[0]) or 1

    def sx(x: float) -> float:
        return left + (WIDTH - left - right) * ((math.log2(x) - lx[0]) / span if len(xs) > 1 else 0.5)

    def sy(y: float) -> float:
        return top + height * (1 - y / yticks[-1])

    body = _frame(yticks, xs, sx, sy, left=left, right=right, top=top, height=height, xlabel=xlabel, ylabel=ylabel)
    for i, (name, pts) in enumerate(series.items()):
        pts = sorted(pts)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        body.append(f'<polyline fill="none" stroke="{colors[name]}" stroke-width="2" points="{path}"/>')
        body += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3.5" fill="{colors[name]}">'
                 f'<title>{escape(name)} at {tick_label(x)}: {y:,.1f}</title></circle>' for x, y in pts]
        body += _legend_entry(i, name, colors[name], right=right, top=top)
    return _svg(top + height + 42, body, f"{ylabel} against {xlabel}")


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (more is better on each), by x."""
    best = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(best))


def scatter_chart(series: dict[str, list[tuple[float, float, str]]], colors: dict[str, str], *, xlabel: str,
                  ylabel: str) -> str:
    """Points (x, y, label) per series on linear axes from zero, with the Pareto frontier of all of
    them drawn through: the configurations and levels that nothing beats on both axes."""
    left, right, top, height = 64, 180, 12, 260
    pts = [(x, y) for ps in series.values() for x, y, _ in ps]
    xticks = nice_ticks(0, max((x for x, _ in pts), default=1))
    yticks = nice_ticks(0, max((y for _, y in pts), default=1))

    def sx(x: float) -> float:
        return left + (WIDTH - left - right) * x / xticks[-1]

    def sy(y: float) -> float:
        return top + height * (1 - y / yticks[-1])

    body = _frame(yticks, xticks, sx, sy, left=left, right=right, top=top, height=height, xlabel=xlabel,
                  ylabel=ylabel)
    front = pareto(pts)
    if len(front) > 1:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in front)
        body.append(f'<polyline class="frontier" fill="none" stroke="#888" stroke-dasharray="4 3" points="{path}"/>')
    for i, (name, ps) in enumerate(series.items()):
        body += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="{colors[name]}">'
                 f'<title>{escape(name)} {escape(label)}: {x:,.1f} and {y:,.1f}</title></circle>' for x, y, label in ps]
        body += [_text(sx(x) + 6, sy(y) - 5, label, "start", "tick") for x, y, label in ps]
        body += _legend_entry(i, name, colors[name], right=right, top=top)
    return _svg(top + height + 42, body, f"{ylabel} against {xlabel}")


def box_chart(groups: list[tuple[str, list[tuple[str, dict]]]], colors: dict[str, str], *, xlabel: str) -> str:
    """Horizontal box plots: per group (a concurrency level) one row per configuration; the box spans
    p25..p75, the whiskers p1..p99, the bar is the median. Stats: {p1, p25, p50, p75, p99}."""
    left, right, row, head = 170, 70, 22, 20
    values = [s[k] for _, rows in groups for _, s in rows for k in ("p1", "p99")]
    ticks = nice_ticks(0, max(values, default=1))
    rows_n = sum(len(rows) for _, rows in groups)
    top, height = 6, rows_n * row + len(groups) * head

    def sx(v: float) -> float:
        return left + (WIDTH - left - right) * v / ticks[-1]

    body = _x_axis(ticks, sx, top, top + height, xlabel)
    y = top
    for title, rows in groups:
        body.append(_text(8, y + 14, title, "start", "group"))
        y += head
        for name, s in rows:
            mid = y + row / 2
            c = colors[name]
            body.append(_text(left - 8, mid + 4, name, "end"))
            body.append(f'<line x1="{sx(s["p1"]):.1f}" x2="{sx(s["p99"]):.1f}" y1="{mid:.1f}" y2="{mid:.1f}" '
                        f'stroke="{c}" stroke-width="1.5"/>')
            width = max(sx(s["p75"]) - sx(s["p25"]), 1.5)
            body.append(f'<rect x="{sx(s["p25"]):.1f}" y="{mid - 7:.1f}" width="{width:.1f}" '
                        f'height="14" fill="{c}" fill-opacity="0.35" stroke="{c}"><title>{escape(name)}: p1 '
                        f'{s["p1"]:.2f}, p25 {s["p25"]:.2f}, p50 {s["p50"]:.2f}, p75 {s["p75"]:.2f}, p99 '
                        f'{s["p99"]:.2f}</title></rect>')
            body.append(f'<line x1="{sx(s["p50"]):.1f}" x2="{sx(s["p50"]):.1f}" y1="{mid - 7:.1f}" '
                        f'y2="{mid + 7:.1f}" stroke="#222" stroke-width="2"/>')
            body.append(_text(sx(s["p99"]) + 6, mid + 4, f'{s["p50"]:.3g}', "start", "note"))
            y += row
    return _svg(top + height + 42, body, xlabel)


def stacked_bars(rows: list[tuple[str, dict[str, float], str]], *, xlabel: str) -> str:
    """One 100 % bar per configuration split by category share, a note (e.g. ms per step) at its end,
    and a legend of the categories present."""
    left, right, row, top = 170, 90, 26, 30
    cats = [c for c in CATEGORY_COLORS if any(shares.get(c) for _, shares, _ in rows)]
    cats += sorted({c for _, shares, _ in rows for c in shares if shares[c] and c not in cats})
    body, x = [], left
    for c in cats:  # legend
        body.append(f'<rect x="{x}" y="6" width="12" height="12" rx="2" fill="{CATEGORY_COLORS.get(c, "#999")}"/>')
        body.append(_text(x + 16, 16, c))
        x += 30 + 7 * len(c)

    def sx(share: float) -> float:
        return left + (WIDTH - left - right) * share

    bottom = top + len(rows) * row
    body += _x_axis([0, 0.25, 0.5, 0.75, 1.0], sx, top, bottom, xlabel, fmt=lambda t: f"{t * 100:.0f}%")
    for i, (name, shares, note) in enumerate(rows):
        y, at = top + i * row + 4, 0.0
        body.append(_text(left - 8, y + 13, name, "end"))
        for c in cats:
            share = shares.get(c) or 0
            if share <= 0:
                continue
            w = sx(at + share) - sx(at)
            body.append(f'<rect x="{sx(at):.1f}" y="{y}" width="{w:.1f}" height="18" '
                        f'fill="{CATEGORY_COLORS.get(c, "#999")}"><title>{escape(name)}: {escape(c)} '
                        f'{share * 100:.1f}%</title></rect>')
            if w > 34:
                body.append(_text(sx(at) + w / 2, y + 13, f"{share * 100:.0f}%", "middle", "inbar"))
            at += share
        body.append(_text(sx(1) + 6, y + 13, note, "start", "note"))
    return _svg(bottom + 42, body, xlabel)


def time_chart(series: dict[str, list[tuple[float, float]]], colors: dict[str, str], *,
               bands: list[tuple[float, float, str]], xlabel: str, ylabel: str, height: float = 160) -> str:
    """Lines of y against time in seconds, y from zero, with spans (start, end, label) shaded behind:
    the benchmark's levels under the server's own counts."""
    left, right, top = 64, 180, 18
    xs = [x for pts in series.values() for x, _ in pts] + [b for a, b, _ in bands]
    xticks = nice_ticks(0, max(xs, default=1))
    yticks = nice_ticks(0, max((y for pts in series.values() for _, y in pts), default=1) or 1)

    def sx(x: float) -> float:
        return left + (WIDTH - left - right) * x / xticks[-1]

    def sy(y: float) -> float:
        return top + height * (1 - y / yticks[-1])

    body = []
    for a, b, label in bands:
        body.append(f'<rect class="band" x="{sx(a):.1f}" y="{top}" width="{max(sx(b) - sx(a), 1):.1f}" '
                    f'height="{height}" fill="#4e79a7" fill-opacity="0.08"><title>{escape(label)}</title></rect>')
        body.append(_text((sx(a) + sx(b)) / 2, top - 5, label, "middle", "tick"))
    body += _frame(yticks, xticks, sx, sy, left=left, right=right, top=top, height=height, xlabel=xlabel,
                   ylabel=ylabel)
    for i, (name, pts) in enumerate(series.items()):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        body.append(f'<polyline fill="none" stroke="{colors[name]}" stroke-width="1.5" points="{path}"/>')
        body += _legend_entry(i, name, colors[name], right=right, top=top)
    return _svg(top + height + 42, body, f"{ylabel} against {xlabel}")
