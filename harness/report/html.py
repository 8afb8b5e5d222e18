"""`harness report`: the morning report of a sweep as one self-contained HTML file.

Everything is read from results directories (a colleague's are as good as yours) and everything the
page needs is inside it: CSS inline, charts as inline SVG (`harness.report.plots`), no script, no
font, no URL, so it opens offline, attaches to a mail and prints. The comparison rows are exactly
`harness compare`'s, roofline and reference misses included.
"""

from __future__ import annotations

import datetime as dt
import statistics
from pathlib import Path

import jinja2
from markupsafe import Markup

from harness.analysis.roofline import format_efficiency
from harness.errors import tail
from harness.report import plots, search_view, telemetry_view
from harness.report.analysis_view import short_name
from harness.report.compare import (
    collect,
    load_label,
    load_notes,
    max_load_text,
    number,
    percent,
    time_note,
    unreadable,
    winner,
    winner_text,
)
from harness.results import RunResult, atomic_write, find_sweeps, load_runs, samples

TEMPLATES = Path(__file__).parent / "templates"
QUANTILES = ("p1", "p25", "p50", "p75", "p99")


def render_report(paths: list[Path], *, baseline: str | None = None) -> str:
    """The report of every sweep under `paths`, as HTML text."""
    rows = collect(paths, baseline=baseline)
    sweeps = [s for p in paths for s in find_sweeps(p)]
    runs = [run for sweep_dir in sweeps for run in load_runs(sweep_dir)]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    colors = {c: plots.PALETTE[i % len(plots.PALETTE)] for i, c in enumerate(configs)}
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=_num, pct=_pct, eff=format_efficiency, share=_share, load=load_label,
                       max_load=max_load_text)
    return env.get_template("report.html.j2").render(
        title=", ".join(s.name for s in sweeps),
        generated=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        rows=rows, colors=colors, configs=_configs(runs), winner=(best := winner(rows)),
        winner_text=winner_text(best) if best else "",
        baseline=next((r["baseline"] for r in rows if r.get("baseline")), None),
        counts={"runs": len(runs), "ok": sum(r.manifest.status == "ok" for r in runs),
                "failed": sum(r.manifest.status == "failed" for r in runs),
                "misses": sum(len(r["misses"]) for r in rows)},
        charts=_charts(rows, runs, colors), workloads=_by_workload(rows, colors), kernels=_kernels(rows),
        failures=_failures(runs) + _unreadable(paths), hosts=_hosts(runs, rows),
        telemetry=_telemetry(rows, runs, colors),
        roofline=_roofline_facts(runs, rows), has_roofline=any(r.get("theoretical_ms") for r in rows),
        time_note=time_note(rows),
        load_notes="\n".join(line for line in load_notes(rows).splitlines() if not line.startswith("max load")),
        has_goodput=any(r.get("goodput_req_s") is not None for r in rows),
        max_loads={r["config"]: r["max_load"] for r in rows if r.get("max_load")},
        searches=_searches(paths))


def _searches(paths: list[Path]) -> list[dict]:
    """Each search's headline, trials (with what became of each), best and the best's launch command."""
    out = []
    for sweep_dir, found in search_view.searches(paths):
        best = found.best.number if found.best else None
        out.append({"headline": search_view.headline(found), "file": found, "best": search_view.best_text(found),
                    "launch": search_view.best_launch(sweep_dir, found),
                    "notes": {t.number: "best" if t.number == best else search_view.note(t.state, t.duplicate_of,
                                                                                         t.reason)
                              for t in found.trials}})
    return out


def write_report(paths: list[Path], output: Path, *, baseline: str | None = None) -> Path:
    atomic_write(output, render_report(paths, baseline=baseline))
    output.chmod(0o644)  # a page to share, unlike the temporary file it was written as
    return output


def _workloads(rows: list[dict]) -> dict[tuple[str | None, str], list[tuple[dict, float]]]:
    """The measured levels (max_load's probes left out) by workload, in the rows' order: (scenario,
    "concurrency" | "request_rate") -> [(row, its load)]; the single workload of the old keys is
    (None, "concurrency")."""
    out: dict[tuple[str | None, str], list[tuple[dict, float]]] = {}
    for r in rows:
        rate = r.get("request_rate")
        load = rate if rate is not None else r["concurrency"]
        if load and not r.get("probe"):
            kind = "request_rate" if rate is not None else "concurrency"
            out.setdefault((r.get("scenario"), kind), []).append((r, load))
    return out


