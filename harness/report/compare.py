"""Configurations side by side, from results directories alone (a colleague's are as good as yours).

Rows: one per configuration and concurrency level (repeats of a configuration are pooled by their
median). Each row carries every statistic of TTFT, ITL, TPOT and E2E (`itl_ms_p50`, `ttft_ms_p99`, ...),
output tok/s, the roofline (`theoretical_ms`, `efficiency`: see `harness.analysis.roofline`), the moves of
ITL p50 and tok/s against the baseline configuration (`itl_vs_baseline`, `tok_s_vs_baseline`, as
fractions), the playbook's reference misses and, when the runs were profiled, where the GPU time went
(in the decode steps when the traces mark them: `analysis.stage` says "decode", else the whole trace).
Every format (table, json, csv, markdown) carries the same fields; the roofline's columns are left out
of the table and markdown when no run has roofline facts.

The simulated engine may run faster than the GPUs it models (HARNESS_SIM_TIME_SCALE): its latencies
are then the simulator's wall clock while its traces keep the modelled GPU's times. Rows carry
`time_scale` (1 for a real engine) and every view says which number is at which scale (`time_note`).
"""

from __future__ import annotations

import contextlib
import csv
import html
import io
import json
import math
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.text import Text

from harness.analysis.roofline import format_efficiency, roofline_for
from harness.errors import InputError
from harness.remote.stats import STATS
from harness.report import noise, telemetry_view
from harness.report.analysis_view import short_name
from harness.report.live import profile_warning
from harness.report.plain import PlainTable, printable
from harness.report.references import check_references, references_of
from harness.results import (
    BenchFile,
    BenchLevel,
    RunLayout,
    RunManifest,
    RunResult,
    SearchFile,
    SweepLayout,
    Unreadable,
    find_sweeps,
    load_run,
    load_runs,
    read_model,
    read_search,
    samples,
)
from harness.results.models import DISTRIBUTIONS
from harness.sim.knobs import recorded_time_scale

METRICS = [("ttft_ms", "p50", "TTFT\np50 ms"), ("itl_ms", "p50", "ITL\np50 ms"),
           ("itl_ms", "p99", "ITL\np99 ms"), ("tpot_ms", "p50", "TPOT\np50 ms")]
"""The statistics csv and markdown show (the terminal table all but TPOT, to fit 80 columns); rows carry
all of DISTRIBUTIONS x STATS."""
FIELDS = (["config", "scenario", "concurrency", "request_rate", "probe", "runs", "ok", "completed", "failed"]
          + [f"{m}_{q}" for m, q, _ in METRICS]
          + ["itl_token_ms_p50", "tokens_per_chunk", "output_tok_s", "goodput_req_s", "theoretical_ms", "efficiency",
             "baseline", "itl_vs_baseline", "tok_s_vs_baseline", "max_load", "misses", "error"])
"""The columns of csv and markdown, in order (json has every field of a row)."""


@dataclass(frozen=True)
class Sample:
    """One run at one level (level None: the run has no benchmark), as compare pools them."""
    run: RunResult
    level: BenchLevel | None

    @property
    def manifest(self) -> RunManifest:
        return self.run.manifest


BY = ("config", "sweep")
"""How compare pools runs: by configuration across every sweep given (repeats and sweeps become one
median), or by sweep (each sweep's configurations apart: before and after an engine upgrade)."""


def collect(paths: list[Path], *, baseline: str | None = None, by: str = "config") -> list[dict]:
    """One row per (configuration, concurrency), or per (sweep, configuration, concurrency) with
    `by="sweep"`; failed runs get a row with their error. Deltas are against `baseline`: a
    configuration (default: the first), or with `by="sweep"` a sweep (default: the first), whose row
    of the same configuration and level each row is compared with. Misses: against the sweeps'
    references."""
    if by not in BY:
        raise InputError(f"unknown --by {by!r}: {' or '.join(BY)}", key="--by")
    sweeps = [s for p in paths for s in find_sweeps(p)]
    if not sweeps:
        raise InputError("no sweep results here (expected sweep.json or runs/*/manifest.json)",
                         file=", ".join(map(str, paths)))
    groups: dict[tuple[str | None, str, tuple | None], list[Sample]] = {}
    labels = _sweep_labels(sweeps)
    for sweep_dir in sweeps:
        label = labels[sweep_dir] if by == "sweep" else None
        for run in load_runs(sweep_dir):
            levels: list[BenchLevel | None] = [*run.levels] or [None]
            for level in levels:
                key = (label, run.manifest.config.name, _level_key(level))
                groups.setdefault(key, []).append(Sample(run, level))
    rows = [_row(name, samples) | {"sweep": label} for (label, name, _), samples in groups.items()]
    loads = {(label, name): max_load([s.run for s in samples]) for (label, name, _), samples in groups.items()}
    for (label, name), found in list(loads.items()):
        if found is None:   # repeats and levels of one configuration: its runs all together
            loads[(label, name)] = max_load([s.run for (lb, n, _), ss in groups.items() if (lb, n) == (label, name)
                                             for s in ss])
    for row in rows:
        row["max_load"] = loads.get((row["sweep"], row["config"]))
    _objectives(rows, sweeps)
    misses = check_references(rows, references_of(sweeps))
    for row in rows:
        row["misses"] = [m.as_dict() for m in misses if (m.config, m.concurrency) == (row["config"], row["concurrency"])
                         and (row["sweep"] is None or m.config == row["config"])]
    if by == "sweep":
        _deltas_by_sweep(rows, baseline)
    else:
        _deltas(rows, baseline)
    return rows


