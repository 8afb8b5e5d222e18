"""Reading and writing the results: one writer per file, and typed readers for compare, report, status,
reproduce and resume.

Every file is written to a temporary name in the same directory, fsynced and renamed into place; a
reader sees the old file or the new one, never half of one. A file that does not parse or does not
match its model is treated as one being written right now by readers that scan a sweep (it is read on
the next pass), and named in a clear error by readers that were pointed at it.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from harness.errors import InputError
from harness.results.layout import RunLayout, SweepLayout
from harness.results.models import (
    MAX_COUNT,
    WHOLE_LEVEL,
    AnalysisFile,
    BenchFile,
    BenchLevel,
    RunManifest,
    SearchFile,
    SweepRecord,
    TelemetryFile,
    TelemetryLine,
    Versioned,
)

M = TypeVar("M", bound=BaseModel)

SUMMARY_FIELDS = ["run_id", "config", "host", "status", "error_kind", "concurrency", "completed", "failed",
                  "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "itl_token_p50_ms", "tpot_p50_ms",
                  "e2e_p50_ms", "output_tok_s", "requests_per_s", "scenario", "request_rate", "probe",
                  "goodput_req_s"]


def atomic_write(path: Path, data: bytes | str) -> None:
    """`data` at `path` whole or not at all: a temporary file beside it, fsync, rename. A write the
    system refuses (no space left) raises an OSError that names `path`, not the nameless one of a
    write to a file descriptor."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: Path) -> Any:
    return parse_json(Path(path).read_text())


def parse_json(text: str) -> Any:
    """`text` as JSON; ValueError for what is not JSON a reader can hold: malformed, an integer of more
    digits than Python converts (ValueError itself), or nested deeper than Python's recursion allows."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ValueError("nested too deeply to be read") from None
    except ValueError:   # not the advice to raise the limit (sys.set_int_max_str_digits) that Python's says
        raise ValueError(f"an integer of more than {sys.get_int_max_str_digits()} digits") from None


def write_model(path: Path, model: Versioned) -> None:
    write_json(path, model.dump())


class Unreadable(InputError):
    """A results file that is missing, not JSON, or not what its model says."""


def read_model(path: Path, model: type[M]) -> M:
    """The file as its model; Unreadable (naming the file and the first wrong key) otherwise."""
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:   # UnicodeDecodeError and json's errors are ValueErrors
        raise Unreadable(f"cannot read it: {e}", file=str(path)) from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top)"
        why = first["msg"].removeprefix("Value error, ")   # a validator's own words
        raise Unreadable(f"not a {model.__name__} file: {where}: {why}", file=str(path), key=where) from e


def maybe_read(path: Path, model: type[M]) -> M | None:
    """The file as its model, or None when it is missing or unreadable."""
    try:
        return read_model(path, model)
    except Unreadable:
        return None


@dataclass(frozen=True)
class RunResult:
    """A finished (or never started) run as its folder holds it."""
    layout: RunLayout
    manifest: RunManifest
    bench: BenchFile | None

    @property
    def levels(self) -> list[BenchLevel]:
        return self.bench.levels if self.bench else []

    def level_notes(self, level: BenchLevel) -> list[str]:
        """Why figures of one of its levels are not measured (bench.json contradicts itself), naming the
        run, the level and the field: `tp8-1: bench.json concurrency 8: output_tok_s 1e+308 disagrees
        with ...: not measured`."""
        return [f"{self.manifest.run_id}: {self.layout.bench.name} {level.label}: "
                + (f"{why}: the level is not measured" if field == WHOLE_LEVEL else f"{field} {why}: not measured")
                for field, why in level.not_measured.items()]

    @property
    def file_notes(self) -> list[str]:
        """Why what bench.json says beside its levels (its max_load) is not measured, naming the run."""
        return [f"{self.manifest.run_id}: {self.layout.bench.name}: {field} {why}: not measured"
                for field, why in (self.bench.not_measured.items() if self.bench else ())]

    @property
    def notes(self) -> list[str]:
        """Every level's `level_notes`, in level order, then the `file_notes`."""
        return [note for level in self.levels for note in self.level_notes(level)] + self.file_notes

    @cached_property
    def analysis(self) -> AnalysisFile | None:
        return maybe_read(self.layout.analysis, AnalysisFile)

    @cached_property
    def telemetry(self) -> TelemetryFile | None:
        return read_telemetry(self.layout.telemetry)

    @cached_property
    def requests(self) -> list[dict[str, Any]]:
        """requests.jsonl's records (see `read_requests`)."""
        return read_requests(self.layout)

    @cached_property
    def launch_command(self) -> str | None:
        """The command the launch script ends with (`exec ...`): what to run by hand."""
        try:
            lines = [ln.strip() for ln in self.layout.launch.read_text(errors="replace").splitlines()]
        except OSError:
            return None
        commands = [ln for ln in lines if ln and not ln.startswith("#")]
        execs = [ln.removeprefix("exec ") for ln in commands if ln.startswith("exec ")]
        return execs[-1] if execs else (commands[-1] if commands else None)


