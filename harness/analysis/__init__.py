"""`harness analyze`: where the GPU time of a profiled run goes.

    analyze_path(path, top=15, requested_steps=None) -> dict      analysis.json, "harness.analysis/1" (docs/formats.md)

PATH is one trace file, a profile directory (one file per rank) or a run directory (its profile/,
with the step count its manifest.json asked for). Each file is read once, streaming (see `kineto`),
and reduced to totals (see `summary`); this module only combines the ranks. Which files are ranks,
and which rank each is, the engines' own naming says (`harness.engines.naming_for`); this module
names no engine.

Conventions of the result:
- Every millisecond figure is per rank: the mean over the rank files of that rank's total. So
  `total_gpu_ms` is the mean of each rank's summed kernel time, a kernel's `total_ms` in `top` is its
  mean per rank, and `count` is launches per rank. Shares are fractions of all kernel time (in a
  stage, of that stage's).
- `stages`: per stage the engine's own step spans mark (decode, prefill, verify, draft), its `steps`
  (step spans per rank), `step_ms` (their mean wall time), and the kernels that started inside its
  GPU spans: `total_gpu_ms`, `per_step_ms`, `top`, `categories`, `category_ms` (ms a step). The
  kernel figures a step are null when the trace has no GPU step spans (a CPU-only trace). Null when
  the trace marks no steps. `outside_steps_ms`: kernel time that started in no GPU step span.
- `steps`, `per_step_ms` and `category_ms` are the decode stage's (`steps_source` "trace"); when
  the trace marks no decode step, the steps asked of the profiler (the caller's, else the run's
  manifest `profile.steps` or `profile.num_steps`; "request") divide all kernel time; else null.
- `gpu_idle_ms`: device-wide time with nothing running between each device's first and last kernel,
  mean over ranks; `gpu_idle_share` is that idle time over the same window.
- `rank_spread`: min and max of the ranks' kernel totals, `spread_pct` = (max - min) / median, and the
  `straggler`: the rank furthest above the median, named only when it is more than 5% above.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from harness.analysis.categories import NAMES, categorize
from harness.analysis.kineto import INFLATE_ERRORS, event_starts_at, is_gzip, json_size
from harness.analysis.summary import FileSummary, Totals, summarize, summarize_range
from harness.engines import TraceNaming, naming_for
from harness.errors import InputError

if TYPE_CHECKING:
    from harness.results import RunLayout, RunManifest
    from harness.results.models import ProfileRecord

SCHEMA = "harness.analysis/1"
TRACE_PATTERNS = ("*.trace.json", "*.trace.json.gz", "*.json.gz")
"""Kineto files as torch (`*.pt.trace.json[.gz]`) and engines that name their own (`*.trace.json.gz`) write them."""
PARALLEL_MIN_BYTES = 64 << 20
"""Below this much trace text in all (a gzip'd file's inflated), starting worker processes costs more
than reading serially."""
RANGE_MIN_BYTES = 32 << 20
"""A file with this much text is shared between processes when there are fewer files than cores."""
SKIP_COST = 0.08
"""What inflating a gzip'd byte costs against inflating and reading it (0.08 s against 1.0 s for
262 MB here, with ISA-L): the reader of a later range inflates everything before it too, so a gzip'd
file's ranges grow shorter along it to end together."""
STRAGGLER_PCT = 5.0

__all__ = ["SCHEMA", "analyze_path"]


def analyze_path(path: Path, *, top: int = 15, requested_steps: int | None = None) -> dict:
    """The analysis.json of a trace file, a profile directory or a run directory. `requested_steps`
    (the steps asked of the profiler) only stands in for the steps the trace marks itself."""
    path = Path(path)
    files, naming, manifest_steps = _locate(path)
    summaries = _summarize_all(files)
    return _combine(summaries, naming, top=top, requested=requested_steps or manifest_steps)


def _locate(path: Path) -> tuple[list[Path], TraceNaming | None, int | None]:
    """The trace files to read, one per rank, the naming they follow, and the step count a run
    directory's manifest asked for."""
    if path.is_file():
        return [path], naming_for([path]), None
    if not path.is_dir():
        raise InputError("no such trace file or directory", file=str(path))
    layout, manifest = _run_folder(path)
    if layout is not None:
        path = layout.profile
    found = sorted({p for pattern in TRACE_PATTERNS for p in path.rglob(pattern) if p.is_file()}) \
        if path.is_dir() else []
    if not found:
        said = _profile_said(manifest.profile) if manifest is not None else ""
        raise InputError(f"no trace files ({', '.join(TRACE_PATTERNS)}) in this directory" + said,
                         file=str(path))
    naming = naming_for(found)
    return _per_rank(found, naming), naming, _manifest_steps(manifest.profile) if manifest is not None else None