LOAD_AXES = {"concurrency": "concurrency (requests in flight)", "request_rate": "request rate (requests a second)"}


def _by_workload(rows: list[dict], colors: dict[str, str]) -> list[dict]:
    """Per workload, throughput and ITL p50 against its load, a line per configuration."""
    out = []
    for (scenario, kind), levels in _workloads(rows).items():
        throughput: dict[str, list] = {}
        latency: dict[str, list] = {}
        for r, load in levels:
            if r.get("output_tok_s"):
                throughput.setdefault(r["config"], []).append((load, r["output_tok_s"]))
            if r.get("itl_ms_p50"):
                latency.setdefault(r["config"], []).append((load, r["itl_ms_p50"]))
        axis = LOAD_AXES[kind]
        out.append({"title": f"scenario {scenario}" if scenario else "",
                    "against": "request rate" if kind == "request_rate" else "concurrency",
                    "throughput": Markup(plots.line_chart(throughput, colors, xlabel=axis, ylabel="output tokens/s"))
                    if throughput else None,
                    "latency": Markup(plots.line_chart(latency, colors, xlabel=axis, ylabel="ITL p50, ms"))
                    if latency else None})
    return out


def _charts(rows: list[dict], runs: list[RunResult], colors: dict[str, str]) -> dict[str, Markup]:
    charts = {}
    gpus = {c["name"]: c.get("gpus") or 1 for c in _configs(runs)}
    frontier: dict[str, list] = {}   # every configuration at every level of every scenario
    for (scenario, kind), levels in _workloads(rows).items():
        for r, load in levels:
            if r.get("output_tok_s") and r.get("tpot_ms_p50"):
                label = (f"{scenario} " if scenario else "") + (f"{load:g}/s" if kind == "request_rate" else f"c{load}")
                frontier.setdefault(r["config"], []).append(
                    (r["output_tok_s"] / gpus.get(r["config"], 1), 1000 / r["tpot_ms_p50"], label))
    if frontier:
        charts["pareto"] = plots.scatter_chart(frontier, colors, xlabel="output tokens/s per GPU",
                                               ylabel="tokens/s per user (1000 / TPOT p50)")
    for metric, label in (("itl_ms", "inter-token latency, ms"), ("ttft_ms", "time to first token, ms")):
        groups = _distributions(runs, metric, list(colors))
        if groups:
            charts[metric] = plots.box_chart(groups, colors, xlabel=label)
    analysed = {r["config"]: r["analysis"] for r in rows if r.get("analysis")}
    if analysed:
        decode = all(a.get("stage") == "decode" for a in analysed.values())
        charts["categories"] = plots.stacked_bars(
            [(name, a["categories"], f"{_num(a.get('per_step_ms'))} ms/step" if a.get("per_step_ms") else "")
             for name, a in analysed.items()],
            xlabel="share of GPU kernel time" + (" in decode steps" if decode else ""))
    return {k: Markup(v) for k, v in charts.items()}


TELEMETRY_CHARTS = (("kv_cache_usage_max", "KV-cache use, most in the level, %", 100.0),
                    ("gpu_power_w", "GPU power (mean, all GPUs), W", 1.0),
                    ("gpu_sm_clock_mhz", "SM clock (mean), MHz", 1.0))
"""The per-level telemetry figures drawn against concurrency: key, axis label, scale."""


def _telemetry(rows: list[dict], runs: list[RunResult], colors: dict[str, str]) -> dict | None:
    """The telemetry section: per level figures (the rows'), charts of them against concurrency, and
    per configuration the server's running and waiting requests over its first run, levels shaded."""
    shown = [r for r in rows if telemetry_view.has_figures(r.get("telemetry"))]
    notes = list(dict.fromkeys(n for r in rows for n in r.get("telemetry_notes") or []))
    if not shown:
        return {"rows": [], "charts": {}, "timelines": [], "notes": notes, "unsampled": None} if notes else None
    charts = {}
    closed = [r for r in shown if r["concurrency"] and not r.get("probe")]   # drawn: the first such workload's
    for key, label, scale in TELEMETRY_CHARTS:
        series: dict[str, list] = {}
        for r in closed:
            if r.get("scenario") == closed[0].get("scenario") and r["telemetry"].get(key) is not None:
                series.setdefault(r["config"], []).append((r["concurrency"], r["telemetry"][key] * scale))
        if series:
            charts[key] = Markup(plots.line_chart(series, colors, xlabel="concurrency (requests in flight)",
                                                  ylabel=label))
    return {"rows": shown, "charts": charts, "timelines": _timelines(runs, colors), "notes": notes,
            "unsampled": telemetry_view.unsampled(shown)}


