"""`harness status`: where a sweep stands, read from its journal alone (running or finished)."""

from __future__ import annotations

import time
from pathlib import Path

from rich import box
from rich.console import Group
from rich.text import Text

from harness.errors import InputError
from harness.journal import read_journal
from harness.lock import describe, holder
from harness.report.live import how_long
from harness.report.plain import PlainTable, printable
from harness.results import SweepLayout, SweepRecord, find_sweeps, read_model, read_sweep

STYLE = {"ok": "green", "failed": "red", "running": "yellow", "retry": "yellow", "interrupted": "magenta",
         "skipped": "dim", "pending": "dim", "lost": "red"}


def sweep_status(path: Path) -> dict:
    sweeps = find_sweeps(path)
    if not sweeps:
        raise InputError("no sweep here (expected sweep.json and journal.jsonl)", file=str(path))
    layouts = [SweepLayout(d) for d in sweeps]
    sweep = max(layouts, key=lambda s: s.record.stat().st_mtime if s.record.exists() else 0)
    info = read_sweep(sweep)
    if info is None and sweep.record.exists():   # damaged, not missing: saying "stopped early" would mislead
        read_model(sweep.record, SweepRecord)    # raises, naming the file and what is wrong in it
    finished = info.finished if info else None
    runs: dict[str, dict] = {r.run_id: {"run_id": r.run_id, "state": "pending", "config": r.config}
                             for r in (info.runs if info else [])}
    for event in read_journal(sweep.journal):   # a line that is not UTF-8 is an error naming it
        run = runs.setdefault(event.run_id, {"run_id": event.run_id, "state": "pending"})
        run["state"] = event.state
        run["since"] = event.t
        for key in ("host", "attempt", "error_kind", "reason"):
            if getattr(event, key) is not None:
                run[key] = getattr(event, key)
        if event.state == "running":
            run["started"] = event.t
        if event.state in ("ok", "failed") and "started" in run:
            run["seconds"] = event.t - run["started"]
    running = holder(sweep.dir)
    if finished or running is None:  # no orchestrator hears back from these: they are lost
        for run in runs.values():
            if run["state"] in ("running", "retry"):
                run["state"] = "lost"
    # an interrupted sweep records its end too, with runs it never finished: it stopped, to be resumed
    unfinished = any(r["state"] in ("pending", "interrupted", "lost") for r in runs.values())
    counts: dict[str, int] = {}
    for run in runs.values():
        counts[run["state"]] = counts.get(run["state"], 0) + 1
    durations = [r["seconds"] for r in runs.values() if "seconds" in r]
    left = sum(counts.get(s, 0) for s in ("pending", "running", "retry", "interrupted"))
    active = max(1, counts.get("running", 0))
    eta = sum(durations) / len(durations) * left / active if durations and left and not finished else None
    return {"sweep_id": info.sweep_id if info else sweep.sweep_id, "dir": str(sweep.dir),
            "started": info.started if info else None, "finished": finished, "orchestrator": running,
            "counts": counts, "runs": list(runs.values()), "eta_s": eta,
            "state": "running" if running is not None else "finished" if finished and not unfinished else "stopped"}


def render(status: dict):
    t = PlainTable(title=f"{status['sweep_id']}", box=box.SIMPLE_HEAD, header_style="bold", title_justify="left")
    for col in ("run", "state", "host", "attempt", "time", "note"):
        t.add_column(col)
    now = time.time()
    for r in status["runs"]:
        took = r.get("seconds") or (now - r["started"] if r["state"] == "running" and "started" in r else None)
        t.add_row(r["run_id"], Text(r["state"], style=STYLE.get(r["state"], "")), r.get("host", ""),
                  str(r.get("attempt", "")), f"{took:.0f} s" if took else "",
                  r.get("error_kind") or r.get("reason") or "")
    counts = ", ".join(f"{n} {s}" for s, n in sorted(status["counts"].items()))
    state = {"running": f"running: {describe(status['orchestrator'])}", "finished": "finished",
             "stopped": "stopped before the end: finish it with `harness sweep PLAYBOOK --resume`"}[status["state"]]
    eta = f"; about {how_long(status['eta_s'])} left" if status["eta_s"] else ""
    return Group(t, Text(printable(f"{len(status['runs'])} runs: {counts} ({state}{eta})"), style="bold"))
