"""The terminal view of an analysis.json: where the GPU time goes, at a glance.

Reads only the dict that `harness.analysis.analyze_path` returns (or a saved analysis.json), so a
colleague's results render the same as one's own.
"""

from __future__ import annotations

import re

from rich.console import Group, RenderableType
from rich.text import Text

from harness.report.plain import PlainTable

NAME_WIDTH = 72
_NOISE = re.compile(r"\bat::native::|\bat::|\bc10::|\(anonymous namespace\)::")
_BAR_WIDTH = 30
_IDLE_ALARM = 0.3  # a GPU this idle between kernels is waiting on the CPU: a launch-bound step


def render_analysis(analysis: dict, *, top: int = 15) -> RenderableType:
    """Headline figures, the stages the trace marks, top kernels and category shares (of the decode
    steps when the trace marks them: what a step of generation costs), CPU ops by self time and the
    per-rank spread."""
    scope, label = decode_scope(analysis)
    parts: list[RenderableType] = [_headline(analysis)]
    if analysis.get("stages"):
        parts.append(_stages(analysis))
    parts += [_kernels(scope, top, label), _categories(scope, label)]
    if analysis.get("cpu_top"):
        parts.append(_cpu(analysis, top))
    if len(analysis.get("ranks", ())) > 1:
        parts.append(_ranks(analysis))
    return Group(*parts)


def decode_scope(analysis: dict) -> tuple[dict, str]:
    """The decode stage's figures (top, categories) and "decode" when the trace marks decode steps that
    ran kernels, else the whole trace's and ""."""
    decode = (analysis.get("stages") or {}).get("decode")
    return (decode, "decode") if decode and decode.get("top") else (analysis, "")


_DTYPE = re.compile(r"\b(Float8_e4m3fnuz|Float8_e4m3fn|Float8_e5m2fnuz|Float8_e5m2|Float4_e2m1fn_x2|BFloat16|Half|"
                    r"__nv_bfloat16|__nv_fp8_e4m3|__nv_fp8_e5m2|__half|float|double|int8_t|uint8_t)\b")


_ENUM_ARG = re.compile(r"\(([\w:]+)\)(\d+)")   # `(vllm::Fp8KVCacheDataType)1`: an enum as a template argument


def short_name(name: str, width: int = 64) -> str:
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
    if len(name) <= width or "<" not in name:
        return name
    # Too long: the kernel, the first name in its template arguments (what it does) and the types it
    # works on (what tells an FP8 cast from a BF16 copy), the rest elided.
    base, _, inner = name.partition("<")
    first = re.match(r"[\w:]+", inner)
    types = list(dict.fromkeys(_DTYPE.findall(inner)))
    types += [f"{m.group(1).rsplit('::', 1)[-1]}={m.group(2)}" for m in _ENUM_ARG.finditer(inner)]
    parts = ([first.group(0)] if first else []) + [t for t in types if not first or t != first.group(0)]
    return f"{base}<{', '.join(parts)}, …>" if parts else name[:width - 1] + "…"


def _table(title: str, name: str, *numbers: str) -> PlainTable:
    """A name column that gives way when the terminal is narrow (cells made by `_name` are cut with an
    ellipsis rather than wrapped), and figures that never wrap."""
    table = PlainTable(title=title, title_justify="left")
    table.add_column(name, overflow="ellipsis", max_width=NAME_WIDTH)
    for column in numbers:
        table.add_column(column, justify="right", no_wrap=True)
    return table