def _timelines(runs: list[RunResult], colors: dict[str, str]) -> list[dict]:
    """Per configuration (its first ok run with telemetry): running and waiting requests against
    seconds since the sampler started, each level shaded."""
    out: dict[str, dict] = {}
    for run in runs:
        name, t = run.manifest.config.name, run.telemetry
        if name in out or not run.manifest.ok or t is None or not run.levels:
            continue
        start = min((x.t_ns for x in t.lines), default=0)
        series: dict[str, list] = {}
        for metric in t.metrics:
            if metric.key in ("running", "waiting"):
                pts = [((s.t_ns - start) / 1e9, v) for s in t.samples("metrics")
                       if (v := telemetry_view.value_of(s.values, metric)) is not None]
                if pts:
                    series[metric.key] = pts
        bands = [((lv.started_ns - start) / 1e9, (lv.ended_ns - start) / 1e9, f"c{lv.concurrency}")
                 for lv in run.levels if lv.started_ns is not None and lv.ended_ns is not None
                 and lv.trusted]   # a level refused as a whole may be refused for its clock
        if series:
            lines = {"running": colors.get(name, plots.PALETTE[0]), "waiting": "#bab0ac"}
            out[name] = {"config": name, "run_id": run.manifest.run_id, "chart": Markup(plots.time_chart(
                series, lines, bands=bands, xlabel="seconds since the sampler started", ylabel="requests"))}
    return list(out.values())


def _kernels(rows: list[dict]) -> list[dict]:
    """Per profiled configuration: GPU time a step and the kernel that takes the most of it."""
    out: dict[str, dict] = {}
    for r in rows:
        a = r.get("analysis")
        if a and r["config"] not in out:
            top = (a.get("top") or [{}])[0]
            out[r["config"]] = {"config": r["config"], "per_step_ms": a.get("per_step_ms"),
                                "stage": a.get("stage") or "all steps",
                                "top": top.get("name") or "–", "short": short_name(top.get("name") or "–"),
                                "share": top.get("share")}
    return list(out.values())


def _distributions(runs: list[RunResult], metric: str, order: list[str]) -> list[tuple[str, list[tuple[str, dict]]]]:
    """Per concurrency level, per configuration: quantiles of every sample in requests.jsonl (ITL gaps
    pooled over requests and repeats; one TTFT a request)."""
    pooled: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        if not run.manifest.ok:
            continue
        for req in run.requests:
            if req.get("error") or req.get("probe") or (values := samples(req, metric)) is None:
                continue
            where = load_label(req) if req.get("scenario") else f"concurrency {req.get('concurrency')}"
            pooled.setdefault(where, {}).setdefault(run.manifest.config.name, []).extend(values)
    groups = []
    for where, by_config in pooled.items():
        groups.append((where, [(c, _quantiles(by_config[c])) for c in order
                                               if len(by_config.get(c, [])) > 0]))
    return [g for g in groups if g[1]]


def _quantiles(values: list[float]) -> dict[str, float]:
    if len(values) == 1:
        return dict.fromkeys(QUANTILES, values[0])
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {q: cuts[int(q[1:]) - 1] for q in QUANTILES}


