"""The results directory: one per sweep, written so that a kill at any instant leaves it consistent.

    RESULTS/<sweep_id>/sweep.json, journal.jsonl, summary.json, summary.csv, runs/<run_id>/...

Every file is written to a temporary name in the same directory, fsynced and renamed into place; a
reader (compare, report, resume) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

SUMMARY_FIELDS = ["run_id", "config", "host", "status", "error_kind", "concurrency", "completed", "failed",
                  "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_token_p50_ms", "tpot_p50_ms",
                  "e2e_p50_ms", "output_tok_s", "requests_per_s"]


def atomic_write(path: Path, data: bytes | str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def summary_rows(manifest: dict, bench: dict | None) -> list[dict]:
    """One row per run and concurrency level (one row with no level when the run has no benchmark)."""
    base = {"run_id": manifest["run_id"], "config": manifest["config"]["name"],
            "host": manifest["host"].get("name"), "status": manifest["status"],
            "error_kind": (manifest.get("error") or {}).get("kind")}
    levels = (bench or {}).get("levels") or []
    if not levels:
        return [base]
    rows = []
    for lv in levels:
        stat = lambda metric, q, lv=lv: (lv.get(metric) or {}).get(q)  # noqa: E731
        rows.append(base | {
            "concurrency": lv["concurrency"], "completed": lv["completed"], "failed": lv["failed"],
            "ttft_p50_ms": stat("ttft_ms", "p50"), "ttft_p99_ms": stat("ttft_ms", "p99"),
            "itl_p50_ms": stat("itl_ms", "p50"), "itl_p99_ms": stat("itl_ms", "p99"),
            "itl_token_p50_ms": stat("itl_token_ms", "p50"),
            "tpot_p50_ms": stat("tpot_ms", "p50"), "e2e_p50_ms": stat("e2e_ms", "p50"),
            "output_tok_s": lv.get("output_tok_s"), "requests_per_s": lv.get("requests_per_s")})
    return rows


def load_runs(sweep_dir: Path) -> list[tuple[dict, dict | None]]:
    """(manifest, bench) for every run with a manifest, in run-id order."""
    out = []
    try:  # the playbook's order, when the sweep recorded it
        order = {r["run_id"]: i for i, r in enumerate(read_json(Path(sweep_dir) / "sweep.json")["runs"])}
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        order = {}
    found = sorted((Path(sweep_dir) / "runs").glob("*/manifest.json"),
                   key=lambda p: (order.get(p.parent.name, len(order)), p.parent.name))
    for mf in found:
        bench_path = mf.parent / "bench.json"
        try:
            manifest = read_json(mf)
            bench = read_json(bench_path) if bench_path.exists() else None
        except (OSError, json.JSONDecodeError):
            continue  # a run being written right now; it will be read on the next pass
        out.append((manifest, bench))
    return out


def write_summary(sweep_dir: Path) -> list[dict]:
    rows = [row for manifest, bench in load_runs(sweep_dir) for row in summary_rows(manifest, bench)]
    write_json(sweep_dir / "summary.json", rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(sweep_dir / "summary.csv", buf.getvalue())
    return rows


def find_sweeps(path: Path) -> list[Path]:
    """A sweep directory itself, or every sweep directory inside a results directory."""
    path = Path(path)
    if (path / "sweep.json").exists() or (path / "runs").is_dir():
        return [path]
    return sorted(p.parent for p in path.glob("*/sweep.json"))


def latest_sweep(results: Path, name: str) -> Path:
    """The most recently started sweep of playbook `name` under `results` (what --resume continues)."""
    from harness.errors import InputError
    candidates = []
    for sweep_dir in find_sweeps(results):
        try:
            info = read_json(sweep_dir / "sweep.json")
        except (OSError, json.JSONDecodeError):
            continue
        if info.get("playbook", {}).get("name") == name:
            candidates.append((info.get("started") or 0, sweep_dir))
    if not candidates:
        raise InputError(f"no earlier sweep of playbook {name!r} to resume in {results}", key="--resume")
    return max(candidates)[1]
