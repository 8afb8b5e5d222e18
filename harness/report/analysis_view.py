"""The terminal view of an analysis.json: where the GPU time goes, at a glance.

Reads only the dict that `harness.analysis.analyze_path` returns (or a saved analysis.json), so a
colleague's results render the same as one's own.
"""

from __future__ import annotations

import re

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

NAME_WIDTH = 72
_NOISE = re.compile(r"\bat::native::|\bat::|\bc10::|\(anonymous namespace\)::")
_BAR_WIDTH = 30
_IDLE_ALARM = 0.3  # a GPU this idle between kernels is waiting on the CPU: a launch-bound step


def render_analysis(analysis: dict, *, top: int = 15) -> RenderableType:
    """Headline figures, top kernels, category shares, CPU ops by self time and the per-rank spread."""
    parts: list[RenderableType] = [_headline(analysis), _kernels(analysis, top), _categories(analysis)]
    if analysis.get("cpu_top"):
        parts.append(_cpu(analysis, top))
    if len(analysis.get("ranks", ())) > 1:
        parts.append(_ranks(analysis))
    return Group(*parts)


def short_name(name: str) -> str:
    """A kernel name without the noise of its C++ signature: no `void `, no PyTorch namespaces, no
    trailing argument list.

    The template arguments stay, as early as possible: they say what an elementwise kernel does
    (`unrolled_elementwise_kernel<direct_copy_kernel_cuda...` is the dtype cast). The table cuts what
    is still too long with an ellipsis.
    """
    name = _NOISE.sub("", name.removeprefix("void "))
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                # A call's argument list follows a name; "Memcpy DtoD (Device -> Device)" keeps its own.
                if not name[i - 1].isspace():
                    name = name[:i]
                break
    return name


def _table(title: str, name: str, *numbers: str) -> Table:
    """A name column that gives way when the terminal is narrow (cells made by `_name` are cut with an
    ellipsis rather than wrapped), and figures that never wrap."""
    table = Table(title=title, title_justify="left")
    table.add_column(name, overflow="ellipsis", max_width=NAME_WIDTH)
    for column in numbers:
        table.add_column(column, justify="right", no_wrap=True)
    return table


def _headline(a: dict) -> Text:
    files = a.get("files", [])
    text = Text()
    text.append(f"{len(files)} trace file{'s' if len(files) != 1 else ''}", style="bold")
    text.append(f"   GPU kernel time {a['total_gpu_ms']:.3f} ms per rank")
    if a.get("steps"):
        source = f", from {a['steps_source']}" if a.get("steps_source") else ""
        text.append(f"   {a['steps']} steps{source}   ")
        text.append(f"{a['per_step_ms']:.3f} ms/step", style="bold")
    idle = a.get("gpu_idle_share", 0.0)
    text.append(f"   GPU idle {idle * 100:.1f}% ({a.get('gpu_idle_ms', 0.0):.3f} ms)",
                style="bold red" if idle >= _IDLE_ALARM else "")
    return text


def _kernels(a: dict, top: int) -> RenderableType:
    if not a.get("top"):
        return Text("no GPU kernels in the trace", style="yellow")
    table = _table("GPU kernels by total time (per rank)", "kernel", "category", "ms", "share", "count")
    for k in a["top"][:top]:
        table.add_row(_name(short_name(k["name"])), k["category"], f"{k['total_ms']:.3f}",
                      f"{k['share'] * 100:.1f}%", _count(k["count"]))
    return table


def _categories(a: dict) -> RenderableType:
    table = _table("GPU time by category", "category", "share", "")
    for category, share in sorted(a.get("categories", {}).items(), key=lambda kv: -kv[1]):
        if share > 0:
            table.add_row(category, f"{share * 100:.1f}%", "█" * max(1, round(share * _BAR_WIDTH)))
    table.columns[-1].justify = "left"
    return table


def _cpu(a: dict, top: int) -> RenderableType:
    table = _table("CPU ops by self time (per rank)", "op", "self ms", "count")
    for op in a["cpu_top"][:top]:
        table.add_row(_name(op["name"]), f"{op['self_ms']:.3f}", _count(op["count"]))
    return table


def _ranks(a: dict) -> RenderableType:
    spread = a.get("rank_spread") or {}
    straggler = spread.get("straggler")
    table = _table("Ranks", "top kernel", "rank", "GPU ms", "idle ms")
    for r in a["ranks"]:
        top1 = short_name(r["top3"][0]["name"]) if r.get("top3") else ""
        table.add_row(_name(top1), str(r["rank"]), f"{r['total_gpu_ms']:.3f}", f"{r['idle_ms']:.3f}",
                      style="bold red" if r["rank"] == straggler else None)
    note = Text(f"spread {spread.get('spread_pct', 0.0):.1f}% "
                f"({spread.get('min_ms', 0.0):.3f} to {spread.get('max_ms', 0.0):.3f} ms)")
    if straggler is not None:
        note.append(f"   straggler: rank {straggler}", style="bold red")
    return Group(table, note)


def _name(name: str) -> Text:
    return Text(name, no_wrap=True, overflow="ellipsis")


def _count(count: float) -> str:
    """Launches per rank: whole when the ranks agree, else a mean with two decimals."""
    return str(count) if isinstance(count, int) else f"{count:.2f}"