def _objectives(rows: list[dict], sweeps: list[Path]) -> None:
    """A search's rows carry their trial's number (`trial`) and, at the level the objective is read at,
    its value (`objective`), from search.json."""
    for sweep_dir in sweeps:
        search = read_search(SweepLayout(sweep_dir))
        if search is None:
            continue
        trials = {t.config: t for t in search.trials if t.state != "duplicate" and t.config}
        for row in rows:
            trial = trials.get(row["config"])
            if trial is None:
                continue
            top = max((r["concurrency"] or 0 for r in rows if r["config"] == row["config"]), default=0)
            row["trial"] = trial.number
            if row["concurrency"] is not None and row["concurrency"] == (search.level or top):
                row["objective"] = trial.value


def _sweep_labels(sweeps: list[Path]) -> dict[Path, str]:
    """A sweep by its folder's name, or with the folder above it when two share a name (a colleague's
    copy of the same sweep)."""
    names = [s.name for s in sweeps]
    return {s: s.name if names.count(s.name) == 1 else f"{s.parent.name}/{s.name}" for s in sweeps}


def _deltas_by_sweep(rows: list[dict], sweep: str | None) -> None:
    """Each row against the same configuration at the same level in the baseline sweep; rows are then
    named `configuration @ sweep`."""
    sweeps = list(dict.fromkeys(r["sweep"] for r in rows))
    base = sweep or (sweeps[0] if sweeps else None)
    if base is not None and base not in sweeps:
        raise InputError(f"no sweep named {base!r} (have: {', '.join(sweeps)})", key="--baseline")
    ref = {(r["config"], level_of(r)): r for r in rows if r["sweep"] == base}
    for row in rows:
        other = ref.get((row["config"], level_of(row))) or {}
        row["itl_vs_baseline"] = _change(row.get("itl_ms_p50"), other.get("itl_ms_p50"))
        row["tok_s_vs_baseline"] = _change(row.get("output_tok_s"), other.get("output_tok_s"))
        _verdicts(row, other)
    for row in rows:
        row["configuration"] = row["config"]
        row["config"] = f"{row['config']} @ {row['sweep']}"
    for row in rows:
        paired = ref.get((row["configuration"], level_of(row)))
        row["baseline"] = paired["config"] if paired else None


def _level_key(level: BenchLevel | None) -> tuple | None:
    return level.key + (level.probe,) if level is not None else None


def level_of(row: dict) -> tuple:
    """What pairs a row with the baseline's: its scenario and load (a probe of max_load pairs with none
    but another probe)."""
    return (row.get("scenario"), row.get("request_rate"), row["concurrency"], bool(row.get("probe")))


def load_label(row: dict) -> str:
    """A row's load in a few characters: `8` (concurrency), `2.5/s` (request rate), after its scenario,
    with `*` for a probe of max_load."""
    rate = row.get("request_rate")
    load = f"{rate:g}/s" if rate is not None else str(row["concurrency"] or "-")
    return (f"{row['scenario']} " if row.get("scenario") else "") + load + ("*" if row.get("probe") else "")


def max_load(runs: Sequence[RunResult]) -> dict | None:
    """search.max_load's answer for one configuration, over its runs: the median of the loads found
    (runs where even the lowest load missed count in `runs`, not in the median), how many runs met
    the SLO at all, the probes a run used (the most), the scenario, kind and SLO."""
    found = [r.bench.max_load for r in runs if r.manifest.ok and r.bench is not None and r.bench.max_load]
    if not found:
        return None
    values = [m.value for m in found if m.met and m.value is not None]
    first = found[0]
    return {"scenario": first.scenario, "kind": first.kind, "value": _median(values), "met": bool(values),
            "runs": len(found), "runs_met": len(values), "probes": max(len(m.probes) for m in found),
            "slo": first.slo, "low": first.low, "high": first.high}


def max_load_text(m: dict) -> str:
    if not m["met"]:
        return "none met the SLO" + (f" (even {m['low']:g})" if m.get("low") is not None else "")
    value = f"{_fmt(m['value'])} req/s" if m["kind"] == "request_rate" else f"{m['value']:g} streams"
    some = f", {m['runs_met']} of {m['runs']} runs" if m["runs_met"] != m["runs"] else ""
    return f"{value} ({m['probes']} probes{some})"