MAX_TELEMETRY_BYTES = 256 << 20
"""A telemetry.jsonl larger than this is not read (a day at one sample a second is ~100 MB with 8 GPUs)."""


def read_requests(layout: RunLayout) -> list[dict[str, Any]]:
    """A run's requests.jsonl, one record a request; [] without the file. A torn last line, a line that
    is not a record, or bytes that are not UTF-8 are left out: the file is the host's, and a benchmark
    cut short leaves half a line."""
    try:
        lines = layout.requests.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = parse_json(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def samples(record: dict[str, Any], key: str) -> list[float] | None:
    """A request record's `key` as its samples: a number is one, a list of numbers each one (ITL gaps);
    None for anything else (absent, a string, a list with a non-number, NaN): the host wrote it."""
    value = record.get(key)
    values: list[Any] = value if isinstance(value, list) else [value]
    numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return numbers if values and len(numbers) == len(values) and all(map(math.isfinite, numbers)) else None


def read_telemetry(path: Path) -> TelemetryFile | None:
    """telemetry.jsonl as its model: the start line's settings and every line that is one (a torn last
    line, or one that is no telemetry line, is left out); None when missing, too large or without its
    start line."""
    try:
        if Path(path).stat().st_size > MAX_TELEMETRY_BYTES:
            return None
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    lines = []
    for raw in text.splitlines():
        try:
            lines.append(TelemetryLine.model_validate(parse_json(raw)))
        except (ValueError, ValidationError):
            continue
    head = next((x for x in lines if x.source == "start"), None)
    if head is None:
        return None
    try:
        return TelemetryFile.model_validate({**head.values, "lines": lines})
    except ValidationError:
        return None


MAX_BENCH_BYTES = 64 << 20
"""A bench.json larger than this is not read: bench.py writes a few kB a level."""


def load_run(layout: RunLayout) -> RunResult:
    """One run folder; Unreadable when its manifest is (its bench.json counts as absent then).

    This is where every reader (compare, report, search) gets a run's bench.json, so this is where it is
    checked: each level against itself and against the benchmark phase the orchestrator timed, the
    figures that cannot be true set to None (`BenchFile.checked`) and named in `RunResult.notes`."""
    manifest = read_model(layout.manifest, RunManifest)
    return RunResult(layout, manifest, read_bench(layout.bench, manifest))


def read_bench(path: Path, manifest: RunManifest | None = None) -> BenchFile | None:
    """bench.json as its model, checked (`BenchFile.checked`) against the run's manifest when there is
    one; None when missing, too large or unreadable."""
    try:
        if Path(path).stat().st_size > MAX_BENCH_BYTES:
            return None
    except OSError:
        return None
    bench = maybe_read(path, BenchFile)
    if bench is None:
        return None
    return bench.checked(bench_s=manifest.seconds("bench") if manifest else None,
                         max_tokens=asked_tokens(manifest.benchmark) if manifest else None)


def asked_tokens(benchmark: dict[str, Any] | None) -> int | None:
    """The output tokens each request asked for when the playbook's `extra_body` overrode bench.json's
    own (it is sent last, over max_tokens), else None."""
    extra = (benchmark or {}).get("extra_body")
    if not isinstance(extra, dict):
        return None
    asked = [extra[k] for k in ("max_tokens", "max_completion_tokens", "max_new_tokens") if k in extra]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in asked):
        return MAX_COUNT   # a limit this reader cannot read: none it can hold a level to
    return max(asked) if asked else None