def _per_rank(files: list[Path], naming: TraceNaming | None) -> list[Path]:
    """The files that hold one rank each, in rank order, as the engine that wrote them names them: no
    API front end, no file that repeats what the per-rank files hold (merged, or split by stage).
    Files no engine's naming knows (the harness's own torch wrapper's) are each a rank, by name."""
    if naming is None:
        return files
    ranks = set(naming.per_rank([f.name for f in files]))
    return sorted((f for f in files if f.name in ranks), key=lambda f: _numeric(naming.rank_key(f.name)))


def _numeric(key: tuple[str, ...] | None) -> tuple[int, ...]:
    """A rank key in number order (TP-2 before TP-10); a missing group sorts first."""
    return tuple(int(g) if g and g.isdigit() else -1 for g in key or ())


def _run_folder(path: Path) -> tuple[RunLayout, RunManifest] | tuple[None, None]:
    """The run folder `path` and its manifest; (None, None) when `path` is not one (it has no manifest)."""
    from harness.results import RunLayout, RunManifest, read_model  # only here: rank workers start without pydantic

    layout = RunLayout(path)
    return (layout, read_model(layout.manifest, RunManifest)) if layout.manifest.is_file() else (None, None)


def _profile_said(profile: ProfileRecord | None) -> str:
    """What the run's manifest records of its profile capture, for a run that brought no traces back."""
    if profile is None:
        return ": this run captured no profile (profile.mode none, or it failed before profiling)"
    said = f": the profile is {profile.status}: {profile.error or 'no files'}"
    if profile.answers:
        last = profile.answers[-1]
        said += f"; the engine's last answer: {last.get('call')} -> {last.get('status', last.get('answer'))} " \
                f"{str(last.get('body', ''))[:200]!r}"
    return said + (f" ({profile.hint})" if profile.hint else "")


def _manifest_steps(profile: ProfileRecord | None) -> int | None:
    """The steps the profile recorded (`steps`, from older harnesses), else those the playbook asked
    of it (`num_steps`)."""
    if profile is None:
        return None
    steps = (profile.model_extra or {}).get("steps") or profile.num_steps
    return steps if isinstance(steps, int) and steps > 0 else None


def _summarize_all(files: list[Path]) -> list[FileSummary]:
    """One summary per file, read by this process and worker processes (`worker`) when there is
    enough to read to pay for starting them: a process a core, each handed every n-th task. One
    large plain file is cut into byte ranges at event boundaries."""
    cpus = os.cpu_count() or 1
    if cpus < 2 or sum(json_size(f) or f.stat().st_size for f in files) < PARALLEL_MIN_BYTES:
        return [summarize(f) for f in files]
    pieces = max(1, cpus // len(files))
    tasks = [(f, start, stop) for f in files for start, stop in _ranges(f, pieces)]
    shares = [list(range(len(tasks)))[w::cpus] for w in range(min(cpus, len(tasks)))]
    workers = [(share, _start_worker([tasks[k] for k in share])) for share in shares[1:]]
    results = {k: summarize_range(*tasks[k]) for k in shares[0]}
    for share, proc in workers:
        results.update(zip(share, _worker_results(proc, [tasks[k] for k in share]), strict=True))
    joined: dict[Path, Totals] = {}
    for k, (f, _, _) in enumerate(tasks):
        joined[f] = joined[f].then(results[k]) if f in joined else results[k]
    return [joined[f].finish(f) for f in files]


Range = tuple[Path, int, int | None]


def _start_worker(ranges: list[Range]) -> subprocess.Popen | None:
    """A worker process reading these ranges, or None when none can be started (then they are read here)."""
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "harness.analysis.worker"]
    for path, start, stop in ranges:
        argv += [str(path), str(start), "-" if stop is None else str(stop)]
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=env)
    except OSError:
        return None


def _worker_results(proc: subprocess.Popen | None, ranges: list[Range]) -> list[Totals]:
    """A worker's totals; a worker that could not start or died is read again here, so a missing
    interpreter or a killed process costs time, never a wrong answer."""
    if proc is not None:
        out, _ = proc.communicate()
        status, value = "lost", None
        if proc.returncode == 0:
            with contextlib.suppress(pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
                                     ImportError):
                status, value = pickle.loads(out)
        if status == "ok" and isinstance(value, list) and len(value) == len(ranges) \
                and all(isinstance(t, Totals) for t in value):
            return value
        if status == "error":
            raise InputError(str(value))
    return [summarize_range(*r) for r in ranges]