def _row(config: str, runs: list[Sample]) -> dict:
    # a level bench.json contradicts as a whole (BenchFile.checked) gave no figure: not an ok run here
    ok = [s for s in runs if s.manifest.ok and s.level and s.level.trusted]
    levels = [s.level for s in ok if s.level]
    first_level = next((s.level for s in runs if s.level), None)
    concurrency = first_level.concurrency if first_level else None
    row: dict = {"config": config, "concurrency": concurrency, "runs": len(runs), "ok": len(ok),
                 "hosts": sorted({s.manifest.host.name for s in runs if s.manifest.host.name}),
                 "scenario": first_level.scenario if first_level else None,
                 "request_rate": first_level.request_rate if first_level else None,
                 "probe": bool(first_level and first_level.probe),
                 "workload": first_level.workload.model_dump() if first_level and first_level.workload else None}
    row["notes"] = list(dict.fromkeys([n for s in runs if s.level for n in s.run.level_notes(s.level)]
                                      + [n for s in runs for n in s.run.file_notes]))
    row["error"] = _why_no_figures(runs) or _notes_line(row["notes"])
    row["runs_failed"] = sum(s.manifest.status == "failed" for s in runs)
    counted = [s.level for s in runs if s.level and s.level.trusted]   # a refused level's counts are its lie
    row["completed"] = sum(lv.completed for lv in counted)
    row["failed"] = sum(lv.failed for lv in counted)
    for metric in DISTRIBUTIONS:
        for q in STATS:
            row[f"{metric}_{q}"] = _median([_figure(lv.stat(metric, q)) for lv in levels])
    for metric in ("output_tok_s", "requests_per_s", "tokens_per_chunk", "goodput_req_s", "achieved_rate_req_s"):
        row[metric] = _median([_figure(getattr(lv, metric)) for lv in levels])
    row["slo"] = next((lv.slo for lv in levels if lv.slo), None)
    row["slo_met"] = _slo_met(row["slo"], [lv for lv in counted if lv.slo is not None], row["runs_failed"])
    row["schedule_lag_ms_p99"] = _median([lv.stat("schedule_lag_ms", "p99") for lv in levels])
    row["prompt_tokens_mismatches"] = sum(lv.prompt_tokens_mismatches for lv in levels)
    first = (ok or runs)[0]
    roof = roofline_for(first.manifest, first.level, first.run.bench.prompt_tokens if first.run.bench else None)
    row["theoretical_ms"] = roof and roof["theoretical_ms"]
    row["theoretical_tok_s"] = roof and roof["theoretical_tok_s"]
    row["efficiency"] = roof["theoretical_ms"] / row["itl_ms_p50"] if roof and row["itl_ms_p50"] else None
    row["roofline"] = roof and {k: roof[k] for k in ("gpu", "bandwidth_gbs", "bandwidth_source", "gpus",
                                                     "context_tokens", "weight_bytes", "kv_bytes")}
    itl_ci, tok_ci = _intervals(ok)
    # an interval only beside its figure: a figure refused as not measured has no noise to judge
    row["itl_ms_p50_ci"] = itl_ci if row["itl_ms_p50"] is not None else None
    row["output_tok_s_ci"] = tok_ci if row["output_tok_s"] is not None else None
    row["launch"] = next((s.run.launch_command for s in ok if s.run.launch_command), None)
    row["analysis"] = _analysis(ok or runs)
    row["time_scale"] = _time_scale(ok or runs)
    row["profile_warning"] = next((w for s in runs if (w := profile_warning(s.manifest))), None)
    row["telemetry"] = telemetry_view.pooled([
        telemetry_view.level_summary(s.run.telemetry, s.level.started_ns, s.level.ended_ns)
        for s in ok if s.level and s.run.telemetry is not None])
    row["telemetry_notes"] = list(dict.fromkeys(n for s in ok if s.run.telemetry for n in s.run.telemetry.notes()))
    return row


def _slo_met(slo: dict | None, levels: Sequence[BenchLevel], runs_failed: int) -> bool | None:
    """Whether the row's levels meet the SLO: False when any level (of any run, failed or not) misses
    it; True only when every run is ok and every level says it meets it; None (not measured) else. A
    failed repeat's level used to be left out, and the row shown as meeting the SLO."""
    if slo is None:
        return None
    said = [lv.slo_met for lv in levels]
    if False in said:
        return False
    return True if said and all(said) and not runs_failed else None


def _notes_line(notes: list[str]) -> str | None:
    """A row's notes as its one error line: the first, and how many more."""
    if not notes:
        return None
    return notes[0] + (f" (and {len(notes) - 1} more)" if len(notes) > 1 else "")


def _why_no_figures(runs: Sequence[Sample]) -> str | None:
    """What keeps some of a row's runs out of its figures: the first failed run's error, else why a
    run was skipped, else that an ok run left no benchmark results (its bench.json missing or
    unreadable): a row without figures always says why."""
    failed = [s.manifest for s in runs if s.manifest.status == "failed"]
    if failed:
        err = failed[0].error
        return err.line() if err else "failed: no error recorded"
    skipped = [s.manifest for s in runs if s.manifest.status == "skipped"]
    if skipped:
        return f"skipped: {skipped[0].skipped or 'never started'}"
    lost = [s.run.layout for s in runs if s.manifest.ok and s.run.bench is None]
    if lost:
        bench = lost[0].bench
        return (f"no benchmark results: {bench.parent.name}/{bench.name} "
                + ("is unreadable" if bench.exists() else "is missing"))
    return None


def unreadable(paths: list[Path]) -> list[str]:
    """The files of a sweep that are there but cannot be read (cut short, or not what they should be),
    each with the key at fault and what is left out for it: a run's manifest.json (the run), a run's
    bench.json (its figures) and a search's search.json (its trials and best). Compare and the report
    say so. A run folder without a manifest is a run still going, not a fault."""
    out = []
    for layout in _run_layouts(paths):
        try:
            read_model(layout.manifest, RunManifest)
        except Unreadable as e:
            out.append(f"{e} (run {layout.run_id} left out)")
            continue
        if layout.bench.exists():
            try:
                read_model(layout.bench, BenchFile)   # as written: what it contradicts is not_measured's
            except Unreadable as e:
                out.append(f"{e} (the figures of run {layout.run_id} left out)")
    for sweep in (SweepLayout(s) for p in paths for s in find_sweeps(p)):
        if sweep.search.exists():
            try:
                read_model(sweep.search, SearchFile)
            except Unreadable as e:
                out.append(f"{e} (the search's trials left out)")
    return sorted(out)


def not_measured(paths: list[Path]) -> list[str]:
    """Every figure of a readable run that its bench.json contradicts (`RunResult.notes`): left out of
    the table as not measured, and said once more on stderr by `harness compare`."""
    notes = []
    for layout in _run_layouts(paths):
        with contextlib.suppress(Unreadable):
            notes += load_run(layout).notes
    return notes


def _run_layouts(paths: list[Path]) -> Iterator[RunLayout]:
    return (layout for p in paths for s in find_sweeps(p) for layout in SweepLayout(s).run_layouts())


def _time_scale(runs: Sequence[Sample]) -> float:
    """How fast the simulated engine ran against the GPUs it models (1: a real engine, or real speed)."""
    manifest = runs[0].manifest
    if manifest.engine != "sim":
        return 1.0
    return recorded_time_scale(manifest.config.env)