def _failures(runs: list[RunResult]) -> list[dict]:
    """Failed runs with their reason and the end of the server's log; skipped runs and ok runs that
    left no benchmark results (nothing of theirs is in the figures); failed profiles too (the run
    stands, but the breakdown is missing); figures its bench.json contradicts, left out as not measured."""
    out = []
    for run in runs:
        m = run.manifest
        if m.status == "failed":
            err = m.error
            log_tail = err.log_tail if err else None
            if not log_tail and run.layout.server_log.exists():
                log_tail = tail(run.layout.server_log.read_text(errors="replace"), 40)
            out.append({"run_id": m.run_id, "host": m.host.name, "kind": err and err.kind,
                        "message": err and err.message, "log_tail": log_tail})
        elif m.status == "skipped":
            out.append({"run_id": m.run_id, "host": m.host.name, "kind": "skipped",
                        "message": m.skipped or "never started", "log_tail": None})
        elif run.bench is None and not run.layout.bench.exists():   # an unreadable one is `_unreadable`'s
            out.append({"run_id": m.run_id, "host": m.host.name, "kind": "no benchmark results",
                        "message": f"{run.layout.bench.name} is missing", "log_tail": None})
        elif m.profile is not None and m.profile.status == "failed":
            out.append({"run_id": m.run_id, "host": m.host.name, "kind": "profile",
                        "message": m.profile.error, "log_tail": m.profile.hint})
        out += [{"run_id": m.run_id, "host": m.host.name, "kind": "not measured", "message": note,
                 "log_tail": None} for note in run.notes]
    return out


def _unreadable(paths: list[Path]) -> list[dict]:
    """Runs left out because their manifest cannot be read, as failures: the page counts none of them."""
    return [{"run_id": "", "host": None, "kind": "unreadable", "message": line, "log_tail": None}
            for line in unreadable(paths)]


def _hosts(runs: list[RunResult], rows: list[dict]) -> list[dict]:
    """What each host was, from the facts its first run recorded (each fact of the shape harness.facts
    writes; one of another shape is not shown)."""
    seen: dict[str, dict] = {}
    for run in runs:
        m = run.manifest
        host = m.host.model_dump()
        name = m.host.name or "?"
        if name in seen or not m.facts:
            continue
        facts = m.host_facts
        gpus = facts.gpus or []
        names = list(dict.fromkeys(g.name for g in gpus))
        gpu = ", ".join(f"{sum(g.name == n for g in gpus)} x {n}" for n in names) if gpus else (
            f"{host.get('gpus') or '?'} x {host['gpu']} (inventory)" if host.get("gpu") else "none reported")
        roof = next((r["roofline"] for r in rows if r.get("roofline") and name in r["hosts"]), None)
        seen[name] = {"name": name, "facts": {
            "GPUs": gpu,
            "GPU memory": f"{gpus[0].memory_total_mib} MiB" if gpus and gpus[0].memory_total_mib is not None else None,
            "driver": gpus[0].driver if gpus else None,
            "CUDA": facts.cuda,
            "bandwidth": f"{roof['bandwidth_gbs']:,.0f} GB/s per GPU ({roof['bandwidth_source']})" if roof else None,
            "engine": f"{m.engine} {facts.engine_version or ''}".strip(),
            "engine commit": facts.engine_git.commit if facts.engine_git else None,
            "python": facts.python,
            "kernel": facts.kernel,
            "packages": facts.pip_freeze,
            "environment": " ".join(f"{k}={v}" for k, v in (facts.env or {}).items()) or None,
            "address": host.get("address"), "venv": host.get("venv")}}
    return list(seen.values())


def _configs(runs: list[RunResult]) -> list[dict]:
    """Each configuration's description, flags and environment as its first run recorded them."""
    seen: dict[str, dict] = {}
    for run in runs:
        m, c = run.manifest, run.manifest.config
        seen.setdefault(c.name, {"name": c.name, "description": c.description, "args": c.args, "env": c.env,
                                 "unset": c.unset, "gpus": m.gpus_used, "engine": m.engine})
    return list(seen.values())


def _roofline_facts(runs: list[RunResult], rows: list[dict]) -> dict | None:
    """The model facts and the figures behind the roofline column, or None when it has none."""
    roof = next((r["roofline"] for r in rows if r.get("roofline")), None)
    if roof is None:
        return None
    model = next(r.manifest.model for r in runs if r.manifest.model is not None)
    return {"model": model.served_name or model.path, "active_params_b": model.active_params_b,
            "bytes_per_weight": model.bytes_per_weight, "kv_bytes_per_token": model.kv_bytes_per_token,
            "weight_gb": roof["weight_bytes"] / 1e9} | roof


def _num(v) -> str:
    return "–" if v is None else number(v)


def _share(v) -> str:
    return "–" if v is None else f"{v * 100:.0f}%"


def _pct(change) -> str:
    return "–" if change is None else percent(change)
