"""`harness analyze`: where the GPU time of a profiled run goes.

    analyze_path(path, top=15, steps=None) -> dict      SPEC's analysis.json ("harness.analysis/1")

PATH is one trace file, a profile directory (one file per rank) or a run directory (its profile/,
with the step count from its manifest.json). Each file is read once, streaming (see `kineto`), and
reduced to totals (see `summary`); this module only combines the ranks.

Conventions of the result:
- Every millisecond figure is per rank: the mean over the rank files of that rank's total. So
  `total_gpu_ms` is the mean of each rank's summed kernel time, a kernel's `total_ms` in `top` is its
  mean per rank, and `count` is launches per rank. Shares are fractions of all kernel time.
- `steps` comes from the caller, else the run's manifest (`profile.steps` or `profile.num_steps`), else
  vLLM's per-step annotations in the traces (the most any rank saw); `steps_source` says which.
  `per_step_ms` = `total_gpu_ms` / `steps`.
- `gpu_idle_ms`: device-wide time with nothing running between each device's first and last kernel,
  mean over ranks; `gpu_idle_share` is that idle time over the same window.
- `rank_spread`: min and max of the ranks' kernel totals, `spread_pct` = (max - min) / median, and the
  `straggler`: the rank furthest above the median, named only when it is more than 5% above.
"""

from __future__ import annotations

import json
import os
import statistics
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from harness.analysis.categories import NAMES, categorize
from harness.analysis.kineto import event_start_at, is_gzip
from harness.analysis.summary import FileSummary, Totals, summarize, summarize_range
from harness.errors import InputError

SCHEMA = "harness.analysis/1"
TRACE_PATTERNS = ("*.trace.json", "*.trace.json.gz", "*.json.gz")
"""Kineto files as SGLang (`*.trace.json.gz`) and vLLM (`*.pt.trace.json[.gz]`) name them."""
PARALLEL_MIN_BYTES = 64 << 20
"""Below this much trace in all, starting worker processes costs more than reading serially."""
RANGE_MIN_BYTES = 32 << 20
"""A plain file this large is shared between processes when there are fewer files than cores."""
STRAGGLER_PCT = 5.0

__all__ = ["SCHEMA", "analyze_path"]


def analyze_path(path: Path, *, top: int = 15, steps: int | None = None) -> dict:
    """The analysis.json of a trace file, a profile directory or a run directory."""
    path = Path(path)
    files, manifest_steps = _locate(path)
    summaries = _summarize_all(files)
    steps_source = "argument" if steps else None
    if not steps and manifest_steps:
        steps, steps_source = manifest_steps, "manifest"
    if not steps:
        steps = max((s.steps for s in summaries if s.steps), default=None)
        steps_source = "annotations" if steps else None
    return _combine(summaries, top=top, steps=steps, steps_source=steps_source)