def time_note(rows: list[dict]) -> str | None:
    """What a reader must know when the simulator ran faster or slower than it models; None otherwise."""
    scales = {r["config"]: r.get("time_scale", 1.0) for r in rows}
    if all(v == 1.0 for v in scales.values()):
        return None
    distinct = sorted(set(scales.values()))
    if len(distinct) == 1:
        scale = distinct[0]
        how = f"time scale {scale:g}" + (f": {1 / scale:.3g}x faster than the GPUs it models" if scale else "")
        return (f"simulated engine at {how}. Latencies and tok/s are its wall clock; the GPU time of its "
                "traces is the modelled GPUs' (unscaled)")
    each = ", ".join(f"{c} {v:g}" for c, v in scales.items())
    return (f"simulated engine at different time scales ({each}): latencies and tok/s are its wall clock, "
            "so compare them only between configurations of one scale; the traces' GPU time is the "
            "modelled GPUs' (unscaled)")


def _intervals(ok: Sequence[Sample]) -> tuple[tuple[float, float] | None, ...]:
    """95% intervals of the median ITL p50 and tok/s: over the repeats, or for one run, over its
    requests (ITL only: tok/s is one figure a level)."""
    itl = [v for s in ok if s.level and (v := _figure(s.level.stat("itl_ms", "p50"))) is not None]
    tok = [v for s in ok if s.level and (v := _figure(s.level.output_tok_s)) is not None]
    if len(ok) >= 2:
        return noise.bootstrap_ci(itl), noise.bootstrap_ci(tok)
    if len(ok) == 1 and (level := ok[0].level) is not None:
        gaps = [g for r in ok[0].run.requests if r.get("concurrency") == level.concurrency
                and r.get("scenario") == level.scenario and r.get("request_rate") == level.request_rate
                and bool(r.get("probe")) == level.probe and not r.get("error")
                and isinstance(r.get("itl_ms"), list) and (g := samples(r, "itl_ms")) is not None]
        return noise.grouped_ci(gaps), None
    return None, None


def _verdicts(row: dict, ref: dict) -> None:
    """Whether each change against the baseline row is beyond the noise."""
    same = ref is row
    row["itl_verdict"] = None if same else noise.verdict(row.get("itl_ms_p50_ci"), ref.get("itl_ms_p50_ci"),
                                                         higher_is_better=False)
    row["tok_s_verdict"] = None if same else noise.verdict(row.get("output_tok_s_ci"), ref.get("output_tok_s_ci"),
                                                           higher_is_better=True)


def workload_of(row: dict) -> tuple[str | None, str]:
    """A row's workload: its scenario and load kind ("concurrency" or "request_rate")."""
    return row.get("scenario"), "request_rate" if row.get("request_rate") is not None else "concurrency"


def flaws(rows: list[dict]) -> dict[str, str]:
    """Why a configuration may not be named the winner, by configuration: a run of it failed (a failed
    repeat leaves only its lucky runs), or its bench.json contradicts itself. Its figures stay in the
    table; a winner is named among the others."""
    out: dict[str, str] = {}
    for r in rows:
        if r.get("runs_failed"):
            out.setdefault(r["config"], f"{r['runs_failed']} failed run{'s' if r['runs_failed'] > 1 else ''}")
        elif r.get("notes"):
            out.setdefault(r["config"], "figures its bench.json contradicts")
    return out


def _lost_requests(row: dict) -> str | None:
    """Why a row may not win at its load: it lost requests (a level that did serves the rest faster),
    unless it is a probe of max_load, whose losses merely miss the SLO."""
    if not row.get("failed") or row.get("probe"):
        return None
    return f"{row['failed']} failed requests at {load_label(row)}"


def winner(rows: list[dict]) -> dict | None:
    """The configuration of most tok/s at the highest load measured of one workload (the first the rows
    hold: its scenario and load kind; another scenario's rows are other work, not rivals), whether the
    intervals show it ahead of the next one, and its launch command.

    Never one with failures: a failed run or contradicted figures (`flaws`), or requests lost at the
    load it would win at. The load is the highest that the most configurations measured: a level only
    one configuration has (missing from the others, or one a host made up) is no contest won. The
    configurations left out are named (`left_out`), each with why."""
    flawed = flaws(rows)
    ok = [r for r in rows if r["ok"] and r.get("output_tok_s") and not r.get("probe") and r["config"] not in flawed]
    if not ok:
        return None
    workloads = list(dict.fromkeys(map(workload_of, ok)))
    scenario, kind = workloads[0]
    measured_some = {r["config"] for r in rows if r["concurrency"] is not None or r.get("request_rate") is not None}
    # rivals: the workload's configurations, and those whose runs all failed before measuring anything
    rivals = list(dict.fromkeys(r["config"] for r in rows
                                if workload_of(r) == (scenario, kind) or r["config"] not in measured_some))
    ok = [r for r in ok if workload_of(r) == (scenario, kind)]

    def load(row: dict) -> float:
        return (row["request_rate"] if kind == "request_rate" else row["concurrency"]) or 0

    measured = {x: len({r["config"] for r in ok if load(r) == x}) for x in map(load, ok)}
    top = max(measured, key=lambda x: (measured[x], x))
    lost = {r["config"]: why for r in ok if load(r) == top and (why := _lost_requests(r))}
    at = sorted((r for r in ok if load(r) == top and r["config"] not in lost), key=lambda r: -r["output_tok_s"])
    if not at:
        return None
    best, second = at[0], (at[1] if len(at) > 1 else None)
    judged = second and noise.verdict(best.get("output_tok_s_ci"), second.get("output_tok_s_ci"),
                                      higher_is_better=True)
    there = {r["config"] for r in at}
    where = f"{top:g} req/s" if kind == "request_rate" else f"concurrency {top:g}"
    why_not = flawed | lost
    left_out = [f"{c} ({why_not.get(c) or f'no figure at {where}'})" for c in rivals if c not in there]
    return {"config": best["config"], "concurrency": best["concurrency"], "request_rate": best.get("request_rate"),
            "scenario": scenario, "workloads": len(workloads), "output_tok_s": best["output_tok_s"],
            "ci": best.get("output_tok_s_ci"), "runner_up": second and second["config"],
            "runner_up_tok_s": second and second["output_tok_s"],
            "runner_up_ci": second and second.get("output_tok_s_ci"), "verdict": judged, "launch": best.get("launch"),
            "left_out": left_out}


