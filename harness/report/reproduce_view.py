"""A reproduced run beside the original: facts that differ, metrics with deltas against the noise."""

from __future__ import annotations

from rich import box
from rich.console import Group, JustifyMethod
from rich.text import Text

from harness.report.analysis_view import short_name
from harness.report.escape import printable
from harness.report.plain import PlainTable


def _fmt(v) -> str:
    """A fact's value in a cell: a mapping as `key value` pairs, a list item by item, long text cut
    with a mark (never a Python repr cut mid-word: `{'commit': '…', 'dirt`)."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}"
    if isinstance(v, dict):
        text = ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    elif isinstance(v, list):
        text = "; ".join(map(_fmt, v))
    else:
        text = str(v)
    return text if len(text) <= 200 else text[:197] + "..."


def _level(key: tuple) -> str:
    """A row's level as compare names it: `8` (concurrency), `2.5/s` (request rate), after its scenario,
    with `*` for a probe of max_load."""
    scenario, kind, load, probe = key
    text = f"{load:g}/s" if kind == "request_rate" and load is not None else str(load if load is not None else "-")
    return (f"{scenario} " if scenario else "") + text + ("*" if probe else "")


def render_comparison(result: dict, *, before: str, after: str):
    parts = []
    facts = PlainTable(title="facts that differ", box=box.SIMPLE_HEAD, title_justify="left",
                       header_style="bold")
    for col in ("fact", before, after):
        facts.add_column(col, overflow="fold")
    for f in result["facts"]:
        facts.add_row(f["fact"], _fmt(f["before"]), _fmt(f["after"]))
    parts.append(facts if result["facts"] else Text("facts: no difference", style="green"))
    t = PlainTable(title="results", box=box.SIMPLE_HEAD, title_justify="left", header_style="bold")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("level", "right"), ("metric", "left"), (before, "right"), (after, "right"), ("delta", "right"),
        ("noise", "right"), ("beyond?", "left"))
    for col, justify in columns:
        t.add_column(col, justify=justify)
    for row in result["rows"]:
        delta = "-" if row.delta is None else f"{row.delta * 100:+.1f}%"
        verdict = (Text("yes", style="bold red") if row.beyond_noise else Text("no", style="green")) \
            if row.delta is not None else Text("-")
        t.add_row(_level(row.level), row.label, _fmt(row.before), _fmt(row.after), delta,
                  f"±{row.noise * 100:.1f}%", verdict)
    if result["rows"]:
        parts.append(t)
        sources = sorted({r.noise_source for r in result["rows"]})
        parts.append(Text(f"noise: {', '.join(sources)} (at least 2%)", style="dim"))
    else:
        parts.append(Text("results: no figure to set side by side", style="yellow"))
    for note in result.get("notes", []):   # why the table is short or empty: never left unsaid
        parts.append(Text(printable(f"note: {note}"), style="yellow"))
    if any(r.level[3] for r in result["rows"]):
        parts.append(Text("* a probe of search.max_load", style="dim"))
    k = result["kernels"]
    if k["before"] or k["after"]:
        kt = PlainTable(title="top kernels", box=box.SIMPLE_HEAD, title_justify="left", header_style="bold")
        kt.add_column(before, overflow="ellipsis", no_wrap=True, max_width=45)
        kt.add_column(after, overflow="ellipsis", no_wrap=True, max_width=45)
        def cell(side: list, i: int) -> str:
            return f"{side[i][1] * 100:.0f}% {short_name(side[i][0])}" if i < len(side) else ""
        for i in range(max(len(k["before"]), len(k["after"]))):
            kt.add_row(cell(k["before"], i), cell(k["after"], i))
        parts.append(kt)
    return Group(*parts)