def _headline(a: dict) -> Text:
    """The trace files, kernel time, steps and idle time: each figure the analysis has (a saved
    analysis.json of another harness may lack some)."""
    files = a.get("files") or []
    text = Text()
    text.append(f"{len(files)} trace file{'s' if len(files) != 1 else ''}", style="bold")
    if a.get("total_gpu_ms") is not None:
        text.append(f"   GPU kernel time {_ms(a['total_gpu_ms'])} ms per rank")
    if a.get("steps"):
        decode = (a.get("stages") or {}).get("decode") if a.get("steps_source") == "trace" else None
        what = "decode steps in the trace" if decode else "steps requested"
        text.append(f"   {_count(a['steps'])} {what}")
        if a.get("per_step_ms") is not None:
            text.append("   ")
            text.append(f"{_ms(a['per_step_ms'])} GPU ms/step", style="bold")
        if decode and decode.get("step_ms") is not None:
            text.append(f" ({_ms(decode['step_ms'])} ms wall)")
    idle = a.get("gpu_idle_share")
    if idle is not None:
        text.append(f"   GPU idle {idle * 100:.1f}% ({_ms(a.get('gpu_idle_ms'))} ms)",
                    style="bold red" if idle >= _IDLE_ALARM else "")
    return text


def _stages(a: dict) -> RenderableType:
    """Per stage: its steps, the GPU time and wall time a step, and its top kernel."""
    table = _table("Steps by stage (per rank)", "top kernel", "stage", "steps", "GPU ms/step", "wall ms/step",
                   "GPU ms")
    for stage, s in a["stages"].items():
        top1 = short_name(s["top"][0]["name"]) if s.get("top") else ""
        table.add_row(_name(top1), stage, _count(s.get("steps")), _ms(s.get("per_step_ms")), _ms(s.get("step_ms")),
                      _ms(s.get("total_gpu_ms")))
    if a.get("outside_steps_ms") is None:
        return table
    return Group(table, Text(f"outside every step: {a['outside_steps_ms']:.3f} GPU ms"))


def _kernels(a: dict, top: int, label: str = "") -> RenderableType:
    if not a.get("top"):
        return Text("no GPU kernels in the trace", style="yellow")
    where = f" in {label} steps" if label else ""
    table = _table(f"GPU kernels{where} by total time (per rank)", "kernel", "category", "ms", "share", "count")
    for k in a["top"][:top]:
        table.add_row(_name(short_name(k["name"])), k.get("category") or "-", _ms(k.get("total_ms")),
                      f"{(k.get('share') or 0.0) * 100:.1f}%", _count(k.get("count")))
    return table


def _categories(a: dict, label: str = "") -> RenderableType:
    table = _table(f"GPU time{f' in {label} steps' if label else ''} by category", "category", "share", "")
    for category, share in sorted(a.get("categories", {}).items(), key=lambda kv: -kv[1]):
        if share > 0:
            table.add_row(category, f"{share * 100:.1f}%", "█" * max(1, round(share * _BAR_WIDTH)))
    table.columns[-1].justify = "left"
    return table


def _cpu(a: dict, top: int) -> RenderableType:
    table = _table("CPU ops by self time (per rank)", "op", "self ms", "count")
    for op in a["cpu_top"][:top]:
        table.add_row(_name(str(op.get("name"))), _ms(op.get("self_ms")), _count(op.get("count")))
    return table


def _ranks(a: dict) -> RenderableType:
    spread = a.get("rank_spread") or {}
    straggler = spread.get("straggler")
    table = _table("Ranks", "top kernel", "rank", "GPU ms", "idle ms")
    for r in a["ranks"]:
        top1 = short_name(r["top3"][0]["name"]) if r.get("top3") else ""
        table.add_row(_name(top1), str(r.get("rank", "-")), _ms(r.get("total_gpu_ms")), _ms(r.get("idle_ms")),
                      style="bold red" if r.get("rank") == straggler else None)
    of = "CPU op time (no GPU kernels)" if spread.get("basis") == "cpu_ops" else "GPU kernel time"
    note = Text(f"spread of {of} {spread.get('spread_pct') or 0.0:.1f}% "
                f"({_ms(spread.get('min_ms'))} to {_ms(spread.get('max_ms'))} ms)")
    if straggler is not None:
        note.append(f"   straggler: rank {straggler}", style="bold red")
    return Group(table, note)


def _name(name: str) -> Text:
    return Text(name, no_wrap=True, overflow="ellipsis")


def _count(count: float | None) -> str:
    """Launches per rank: whole when the ranks agree, else a mean with two decimals; "-" when not counted."""
    return "-" if count is None else str(count) if isinstance(count, int) else f"{count:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