def no_winner_text(rows: list[dict]) -> str | None:
    """Why `winner` named none although some configuration has figures (each has failures), else None;
    asked only where it named none."""
    if not any(r["ok"] and r.get("output_tok_s") for r in rows):
        return None
    why = flaws(rows)
    for r in rows:
        if r["config"] not in why and (lost := _lost_requests(r)):
            why[r["config"]] = lost
    return "no winner: " + "; ".join(f"{c}: {w}" for c, w in why.items())


def launch_line(rows: list[dict]) -> str | None:
    """`launch: COMMAND` of the winner, to print on one line of its own (soft wrap: copied whole)."""
    best = winner(rows)
    return f"launch: {best['launch']}" if best and best.get("launch") else None


def winner_text(w: dict) -> str:
    ci = f" [{_fmt(w['ci'][0])}-{_fmt(w['ci'][1])}]" if w.get("ci") else ""
    where = f" in scenario {w['scenario']}" if w.get("scenario") else ""
    if (w.get("workloads") or 1) > 1:
        where += f" (the first of {w['workloads']} workloads)"
    at = (f" at {w['request_rate']:g} req/s" if w.get("request_rate") is not None else
          f" at concurrency {w['concurrency']}" if w.get("concurrency") else "")
    line = f"winner{where}{at}: {w['config']}, {_fmt(w['output_tok_s'])} tok/s{ci}"
    if w.get("runner_up"):
        if w["verdict"] == "better":
            line += f", ahead of {w['runner_up']} beyond the noise"
        elif w["verdict"] == "within noise":
            line += f"; within the noise of {w['runner_up']} ({_fmt(w['runner_up_tok_s'])} tok/s): more repeats tell"
        else:
            single = [name for name, ci in ((w["config"], w.get("ci")), (w["runner_up"], w.get("runner_up_ci")))
                      if not ci]
            said = "one run each" if len(single) == 2 else f"{single[0]} has one run" if single else "too few runs"
            line += (f"; {w['runner_up']} next ({_fmt(w['runner_up_tok_s'])} tok/s), {said}: no interval "
                     "(`repeat:` 3 or more judges the noise)")
    if w.get("left_out"):
        line += f"; left out: {', '.join(w['left_out'])}"
    return line + (f"\nlaunch: {w['launch']}" if w.get("launch") else "")


def _figure(value: float | None) -> float | None:
    """A latency or a rate as bench.json gives it, None where no measurement can be: NaN, infinite or
    negative (the host wrote the file; such a value would pass for a figure, or stop the table)."""
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else None


def _deltas(rows: list[dict], name: str | None) -> None:
    """ITL p50 and tok/s of each row against the baseline configuration's row at the same level."""
    base = {level_of(r): r for r in _baseline(rows, name)}
    for row in rows:
        ref = base.get(level_of(row)) or {}
        row["baseline"] = ref.get("config")
        row["itl_vs_baseline"] = _change(row.get("itl_ms_p50"), ref.get("itl_ms_p50"))
        row["tok_s_vs_baseline"] = _change(row.get("output_tok_s"), ref.get("output_tok_s"))
        _verdicts(row, ref)


def _change(value: float | None, ref: float | None) -> float | None:
    return None if value is None or not ref else (value - ref) / ref


def _analysis(runs: Sequence[Sample]) -> dict | None:
    for sample in runs:
        a = sample.run.analysis
        if a is None or not a.top:
            continue  # not profiled, or a trace with no GPU kernels (a CPU run): nothing to rank
        scope, stage = a.decode_scope()
        return {"stage": stage or None, "categories": scope.categories, "category_ms": scope.category_ms,
                "top": [k.model_dump(exclude_none=True) for k in scope.top[:3]],
                "shares": {k.name: k.share for k in scope.top}, "per_step_ms": a.per_step_ms,
                "idle_ms": a.idle_ms_per_step(scope)}
    return None


def _fmt(v) -> str:
    return "-" if v is None else number(v)


