"""Configurations side by side, from results directories alone (a colleague's are as good as yours).

Rows: one per configuration and concurrency level (repeats of a configuration are pooled by their
median). Columns: TTFT p50, ITL p50/p99, TPOT p50, output tok/s, and, when the runs were profiled,
the top kernel categories and how they moved against the baseline configuration.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from harness.errors import InputError
from harness.report.analysis_view import short_name
from harness.results import find_sweeps, load_runs, read_json

METRICS = [("ttft_ms", "p50", "TTFT\np50 ms"), ("itl_ms", "p50", "ITL\np50 ms"),
           ("itl_ms", "p99", "ITL\np99 ms"), ("tpot_ms", "p50", "TPOT\np50 ms")]


def collect(paths: list[Path]) -> list[dict]:
    """One row per (configuration, concurrency); failed runs get a row with their error."""
    sweeps = [s for p in paths for s in find_sweeps(p)]
    if not sweeps:
        raise InputError("no sweep results here (expected sweep.json or runs/*/manifest.json)",
                         file=", ".join(map(str, paths)))
    groups: dict[tuple[str, int | None], list[tuple[dict, dict | None]]] = {}
    order: list[tuple[str, int | None]] = []
    for sweep_dir in sweeps:
        for manifest, bench in load_runs(sweep_dir):
            levels = (bench or {}).get("levels") or [None]
            for level in levels:
                key = (manifest["config"]["name"], level and level["concurrency"])
                if key not in groups:
                    order.append(key)
                groups.setdefault(key, []).append((manifest | {"_dir": str(sweep_dir)}, level))
    return [_row(name, conc, groups[(name, conc)]) for name, conc in order]


def _row(config: str, concurrency: int | None, runs: list[tuple[dict, dict | None]]) -> dict:
    ok = [(m, lv) for m, lv in runs if m["status"] == "ok" and lv]
    row: dict = {"config": config, "concurrency": concurrency, "runs": len(runs), "ok": len(ok),
                 "hosts": sorted({m["host"].get("name") for m, _ in runs if m.get("host")})}
    failed = [m for m, _ in runs if m["status"] != "ok"]
    if failed:
        err = failed[0].get("error") or {}
        row["error"] = f"{err.get('kind')}: {err.get('message', '')}".strip()
    for metric, q, _ in METRICS:
        values = [lv[metric][q] for _, lv in ok if lv.get(metric) and lv[metric].get(q) is not None]
        row[f"{metric}_{q}"] = statistics.median(values) if values else None
    tok_s = [lv["output_tok_s"] for _, lv in ok if lv.get("output_tok_s") is not None]
    row["output_tok_s"] = statistics.median(tok_s) if tok_s else None
    row["analysis"] = _analysis(ok or runs)
    return row


def _analysis(runs: list[tuple[dict, dict | None]]) -> dict | None:
    for manifest, _ in runs:
        path = Path(manifest["_dir"]) / "runs" / manifest["run_id"] / "analysis.json"
        if path.exists():
            try:
                a = read_json(path)
            except (OSError, json.JSONDecodeError):
                continue
            return {"categories": a.get("categories") or {}, "top": (a.get("top") or [])[:3],
                    "per_step_ms": a.get("per_step_ms")}
    return None


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def table(rows: list[dict], *, baseline: str | None = None, title: str = "configurations"):
    """The metrics per configuration and level, then where each configuration's GPU time went."""
    base = _baseline(rows, baseline)
    t = Table(title=title, header_style="bold", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("config", no_wrap=True)
    t.add_column("conc", justify="right", no_wrap=True)
    for _, _, label in METRICS:
        t.add_column(label, justify="right", no_wrap=True)
    t.add_column("tok/s", justify="right", no_wrap=True)
    if base:
        t.add_column(f"ITL vs\n{base[0]['config']}", justify="right", no_wrap=True)
    failed = [r for r in rows if r.get("error")]
    for row in rows:
        cells = [row["config"], str(row["concurrency"] or "-")]
        cells += [_fmt(row.get(f"{m}_{q}")) for m, q, _ in METRICS]
        cells.append(_fmt(row.get("output_tok_s")))
        if base:
            ref = next((b for b in base if b["concurrency"] == row["concurrency"]), None)
            cells.append(_delta(row.get("itl_ms_p50"), ref and ref.get("itl_ms_p50")))
        t.add_row(*cells, style="red" if row.get("error") and not row["ok"] else None)
    parts = [t]
    if failed:
        parts.append(Text("\n".join(f"{r['config']}: {r['error']}" for r in failed), style="red"))
    kernels = _kernel_table(rows, base[0]["config"] if base else None)
    return Group(*parts, *([kernels] if kernels else []))


def _kernel_table(rows: list[dict], baseline: str | None) -> Group | None:
    """Per configuration: GPU time by category (moves against the baseline in points), top kernels."""
    per_config = {r["config"]: r["analysis"] for r in rows if r.get("analysis")}
    if not per_config:
        return None
    ref = per_config.get(baseline) if baseline else None
    cats = sorted({c for a in per_config.values() for c in a["categories"]},
                  key=lambda c: -max(a["categories"].get(c, 0) for a in per_config.values()))[:4]
    t = Table(title=f"GPU time by category (points vs {baseline})" if ref else "GPU time by category",
              header_style="bold", title_justify="left", box=box.SIMPLE_HEAD)
    t.add_column("config", no_wrap=True)
    t.add_column("GPU ms\n/step", justify="right", no_wrap=True)
    for c in cats:
        t.add_column(c, justify="right", no_wrap=True)
    k = Table(title="top kernel", header_style="bold", title_justify="left", box=box.SIMPLE_HEAD)
    k.add_column("config", no_wrap=True, min_width=max(map(len, per_config)))
    k.add_column("share", justify="right", no_wrap=True, min_width=5)
    k.add_column("kernel", overflow="ellipsis", no_wrap=True, max_width=60)
    for name, a in per_config.items():
        cells = [name, _fmt(a.get("per_step_ms"))]
        for c in cats:
            share = a["categories"].get(c, 0)
            moved = "" if not ref or name == baseline else f" {(share - ref['categories'].get(c, 0)) * 100:+.0f}"
            cells.append(f"{share * 100:.0f}%{moved}")
        t.add_row(*cells)
        if a["top"]:
            k.add_row(name, f"{a['top'][0]['share'] * 100:.0f}%", short_name(a["top"][0]["name"]))
    return Group(t, k)


def _baseline(rows: list[dict], name: str | None) -> list[dict]:
    if name is None:
        name = rows[0]["config"] if rows else None
    base = [r for r in rows if r["config"] == name]
    if name is not None and not base:
        raise InputError(f"no configuration named {name!r} (have: "
                         f"{', '.join(dict.fromkeys(r['config'] for r in rows))})", key="--baseline")
    return base


def _delta(value, ref) -> str:
    if value is None or not ref:
        return "-"
    return f"{(value - ref) / ref * 100:+.0f}%"


def as_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2)


def as_csv(rows: list[dict]) -> str:
    fields = ["config", "concurrency", "runs", "ok"] + [f"{m}_{q}" for m, q, _ in METRICS] + ["output_tok_s",
                                                                                              "error"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def as_markdown(rows: list[dict]) -> str:
    head = ["config", "conc"] + [f"{label} ms" for *_, label in METRICS] + ["tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["config"], str(r["concurrency"] or "-")] + [_fmt(r.get(f"{m}_{q}")) for m, q, _ in METRICS]
        lines.append("| " + " | ".join(cells + [_fmt(r.get("output_tok_s"))]) + " |")
    return "\n".join(lines) + "\n"