def read_sweep(sweep: SweepLayout) -> SweepRecord | None:
    return maybe_read(sweep.record, SweepRecord) if sweep.record.exists() else None


def read_search(sweep: SweepLayout) -> SearchFile | None:
    """A search's search.json, None for a grid sweep (or one whose first trial has not been asked)."""
    return maybe_read(sweep.search, SearchFile) if sweep.search.exists() else None


def load_runs(sweep_dir: Path) -> list[RunResult]:
    """Every run with a readable manifest, in the playbook's order when the sweep recorded it."""
    sweep = SweepLayout(Path(sweep_dir))
    record = read_sweep(sweep)
    order = {r.run_id: i for i, r in enumerate(record.runs)} if record else {}
    out = []
    for layout in sorted(sweep.run_layouts(), key=lambda r: (order.get(r.run_id, len(order)), r.run_id)):
        try:
            out.append(load_run(layout))
        except Unreadable:
            continue  # a run being written right now; it will be read on the next pass
    return out


def summary_rows(run: RunResult) -> list[dict[str, Any]]:
    """One row per run and concurrency level (one row with no level when the run has no benchmark)."""
    m = run.manifest
    base: dict[str, Any] = {"run_id": m.run_id, "config": m.config.name, "host": m.host.name, "status": m.status,
                            "error_kind": m.error.kind if m.error else None}
    if not run.levels:
        return [base]
    return [base | {
        "concurrency": lv.concurrency, "completed": lv.completed, "failed": lv.failed,
        "ttft_p50_ms": lv.stat("ttft_ms", "p50"), "ttft_p99_ms": lv.stat("ttft_ms", "p99"),
        "itl_p50_ms": lv.stat("itl_ms", "p50"), "itl_p99_ms": lv.stat("itl_ms", "p99"),
        "itl_token_p50_ms": lv.stat("itl_token_ms", "p50"), "tpot_p50_ms": lv.stat("tpot_ms", "p50"),
        "e2e_p50_ms": lv.stat("e2e_ms", "p50"), "output_tok_s": lv.output_tok_s,
        "requests_per_s": lv.requests_per_s, "scenario": lv.scenario, "request_rate": lv.request_rate,
        "probe": lv.probe, "goodput_req_s": lv.goodput_req_s} for lv in run.levels]


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    sweep = SweepLayout(Path(sweep_dir))
    rows = [row for run in load_runs(sweep.dir) for row in summary_rows(run)]
    write_json(sweep.summary_json, rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=SUMMARY_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(sweep.summary_csv, buf.getvalue())
    return rows


def find_sweeps(path: Path) -> list[Path]:
    """A sweep directory itself, or every sweep directory inside a results directory."""
    path = Path(path)
    if SweepLayout(path).is_sweep():
        return [path]
    return sorted(p.parent for p in path.glob(f"*/{SweepLayout(path).record.name}"))


def latest_sweep(results: Path, name: str) -> Path:
    """The most recently started sweep of playbook `name` under `results` (what --resume continues).
    A sweep.json that cannot be read in a folder named as that playbook's sweeps are (`<name>-<time>`)
    is an error naming it: it may be the latest, and resuming an older sweep instead would pass unseen."""
    candidates = []
    for sweep_dir in find_sweeps(results):
        layout = SweepLayout(sweep_dir)
        if not layout.record.exists():
            continue
        try:
            record = read_model(layout.record, SweepRecord)
        except Unreadable as e:
            if sweep_dir.name.startswith(f"{name}-"):
                raise InputError(f"{e.message}: it may be the latest sweep of playbook {name!r}, which --resume "
                                 "continues; mend it or move its folder out of the results") from None
            continue
        if record.playbook_name == name:
            candidates.append((record.started or 0, sweep_dir))
    if not candidates:
        raise InputError(f"no earlier sweep of playbook {name!r} to resume in {results}", key="--resume")
    return max(candidates)[1]