def number(v: float) -> str:
    """A figure to three significant digits or more: `1,255`, `17.1`, `5.19`; in three figures from a
    billion on (`1e+308`), where a whole number would take the width of the table."""
    if abs(v) >= 1e9:
        return f"{v:.3g}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def table(rows: list[dict], *, title: str = "configurations"):
    """The metrics per configuration and level with the roofline and the baseline deltas, the failures
    and reference misses, then where each configuration's GPU time went."""
    base = next((r["baseline"] for r in rows if r.get("baseline")), None)
    if base and any(r.get("sweep") for r in rows):
        base = f"the same configuration @ {base.split(' @ ')[-1]}"
    roofline = any(r.get("theoretical_ms") for r in rows)
    noisy = any("within noise" in (r.get("itl_verdict"), r.get("tok_s_verdict")) for r in rows)
    notes = (["latencies in ms"] + [f"Δ vs {base}"] * bool(base)
             + ["≈ within the noise (95% intervals overlap)"] * noisy + ["eff = roofline / ITL p50"] * roofline)
    t = PlainTable(title=f"{title} ({', '.join(notes)})", header_style="bold",
                   title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("config", overflow="fold")   # a long name wraps; the numbers are never cut
    scenarios = any(r.get("scenario") for r in rows)
    t.add_column("load" if scenarios else "conc", justify="right", overflow="fold" if scenarios else "ellipsis",
                 no_wrap=not scenarios)
    t.add_column("req\ndone", justify="right", no_wrap=True)
    for _, _, label in METRICS[:3]:
        t.add_column(label.removesuffix(" ms"), justify="right", no_wrap=True)
    per_token = any((r.get("tokens_per_chunk") or 1) > 1.05 for r in rows)
    if per_token:  # chunks carried several tokens: per chunk and per token differ (docs/engines.md)
        t.add_column("ITL/tok\np50", justify="right", no_wrap=True)
    t.add_column("tok/s", justify="right", no_wrap=True)
    goodput = any(r.get("goodput_req_s") is not None for r in rows)
    if goodput:
        t.add_column("good\nreq/s", justify="right", no_wrap=True)
    if roofline:
        t.add_column("roof-\nline", justify="right", no_wrap=True)
        t.add_column("eff", justify="right", no_wrap=True)
    if base:
        t.add_column("Δ\nITL", justify="right", no_wrap=True)
        t.add_column("Δ\ntok/s", justify="right", no_wrap=True)
    for row in rows:
        requests = (row.get("completed") or 0) + (row.get("failed") or 0)
        done = Text(f"{row.get('completed') or 0}/{requests}", style="red" if row.get("failed") else "")
        cells = [row["config"], load_label(row), done if requests else "-"]
        cells += [_fmt(row.get(f"{m}_{q}")) for m, q, _ in METRICS[:3]]
        if per_token:
            cells.append(_fmt(row.get("itl_token_ms_p50")))
        cells.append(_fmt(row.get("output_tok_s")))
        if goodput:
            cells.append(Text(_fmt(row.get("goodput_req_s")), style="red" if row.get("slo_met") is False else ""))
        if roofline:
            cells += [_fmt(row.get("theoretical_ms")), format_efficiency(row.get("efficiency"))]
        if base:
            cells += [_judged(row.get("itl_vs_baseline"), row.get("itl_verdict")),
                      _judged(row.get("tok_s_vs_baseline"), row.get("tok_s_verdict"))]
        t.add_row(*cells, style="red" if (row.get("error") and not row["ok"]) or row.get("misses") else None)
    parts: list[RenderableType] = [t]
    if notes_load := load_notes(rows):
        parts.append(Text(printable(notes_load)))
    if note := time_note(rows):
        parts.append(Text(printable(f"note: {note}."), style="yellow"))
    problems = [f"{r['config']}: {r['error']}" for r in rows
                if r.get("error") and r["error"] != _notes_line(r.get("notes") or [])]
    problems += [f"{r['config']}: {n}" for r in rows for n in r.get("notes") or []]
    problems += [f"{r['config']}: {r['profile_warning']}" for r in rows if r.get("profile_warning")]
    problems += [f"reference missed: {m['message']}" for r in rows for m in r.get("misses") or []]
    if problems:
        parts.append(Text(printable("\n".join(dict.fromkeys(problems))), style="red"))
    if (telemetry := telemetry_table(rows)) is not None:
        parts += [Text(""), telemetry]
    kernels = _kernel_table(rows, base)
    if kernels and len(parts) > 1:
        parts.append(Text(""))
    best = winner(rows)   # its launch command follows the table, whole (`launch_line`): it is there to be copied
    ending = [Text(""), Text(printable(winner_text(best).partition("\n")[0]), style="bold")] if best else []
    if best is None and (none := no_winner_text(rows)) is not None:
        ending = [Text(""), Text(printable(none), style="bold red")]
    return Group(*parts, *([kernels] if kernels else []), *ending)


def load_notes(rows: list[dict]) -> str:
    """What the load column and goodput mean, and each configuration's max load, for under a table."""
    lines = []
    if any(r.get("probe") for r in rows):
        lines.append("* a probe of search.max_load")
    slo = next((r["slo"] for r in rows if r.get("slo") and not r.get("probe")), None)
    if slo:
        bounds = ", ".join(f"{k} {v:g}" for k, v in slo.items())
        lines.append(f"good req/s: completed requests within every bound ({bounds}) a second; red: the level misses it")
    loads = {r["config"]: r["max_load"] for r in rows if r.get("max_load")}
    for config, m in loads.items():
        bounds = "".join(f", {k} {v:g}" for k, v in m["slo"].items())
        lines.append(f"max load {config} ({m['scenario']}{bounds}): {max_load_text(m)}")
    return "\n".join(lines)


TELEMETRY_COLUMNS = [("running_mean", "run-\nning", "{:.1f}"), ("waiting_max", "wait\nmax", "{:.0f}"),
                     ("kv_cache_usage_max", "KV\nmax", "pct"), ("prefix_cache_hit_rate", "prefix\nhit", "pct"),
                     ("spec_acceptance", "spec\naccept", "pct"), ("gpu_sm_clock_mhz", "SM\nMHz", "{:,.0f}"),
                     ("gpu_power_w", "power\nW", "{:,.0f}"), ("gpu_utilization_pct", "GPU\nutil", "{:.0f}%"),
                     ("gpu_memory_used_mib", "mem\nGiB", "GiB")]
"""The telemetry table's columns (telemetry_view's figures): key, header, format; a column shows when
any row has it."""


def _telemetry_cell(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "pct":
        return f"{value * 100:.0f}%"
    if fmt == "GiB":
        return f"{value / 1024:.1f}"
    return fmt.format(value)


def telemetry_table(rows: list[dict]) -> Group | None:
    """Per configuration and level, what the server's /metrics and the GPUs said while it ran (means
    over the level, maxima where the header says so; the GPUs' power summed); None without any."""
    shown = [r for r in rows if telemetry_view.has_figures(r.get("telemetry"))]
    if not shown:
        notes = list(dict.fromkeys(n for r in rows for n in r.get("telemetry_notes") or []))
        return Group(Text(printable("telemetry: " + "; ".join(notes)), style="yellow")) if notes else None
    columns = [c for c in TELEMETRY_COLUMNS if any(r["telemetry"].get(c[0]) is not None for r in shown)]
    t = PlainTable(title="telemetry per level", header_style="bold", title_justify="left", box=box.SIMPLE_HEAD,
                   pad_edge=False, collapse_padding=True)
    t.add_column("config", overflow="fold")
    t.add_column("load" if any(r.get("scenario") for r in shown) else "conc", justify="right", no_wrap=True)
    for _, label, _ in columns:
        t.add_column(label, justify="right", no_wrap=True)
    for r in shown:
        tm = r["telemetry"]
        t.add_row(r["config"], load_label(r), *(_telemetry_cell(tm.get(k), f) for k, _, f in columns))
    notes = list(dict.fromkeys(n for r in rows for n in r.get("telemetry_notes") or []))
    power = any(k == "gpu_power_w" for k, _, _ in columns)
    parts: list[RenderableType] = [t, Text("means over each level; KV-cache use and waiting: maxima"
                                           + ("; power: all GPUs summed" if power else ""), style="dim")]
    if not all(r["telemetry"].get("bracketed") for r in shown):
        parts.append(Text("some levels lack a sample before or after them: counters (prefix hits, spec "
                          "acceptance) left out there", style="yellow"))
    if short := telemetry_view.unsampled(shown):
        parts.append(Text(printable(short), style="yellow"))
    if notes:
        parts.append(Text(printable("telemetry: " + "; ".join(notes)), style="yellow"))
    return Group(*parts)


class _Widest:
    """The first of several renderings that fits the console's width (else the last), where `give`
    columns may be won by wrapping (a long configuration name)."""

    def __init__(self, *choices: RenderableType, give: int = 0):
        self.choices, self.give = choices, give

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.update_width(10_000)
        yield next((c for c in self.choices
                    if Measurement.get(console, wide, c).maximum - self.give <= options.max_width), self.choices[-1])


CATEGORY_LABELS = {"communication": "comm", "elementwise": "elem-\nwise", "attention": "atten-\ntion"}
"""Narrow headers for the wide category names, so four of them fit 80 columns."""


def _kernel_table(rows: list[dict], baseline: str | None) -> Group | None:
    """Per configuration: GPU time by category (moves against the baseline in points), top kernels; of
    the decode steps where the traces mark them (column "steps": decode), else of the whole trace.
    The category table shows as many of the largest categories (up to 4) as fit the width."""
    per_config = {r["config"]: r["analysis"] for r in rows if r.get("analysis")}
    if not per_config:
        return None
    # each configuration's reference: the baseline configuration, or itself in the baseline sweep
    refs = {r["config"]: per_config.get(r.get("baseline") or "") for r in rows if r.get("analysis")}
    refs = {name: ref if ref is not a else None for name, a in per_config.items() if (ref := refs.get(name))}
    against = baseline
    if any(r.get("sweep") for r in rows):
        base_sweep = next((r["baseline"].split(" @ ")[-1] for r in rows if r.get("baseline")), None)
        against = f"the same configuration @ {base_sweep}" if base_sweep else None
    cats = sorted({c for a in per_config.values() for c in a["categories"]},
                  key=lambda c: -max(a["categories"].get(c, 0) for a in per_config.values()))[:4]
    modelled = " of the modelled GPUs" if time_note(rows) else ""
    title = (f"GPU time{modelled} a step by category, ms" + (f" (change in ms vs {against})" if refs else "")
             + "; idle: no kernel running")

    def ms(a: dict | None, c: str) -> float | None:
        """Kernel ms a step of category `c` (from its share, for an analysis written without category_ms)."""
        if a is None:
            return None
        if a.get("category_ms"):
            return a["category_ms"].get(c, 0.0)
        return a["categories"].get(c, 0.0) * a["per_step_ms"] if a.get("per_step_ms") is not None else None

    def change(value: float | None, ref_value: float | None) -> str:
        return "" if value is None or ref_value is None else f" {value - ref_value:+.2f}"

    def categories(shown: list[str]) -> PlainTable:
        t = PlainTable(title=title, header_style="bold", title_justify="left", box=box.SIMPLE_HEAD)
        t.add_column("config", overflow="fold")
        t.add_column("steps", no_wrap=True)
        t.add_column("GPU\nms/step", justify="right", no_wrap=True)
        t.add_column("idle\nms/step", justify="right", no_wrap=True)
        for c in shown:
            t.add_column(CATEGORY_LABELS.get(c, c), justify="right", no_wrap=True)
        for name, a in per_config.items():
            ref = refs.get(name) or {}
            cells = [name, a.get("stage") or "all",
                     _ms(a.get("per_step_ms")) + change(a.get("per_step_ms"), ref.get("per_step_ms")),
                     _ms(a.get("idle_ms")) + change(a.get("idle_ms"), ref.get("idle_ms"))]
            for c in shown:
                cells.append(_ms(ms(a, c)) + change(ms(a, c), ms(ref or None, c)))
            t.add_row(*cells)
        return t

    k = PlainTable(title=f"top kernels (share of those steps' kernel time{f', points vs {against}' if refs else ''})",
                   header_style="bold", title_justify="left", box=box.SIMPLE_HEAD)
    k.add_column("config", overflow="fold", min_width=min(18, max(map(len, per_config))))
    k.add_column("share", justify="right", no_wrap=True, min_width=9)
    k.add_column("kernel", overflow="fold", max_width=72)   # wrapped, never cut: its end tells kernels apart
    for name, a in per_config.items():
        ref_share = (refs.get(name) or {}).get("shares")
        for i, kernel in enumerate(a["top"]):
            moved = ("" if ref_share is None else
                     f" {(kernel['share'] - ref_share[kernel['name']]) * 100:+.0f}" if kernel["name"] in ref_share
                     else " new")   # not among the baseline's top kernels
            k.add_row(name if i == 0 else "", f"{kernel['share'] * 100:.0f}%{moved}", short_name(kernel["name"]),
                      end_section=i == len(a["top"]) - 1)
    give = max(0, max(map(len, per_config)) - 18)   # a longer name wraps at 18
    return Group(_Widest(*(categories(cats[:n]) for n in range(len(cats), 0, -1)), give=give), k)


def _ms(value: float | None) -> str:
    """Milliseconds a step, to the hundredth (a step is often a few ms)."""
    return "-" if value is None else f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2f}"


def _baseline(rows: list[dict], name: str | None) -> list[dict]:
    if name is None:
        name = rows[0]["config"] if rows else None
    base = [r for r in rows if r["config"] == name]
    if name is not None and not base:
        raise InputError(f"no configuration named {name!r} (have: "
                         f"{', '.join(dict.fromkeys(r['config'] for r in rows))})", key="--baseline")
    return base


def _pct(change: float | None) -> str:
    return "-" if change is None else percent(change)


def percent(change: float) -> str:
    """A change as a whole percentage, `+12%`; in three figures beyond ±99,999% (`+8e+306%`)."""
    points = change * 100
    return f"{points:+.3g}%" if abs(points) >= 1e5 else f"{round(points):+d}%"


def _judged(change: float | None, verdict: str | None) -> str:
    """A change, marked ≈ when the intervals say it is within the noise."""
    return ("≈" if verdict == "within noise" and change is not None else "") + _pct(change)


def _flat(row: dict) -> dict:
    """A row for csv and markdown: misses and the max load as one text each, the rest as it is."""
    return row | {"misses": "; ".join(m["message"] for m in row.get("misses") or []),
                  "max_load": max_load_text(row["max_load"]) if row.get("max_load") else ""}


def as_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2) + "\n"