def _ranges(path: Path, pieces: int) -> list[tuple[int, int | None]]:
    """Byte ranges of a file's JSON text that each start at an event (the first at the text's start).
    A gzip'd file's are found by inflating it once, up to the last (and each range's reader inflates
    it again up to its start, so they shorten along it). A file whose ranges cannot be found is read
    whole (a broken file then fails where it is read, naming itself)."""
    size = json_size(path) if pieces > 1 else None
    if size is None or size < RANGE_MIN_BYTES:
        return [(0, None)]
    starts = [0]
    points = _split_points(size, pieces, skip_cost=SKIP_COST if is_gzip(path) else 0.0)
    try:
        for start in event_starts_at(path, points):
            if start is not None and start > starts[-1]:
                starts.append(start)
    except INFLATE_ERRORS:
        return [(0, None)]
    return list(zip(starts, starts[1:] + [None], strict=True))


def _split_points(size: int, pieces: int, *, skip_cost: float) -> list[int]:
    """Where `pieces` ranges of `size` bytes meet so that their readers end together, when reaching a
    range costs `skip_cost` of reading it for every byte before it (0: equal ranges). Range k then
    costs skip_cost * x_k + (x_{k+1} - x_k) = C for all k, so x_k = C (1 - (1 - skip_cost)^k) / skip_cost."""
    if not skip_cost:
        return [size * k // pieces for k in range(1, pieces)]
    keep = 1 - skip_cost
    return [round(size * (1 - keep ** k) / (1 - keep ** pieces)) for k in range(1, pieces)]


def _combine(summaries: list[FileSummary], naming: TraceNaming | None, *, top: int,
             requested: int | None) -> dict:
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
    category_us = _category_us(kernels, copy_names)
    split = any(s.gpu_spans for s in summaries)
    stages = _stages(summaries, copy_names, top=top, split=split)
    decode = (stages or {}).get("decode")
    steps_source: str | None
    if decode:
        steps, steps_source = decode["steps"], "trace"
        per_step_ms, category_ms = decode["per_step_ms"], decode["category_ms"]
    elif requested:
        steps, steps_source = requested, "request"
        per_step_ms = _ms(kernel_us / n / requested)
        category_ms = {cat: _ms(us / n / requested) for cat, us in category_us.items()}
    else:
        steps = steps_source = per_step_ms = category_ms = None
    staged_us = sum(total for s in summaries for stage in s.stage_kernels.values() for total, _ in stage.values())

    cpu_ranked = sorted(cpu_ops.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    ranks = _ranks(summaries, naming)
    window_us = sum(s.window_us for s in summaries)
    idle_us = sum(s.idle_us for s in summaries)
    return {
        "schema": SCHEMA,
        "files": [{"name": s.path.name, "rank": r["rank"], "bytes": s.path.stat().st_size}
                  for s, r in zip(summaries, ranks, strict=True)],
        "steps": steps,
        "steps_source": steps_source,
        "per_step_ms": per_step_ms,
        "category_ms": category_ms,
        "total_gpu_ms": _ms(kernel_us / n),
        "outside_steps_ms": _ms((kernel_us - staged_us) / n) if split else None,
        "gpu_idle_ms": _ms(idle_us / n),
        "gpu_idle_share": _share(idle_us, window_us),
        "top": _top(kernels, copy_names, n, top),
        "categories": {cat: _share(us, kernel_us) for cat, us in category_us.items()},
        "stages": stages,
        "cpu_top": [{"name": name, "self_ms": _ms(self_us / n), "count": _per(count, n)}
                    for name, (self_us, count) in cpu_ranked],
        "ranks": ranks,
        "rank_spread": _spread(ranks),
    }


def _stages(summaries: list[FileSummary], copy_names: set[str], *, top: int, split: bool) -> dict | None:
    """Per stage of the steps the traces mark (decode first, then by steps), what its steps took;
    `split`: whether any GPU step span says which kernels ran in which step."""
    n = len(summaries)
    steps: dict[str, list] = {}
    kernels: dict[str, dict[str, list]] = {}
    for s in summaries:
        _merge(steps, s.steps)
        for stage, totals in s.stage_kernels.items():
            _merge(kernels.setdefault(stage, {}), totals)
    if not steps:
        return None
    order = sorted(steps, key=lambda stage: (stage != "decode", -steps[stage][0], stage))
    return {stage: _stage(steps[stage][0], steps[stage][1], kernels.get(stage, {}), copy_names, n=n, top=top,
                          split=split)
            for stage in order}


def _stage(count: int, wall_us: float, kernels: dict[str, list], copy_names: set[str], *, n: int,
           top: int, split: bool) -> dict:
    """One stage's figures. `count` steps over all ranks, `wall_us` their summed wall time; without
    GPU step spans (`split` false) nothing says which kernels were this stage's, hence null."""
    kernel_us = sum(total for total, _ in kernels.values())
    category_us = _category_us(kernels, copy_names)
    return {
        "steps": _per(count, n),
        "per_step_ms": _ms(kernel_us / count) if split else None,
        "step_ms": _ms(wall_us / count),
        "total_gpu_ms": _ms(kernel_us / n),
        "top": _top(kernels, copy_names, n, top),
        "categories": {cat: _share(us, kernel_us) for cat, us in category_us.items()},
        "category_ms": {cat: _ms(us / count) for cat, us in category_us.items()} if split else None,
    }


def _category_us(kernels: dict[str, list], copy_names: set[str]) -> dict[str, float]:
    out = dict.fromkeys(NAMES, 0.0)
    for name, (total, _) in kernels.items():
        out[_category(name, copy_names)] += total
    return out


def _top(kernels: dict[str, list], copy_names: set[str], n: int, top: int) -> list[dict]:
    """The `top` kernels by total time, each with its share of these kernels' time."""
    kernel_us = sum(total for total, _ in kernels.values())
    ranked = sorted(kernels.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return [{"name": name, "category": _category(name, copy_names), "total_ms": _ms(total / n),
             "share": _share(total, kernel_us), "count": _per(count, n)}
            for name, (total, count) in ranked]


def _category(name: str, copy_names: set[str]) -> str:
    return "copy" if name in copy_names else categorize(name)


def _ranks(summaries: list[FileSummary], naming: TraceNaming | None) -> list[dict]:
    """One entry per file. Its rank: what torch.distributed recorded in it, else the number in its
    name, else its position among the files."""
    out = []
    for index, s in enumerate(summaries):
        kernel_us = s.kernel_us
        top3 = sorted(s.kernels.items(), key=lambda kv: kv[1][0], reverse=True)[:3]
        rank = s.rank if s.rank is not None else naming.rank_number(s.path.name) if naming else None
        out.append({
            "rank": rank if rank is not None else index,
            "file": s.path.name,
            "total_gpu_ms": _ms(kernel_us),
            "cpu_ms": _ms(sum(self_us for self_us, _ in s.cpu_ops.values())),
            "idle_ms": _ms(s.idle_us),
            "top3": [{"name": name, "total_ms": _ms(total), "share": _share(total, kernel_us)}
                     for name, (total, _) in top3],
        })
    return out


def _spread(ranks: list[dict]) -> dict:
    """How far the ranks' work differs: their GPU kernel time, or on a trace without kernels (an
    engine on CPUs) their CPU ops' time (`basis` says which)."""
    basis = "total_gpu_ms" if any(r["total_gpu_ms"] for r in ranks) else "cpu_ms"
    totals = [r[basis] for r in ranks]
    median = statistics.median(totals)
    lo, hi = min(totals), max(totals)
    slowest = max(ranks, key=lambda r: r[basis])
    above_pct = (slowest[basis] - median) / median * 100 if median else 0.0
    return {
        "basis": "gpu_kernels" if basis == "total_gpu_ms" else "cpu_ops",
        "min_ms": lo,
        "max_ms": hi,
        "spread_pct": round((hi - lo) / median * 100, 2) if median else 0.0,
        "straggler": slowest["rank"] if above_pct > STRAGGLER_PCT else None,
    }


def _merge(into: dict[str, list], totals: dict[str, list]) -> None:
    """Add pairs name -> [value, count]; a whole number stays one (steps are counted, not measured)."""
    for name, (value, count) in totals.items():
        stat = into.setdefault(name, [0, 0])
        stat[0] += value
        stat[1] += count


def _ms(us: float) -> float:
    return round(us / 1000.0, 4)


def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def _per(count: int, n: int) -> int | float:
    """Launches per rank: a whole number when the ranks agree, as they do when they ran in lockstep."""
    return count // n if count % n == 0 else round(count / n, 2)
