"""A search's trials and its best, from search.json alone (the sweep's end, compare, the report).

It reads what harness.search wrote, never the study, so nothing here loads Optuna.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich import box
from rich.console import Group
from rich.text import Text

from harness.report.escape import printable
from harness.report.plain import PlainTable
from harness.results import SearchFile, SweepLayout, Unreadable, find_sweeps, load_run, read_search


def searches(paths: list[Path]) -> list[tuple[Path, SearchFile]]:
    """Every search among the sweeps under `paths`, with its sweep folder."""
    out = []
    for sweep_dir in (s for p in paths for s in find_sweeps(p)):
        found = read_search(SweepLayout(sweep_dir))
        if found is not None:
            out.append((sweep_dir, found))
    return out


def best_launch(sweep_dir: Path, search: SearchFile) -> str | None:
    """The launch command of the search's best run."""
    if search.best is None or search.best.run_id is None:
        return None
    try:
        return load_run(SweepLayout(sweep_dir).run(search.best.run_id)).launch_command
    except Unreadable:
        return None


def fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def headline(search: SearchFile) -> str:
    at = f" at concurrency {search.level}" if search.level else " at the highest level"
    line = (f"search (Optuna TPE): {search.runs} of {search.budget} runs, {search.direction} {search.objective}{at}")
    return line + (f"; stopped: {search.stopped}" if search.stopped else "")


def best_text(search: SearchFile) -> str | None:
    b = search.best
    if b is None:
        return None
    return f"best: trial {b.number}, {b.config}, {search.objective} {fmt(b.value)}"


def note(trial_state: str, duplicate_of: int | None, reason: str | None) -> str:
    if trial_state == "duplicate":
        return f"ran as trial {duplicate_of}"
    if trial_state == "failed":
        return f"failed: {reason}" if reason else "failed"
    if trial_state == "interrupted":
        return "interrupted: --resume runs it again"
    return "running" if trial_state == "running" else ""


def render_search(search: SearchFile) -> Group:
    t = PlainTable(title=headline(search), title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                   pad_edge=False, collapse_padding=True)
    t.add_column("trial", justify="right", no_wrap=True)
    t.add_column("config", overflow="fold")
    t.add_column(search.objective, justify="right", no_wrap=True)
    t.add_column("", overflow="fold")
    best = search.best.number if search.best else None
    for trial in search.trials:
        t.add_row(str(trial.number), trial.config or "-", fmt(trial.value),
                  "best" if trial.number == best else note(trial.state, trial.duplicate_of, trial.reason),
                  style="bold" if trial.number == best else "red" if trial.state == "failed" else
                  "dim" if trial.state == "duplicate" else None)
    text = best_text(search)
    if text:
        return Group(t, Text(printable(text), style="bold"))
    if search.stopped:   # it asks no more: there is no best to wait for
        return Group(t, Text("no best: no trial has a value (every one failed: the reasons above)", style="red"))
    return Group(t, Text("no trial has a value yet", style="yellow"))


def render_searches(paths: list[Path]) -> list[tuple[Group, str | None]]:
    """Each search's table and best line, and the best run's launch command (printed whole, apart)."""
    return [(render_search(search), best_launch(sweep_dir, search)) for sweep_dir, search in searches(paths)]


def plan_text(plan: dict[str, Any]) -> str:
    """`harness plan`'s words for a search (harness.plan.search_plan)."""
    level = f"concurrency {plan['level']}" if plan["level"] else "the highest level measured"
    lines = [f"a search with Optuna's TPE: {plan['budget']} runs at most over {len(plan['hosts'])} host(s), one "
             f"trial per free host; {plan['direction']} {plan['objective']} at {level}"]
    if plan["patience"]:
        lines.append(f"stops early after {plan['patience']} runs in a row that do not beat the best")
    lines.append(f"the first {min(plan['startup_trials'], plan['budget'])} trials at random"
                 + (f" (random_state {plan['random_state']})" if plan["random_state"] is not None else ""))
    lines.append("space" + (f" ({plan['grid_size']} points as a grid):" if plan["grid_size"] else " (continuous):"))
    return "\n".join(lines + [f"  {line}" for line in plan["space"]])