def as_csv(rows: list[dict]) -> str:
    """FIELDS, then the telemetry figures of each level as `telemetry_<figure>` (empty where there is none):
    the same columns whatever the rows have, for scripts."""
    figures = [key for key, _, _ in TELEMETRY_COLUMNS]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=FIELDS + [f"telemetry_{k}" for k in figures], extrasaction="ignore")
    w.writeheader()
    w.writerows(_flat(r) | {f"telemetry_{k}": (r.get("telemetry") or {}).get(k) for k in figures} for r in rows)
    return buf.getvalue()


def as_markdown(rows: list[dict]) -> str:
    base = next((r["baseline"] for r in rows if r.get("baseline")), None)
    roofline = any(r.get("theoretical_ms") for r in rows)
    goodput = any(r.get("goodput_req_s") is not None for r in rows)
    head = (["config", "load"] + [label.replace("\n", " ") for *_, label in METRICS] + ["tok/s"]
            + ["goodput req/s"] * goodput
            + ["roofline ms", "efficiency"] * roofline
            + [f"ITL vs {base}", f"tok/s vs {base}", "misses", "error"])
    lines = ["| " + " | ".join(map(_md_cell, head)) + " |", "|" + "---|" * len(head)]
    for r in map(_flat, rows):
        cells = ([r["config"], load_label(r)] + [_fmt(r.get(f"{m}_{q}")) for m, q, _ in METRICS]
                 + [_fmt(r.get("output_tok_s"))] + [_fmt(r.get("goodput_req_s"))] * goodput
                 + [_fmt(r.get("theoretical_ms")), format_efficiency(r.get("efficiency"))] * roofline
                 + [_judged(r.get("itl_vs_baseline"), r.get("itl_verdict")),
                    _judged(r.get("tok_s_vs_baseline"), r.get("tok_s_verdict")), r["misses"] or "",
                    r.get("error") or ""])
        lines.append("| " + " | ".join(map(_md_cell, cells)) + " |")
    if any("within noise" in (r.get("itl_verdict"), r.get("tok_s_verdict")) for r in rows):
        lines += ["", "≈ within the noise (95% intervals overlap)"]
    note = time_note(rows)
    loads = _md_text(load_notes(rows))
    return ("\n".join(lines) + "\n" + ("\n" + "\n\n".join(loads.splitlines()) + "\n" if loads else "")
            + (f"\nNote: {_md_text(note)}.\n" if note else "")
            + _telemetry_markdown(rows))


