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

from rich.table import Table

from harness.errors import InputError
from harness.results import find_sweeps, load_runs, read_json

METRICS = [("ttft_ms", "p50", "TTFT p50"), ("itl_ms", "p50", "ITL p50"), ("itl_ms", "p99", "ITL p99"),
           ("tpot_ms", "p50", "TPOT p50"), ("e2e_ms", "p50", "E2E p50")]


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


def _fmt(v, digits=1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def table(rows: list[dict], *, baseline: str | None = None, title: str = "configurations") -> Table:
    base = _baseline(rows, baseline)
    t = Table(title=title, header_style="bold")
    t.add_column("config")
    t.add_column("conc", justify="right")
    for _, _, label in METRICS:
        t.add_column(f"{label} ms", justify="right")
    t.add_column("tok/s", justify="right")
    if base:
        t.add_column(f"ITL vs {base[0]['config']}", justify="right")
    t.add_column("GPU time by category / top kernel")
    for row in rows:
        cells = [row["config"], str(row["concurrency"] or "-")]
        cells += [_fmt(row.get(f"{m}_{q}")) for m, q, _ in METRICS]
        cells.append(_fmt(row.get("output_tok_s")))
        if base:
            ref = next((b for b in base if b["concurrency"] == row["concurrency"]), None)
            cells.append(_delta(row.get("itl_ms_p50"), ref and ref.get("itl_ms_p50")))
        cells.append(_kernels(row))
        t.add_row(*cells, style="red" if row.get("error") and not row["ok"] else None)
    return t


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


def _kernels(row: dict) -> str:
    if row.get("error") and not row["ok"]:
        return row["error"][:80]
    a = row.get("analysis")
    if not a:
        return ""
    cats = sorted(a["categories"].items(), key=lambda kv: -kv[1])[:3]
    top = a["top"][0]["name"][:40] if a["top"] else ""
    return ", ".join(f"{c} {s * 100:.0f}%" for c, s in cats) + (f" | {top}" if top else "")


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