def _locate(path: Path) -> tuple[list[Path], int | None]:
    """The trace files to read, and the step count a run directory's manifest records."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise InputError("no such trace file or directory", file=str(path))
    manifest_steps = None
    if (path / "profile").is_dir():
        manifest_steps = _manifest_steps(path / "manifest.json")
        path = path / "profile"
    found = {p for pattern in TRACE_PATTERNS for p in path.rglob(pattern) if p.is_file()}
    if not found:
        raise InputError(f"no trace files ({', '.join(TRACE_PATTERNS)}) in this directory",
                         file=str(path))
    return _per_rank(sorted(found)), manifest_steps


def _per_rank(files: list[Path]) -> list[Path]:
    """Drop files that repeat what the per-rank files hold.

    SGLang's `merge_profiles` adds `merged-*.trace.json.gz` (every rank in one file); its
    `profile_by_stage` splits each rank into `-EXTEND` and `-DECODE` files, and decode is what the
    step figures are about.
    """
    files = [f for f in files if not f.name.startswith("merged-")] or files
    return [f for f in files if "-DECODE" in f.name] or files


def _manifest_steps(manifest: Path) -> int | None:
    """`profile.steps`, else the playbook's `profile.num_steps`, from a run's manifest.json."""
    if not manifest.is_file():
        return None
    try:
        recorded = json.loads(manifest.read_text())
    except (ValueError, OSError) as e:
        raise InputError(f"unreadable run manifest: {e}", file=str(manifest)) from e
    profile = recorded.get("profile") if isinstance(recorded, dict) else None
    if not isinstance(profile, dict):
        return None
    steps = profile.get("steps") or profile.get("num_steps")
    return steps if isinstance(steps, int) and steps > 0 else None


def _summarize_all(files: list[Path]) -> list[FileSummary]:
    """One summary per file, read by this process and worker processes when there is enough to read
    to pay for starting them. One large plain file is cut into byte ranges at event boundaries."""
    cpus = os.cpu_count() or 1
    if cpus < 2 or sum(f.stat().st_size for f in files) < PARALLEL_MIN_BYTES:
        return [summarize(f) for f in files]
    pieces = max(1, cpus // len(files))
    tasks = [(i, start, stop) for i, f in enumerate(files) for start, stop in _ranges(f, pieces)]
    # spawn, not fork: the caller may be a threaded sweep holding SSH connections.
    with ProcessPoolExecutor(min(cpus, len(tasks)) - 1 or 1, mp_context=get_context("spawn")) as pool:
        later = [pool.submit(summarize_range, files[i], start, stop) for i, start, stop in tasks[1:]]
        i, start, stop = tasks[0]
        results = [summarize_range(files[i], start, stop)] + [f.result() for f in later]
    joined: dict[int, Totals] = {}
    for (i, _, _), totals in zip(tasks, results):
        joined[i] = joined[i].then(totals) if i in joined else totals
    return [joined[i].finish(f) for i, f in enumerate(files)]


def _ranges(path: Path, pieces: int) -> list[tuple[int, int | None]]:
    """Byte ranges of a plain file that each start at an event (the first at the file's start)."""
    size = path.stat().st_size
    if pieces < 2 or size < RANGE_MIN_BYTES or is_gzip(path):
        return [(0, None)]
    starts = [0]
    for k in range(1, pieces):
        start = event_start_at(path, size * k // pieces)
        if start is not None and start > starts[-1]:
            starts.append(start)
    return list(zip(starts, starts[1:] + [None]))


def _combine(summaries: list[FileSummary], *, top: int, steps: int | None,
             steps_source: str | None) -> dict:
    """The ranks' totals as one analysis.json (per-rank means; see the module docstring)."""
    n = len(summaries)
    kernels: dict[str, list] = {}
    cpu_ops: dict[str, list] = {}
    copy_names: set[str] = set()
    for s in summaries:
        _merge(kernels, s.kernels)
        _merge(cpu_ops, s.cpu_ops)
        copy_names |= s.copy_names
    kernel_us = sum(total for total, _ in kernels.values())
    category_us = dict.fromkeys(NAMES, 0.0)
    for name, (total, _) in kernels.items():
        category_us["copy" if name in copy_names else categorize(name)] += total

    ranked = sorted(kernels.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    cpu_ranked = sorted(cpu_ops.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    ranks = _ranks(summaries)
    window_us = sum(s.window_us for s in summaries)
    idle_us = sum(s.idle_us for s in summaries)
    return {
        "schema": SCHEMA,
        "files": [{"name": s.path.name, "rank": r["rank"], "bytes": s.path.stat().st_size}
                  for s, r in zip(summaries, ranks)],
        "steps": steps,
        "steps_source": steps_source,
        "per_step_ms": _ms(kernel_us / n / steps) if steps else None,
        "total_gpu_ms": _ms(kernel_us / n),
        "gpu_idle_ms": _ms(idle_us / n),
        "gpu_idle_share": _share(idle_us, window_us),
        "top": [{"name": name, "category": "copy" if name in copy_names else categorize(name),
                 "total_ms": _ms(total / n), "share": _share(total, kernel_us), "count": _per(count, n)}
                for name, (total, count) in ranked],
        "categories": {cat: _share(us, kernel_us) for cat, us in category_us.items()},
        "cpu_top": [{"name": name, "self_ms": _ms(self_us / n), "count": _per(count, n)}
                    for name, (self_us, count) in cpu_ranked],
        "ranks": ranks,
        "rank_spread": _spread(ranks),
    }


def _ranks(summaries: list[FileSummary]) -> list[dict]:
    """One entry per file; a file whose rank is unknown takes its position among the files."""
    out = []
    for index, s in enumerate(summaries):
        kernel_us = s.kernel_us
        top3 = sorted(s.kernels.items(), key=lambda kv: kv[1][0], reverse=True)[:3]
        out.append({
            "rank": s.rank if s.rank is not None else index,
            "file": s.path.name,
            "total_gpu_ms": _ms(kernel_us),
            "idle_ms": _ms(s.idle_us),
            "top3": [{"name": name, "total_ms": _ms(total), "share": _share(total, kernel_us)}
                     for name, (total, _) in top3],
        })
    return out


def _spread(ranks: list[dict]) -> dict:
    totals = [r["total_gpu_ms"] for r in ranks]
    median = statistics.median(totals)
    lo, hi = min(totals), max(totals)
    slowest = max(ranks, key=lambda r: r["total_gpu_ms"])
    above_pct = (slowest["total_gpu_ms"] - median) / median * 100 if median else 0.0
    return {
        "min_ms": lo,
        "max_ms": hi,
        "spread_pct": round((hi - lo) / median * 100, 2) if median else 0.0,
        "straggler": slowest["rank"] if above_pct > STRAGGLER_PCT else None,
    }


def _merge(into: dict[str, list], totals: dict[str, list]) -> None:
    for name, (value, count) in totals.items():
        stat = into.setdefault(name, [0.0, 0])
        stat[0] += value
        stat[1] += count


def _ms(us: float) -> float:
    return round(us / 1000.0, 4)


def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def _per(count: int, n: int) -> int | float:
    """Launches per rank: a whole number when the ranks agree, as they do when they ran in lockstep."""
    return count // n if count % n == 0 else round(count / n, 2)