def _md_text(text: str) -> str:
    """Text of a host's or a playbook's in markdown: a control character would reach the terminal it is
    printed on, and `<`, `>` and `&` be taken for HTML where the markdown is rendered (a name or an
    error holding `<script>`), so they are written as entities, which render as themselves."""
    return html.escape(printable(text), quote=False)


def _md_cell(text: str) -> str:
    """A cell of a markdown table on its one line (`_md_text`): a multi-line error or name would end the
    row, a `|` split it."""
    return _md_text(" ".join(text.splitlines())).replace("|", "\\|")


def _telemetry_markdown(rows: list[dict]) -> str:
    """The terminal's telemetry table as markdown ("" without telemetry)."""
    shown = [r for r in rows if telemetry_view.has_figures(r.get("telemetry"))]
    if not shown:
        return ""
    columns = [c for c in TELEMETRY_COLUMNS if any(r["telemetry"].get(c[0]) is not None for r in shown)]
    head = ["config", "load" if any(r.get("scenario") for r in shown) else "conc"]
    head += [label.replace("\n", " ").replace("- ", "") for _, label, _ in columns]
    lines = ["", "Telemetry per level (means; KV, wait: maxima; power: all GPUs):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in shown:
        cells = [r["config"], load_label(r)]
        cells += [_telemetry_cell(r["telemetry"].get(k), f) for k, _, f in columns]
        lines.append("| " + " | ".join(map(_md_cell, cells)) + " |")
    if short := telemetry_view.unsampled(shown):
        lines += ["", f"Note: {_md_text(short)}."]
    return "\n".join(lines) + "\n"
