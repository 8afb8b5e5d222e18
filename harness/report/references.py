"""Expected results, ReFrame-style: a playbook names for a configuration (or "*" for every one) the value
a metric should have and how far it may stray, and a result outside that band is a regression.

    references:
      "*":  {itl_ms_p50: {value: 97, lower: -0.1, upper: 0.1}}     # every configuration, every level
      tp8:
        output_tok_s: [10.3, -0.05, null]                          # short form; null: no upper bound
        ttft_ms_p99: {1: [180, null, 0.2], 8: [400, null, 0.2]}    # per concurrency level

A configuration's own reference wins over "*". A reference that cannot be checked because the run
failed (no value) is a miss too: the sweep did not show the result is still there. References of
configurations or levels that were not measured are skipped. sweep.json records the playbook, so the
results directory alone carries its references.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from harness.config.playbook import Reference, References
from harness.errors import InputError
from harness.results import SweepLayout, find_sweeps, read_sweep

_ADAPTER = TypeAdapter(References)


@dataclass(frozen=True)
class Miss:
    """One metric of one configuration and level outside its reference band."""
    config: str
    concurrency: int | None
    metric: str
    value: float | None
    reference: float
    low: float | None
    high: float | None

    def __str__(self) -> str:
        where = f"{self.config} at concurrency {self.concurrency}" if self.concurrency else self.config
        band = f"[{_num(self.low) if self.low is not None else '-inf'}, " \
               f"{_num(self.high) if self.high is not None else 'inf'}]"
        got = "has no value" if self.value is None else f"= {_num(self.value)} is outside {band}"
        return f"{where}: {self.metric} {got} (reference {_num(self.reference)})"

    def as_dict(self) -> dict:
        return asdict(self) | {"message": str(self)}


def _num(v: float) -> str:
    return f"{v:.4g}"


def parse_references(data: dict | None, *, file: str | None = None) -> dict:
    """Validate references as a playbook writes them (or as sweep.json recorded them: JSON keys are text)."""
    try:
        return _ADAPTER.validate_python(data or {})
    except ValidationError as e:
        first = e.errors()[0]
        raise InputError(first["msg"], file=file,
                         key=".".join(["references", *map(str, first["loc"])])) from None


def references_of(paths: list[Path]) -> dict:
    """The references recorded by every sweep under `paths`; a later sweep's word on a metric wins."""
    merged: dict[str, dict] = {}
    for layout in (SweepLayout(s) for p in paths for s in find_sweeps(p)):
        record = read_sweep(layout)
        if record is None:
            continue
        for config, metrics in parse_references(record.playbook.get("references"), file=str(layout.record)).items():
            merged.setdefault(config, {}).update(metrics)
    return merged


def band(ref: Reference) -> tuple[float | None, float | None]:
    """ReFrame's bounds: value * (1 + lower) .. value * (1 + upper), the open sides None."""
    low = None if ref.lower is None else ref.value * (1 + ref.lower)
    high = None if ref.upper is None else ref.value * (1 + ref.upper)
    return low, high


def check_references(rows: list[dict], references: dict) -> list[Miss]:
    """Every metric of every row (a configuration at a concurrency level, as `compare.collect` makes
    them) that misses the reference the playbook gives it."""
    misses = []
    for row in rows:
        if row.get("probe"):   # a probe of max_load tries loads on purpose beyond what holds
            continue
        wanted = {**references.get("*", {}), **references.get(row["config"], {})}
        for metric, ref in wanted.items():
            if not isinstance(ref, dict):
                refs = [ref]
            elif row.get("request_rate") is not None:   # an open loop's level: no concurrency to key by
                refs = []
            elif row["concurrency"] is None:  # a failed run: no level was measured, so every one is missed
                refs = list(ref.values())
            else:
                refs = [ref[row["concurrency"]]] if row["concurrency"] in ref else []
            value = row.get(metric)
            for r in refs:
                low, high = band(r)
                if value is None or (low is not None and value < low) or (high is not None and value > high):
                    misses.append(Miss(row["config"], row["concurrency"], metric, value, r.value, low, high))
    return misses


def sweep_misses(sweep_dir: Path, rows: list[dict] | None = None) -> list[Miss]:
    """The misses of one finished sweep against the references its playbook recorded: what `harness
    sweep` shows (and exits 1 for) at the end. `rows`: the sweep's comparison, when the caller has it
    already (its bootstrap intervals are most of what it costs)."""
    if rows is None:
        from harness.report.compare import collect
        rows = collect([sweep_dir])
    return check_references(rows, references_of([sweep_dir]))
