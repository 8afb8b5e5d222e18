"""`harness reproduce RUN_DIR`: run a recorded run again from its directory alone, and say what differs.

A run directory carries its resolved one-configuration playbook and every launch template it was
rendered from (manifest.json `playbook` and `template.files`). Reproducing writes those beside the new
results (`RESULTS/.reproduce/<run_id>-<time>/`), runs them as a new sweep on the chosen host, and puts
the two runs side by side: host facts that differ, and every metric with its delta and whether that
delta is beyond the run-to-run noise (the spread of the original's repeats when it had some). A level
pairs with the one of the same key in the other run (`level_key`: scenario, load kind, load, and whether
it is a probe of max_load), never by concurrency alone: open-loop levels have none, and two scenarios
may share one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from harness.errors import InputError
from harness.plan import Sweep, load_sweep
from harness.remote.stats import percentile
from harness.results import BenchLevel, RunLayout, RunManifest, RunResult, Unreadable, read_model, read_requests
from harness.results import load_run as load_run_result
from harness.secrets import MASK, arg_env_name

METRICS = [("ttft_ms", "p50", "TTFT p50 ms"), ("itl_ms", "p50", "ITL p50 ms"), ("itl_ms", "p99", "ITL p99 ms"),
           ("tpot_ms", "p50", "TPOT p50 ms"), ("output_tok_s", None, "tok/s")]
FACTS = ("gpus", "cuda", "engine_version", "engine_git", "python", "kernel", "env")
DEFAULT_NOISE = 0.05   # relative band assumed when neither repeats nor requests can tell
MIN_NOISE = 0.02


def load_run(run_dir: Path) -> RunManifest:
    """The run's manifest, checked for what reproducing needs: the resolved playbook and every template."""
    layout = RunLayout(Path(run_dir))
    if not layout.manifest.exists():
        raise InputError(f"not a run directory (no {layout.manifest.name})", file=str(run_dir))
    manifest = read_model(layout.manifest, RunManifest)
    template = manifest.template or {}
    if not isinstance(manifest.playbook, dict) or not isinstance(template.get("files"), dict):
        missing = "playbook" if not isinstance(manifest.playbook, dict) else "template"
        raise InputError(f"the manifest has no `{missing}` record: it was written by an older harness and "
                         "cannot be reproduced from the directory alone", file=str(layout.manifest))
    # a run directory may come from anyone: its names must not lead a write out of the results folder
    if not SAFE_NAME.match(manifest.run_id):
        raise InputError(f"run_id {manifest.run_id!r} is not a plain name", file=str(layout.manifest), key="run_id")
    for name in [template.get("name"), *template["files"]]:
        if not isinstance(name, str) or not TEMPLATE_NAME.match(name):
            raise InputError(f"template file name {name!r} is not a plain file name", file=str(layout.manifest),
                             key="template.files")
    if not all(isinstance(text, str) for text in template["files"].values()):
        raise InputError("a template's text is not text", file=str(layout.manifest), key="template.files")
    return manifest


SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\.j2$")


def prepare(run_dir: Path, inventory: Path, *, host: str | None, results: Path) -> Sweep:
    """Write the recorded playbook and templates beside the results and load them as a new sweep."""
    manifest = load_run(run_dir)
    playbook = manifest.playbook or {}
    if isinstance(playbook.get("search"), dict) and playbook["search"].get("optuna") is not None:
        playbook = playbook | {"search": None}   # an older record of a trial: the trial's own config is its run
    try:
        target = host or playbook["hosts"]
        for section in (playbook["server"], *playbook["configs"]):
            section["env"] = {k: _secret(k, v, run_dir) for k, v in (section.get("env") or {}).items()}
            section["args"] = {k: _secret_flag(k, v, run_dir) for k, v in (section.get("args") or {}).items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(f"the recorded playbook is not one a harness wrote ({type(e).__name__}: {e})",
                         file=str(RunLayout(Path(run_dir)).manifest), key="playbook") from None
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    where = Path(results) / ".reproduce" / f"{manifest.run_id}-{stamp}"
    where.mkdir(parents=True, exist_ok=True)
    template = manifest.template or {}
    for name, text in template["files"].items():
        (where / name).write_text(text)
    playbook = playbook | {"hosts": target, "template": str(where / template["name"])}
    (where / "playbook.yaml").write_text(yaml.safe_dump(playbook, sort_keys=False))
    if (where / "playbook.yaml").stat().st_mode & 0o077:
        os.chmod(where / "playbook.yaml", 0o600)  # it may hold secrets taken from the environment
    sweep = load_sweep(where / "playbook.yaml", inventory, sweep_id=f"{playbook.get('name')}-reproduce-{stamp}")
    if len(sweep.runs) != 1:
        raise InputError(f"the recorded playbook makes {len(sweep.runs)} runs, not the one a harness records",
                         file=str(RunLayout(Path(run_dir)).manifest), key="playbook")
    return fewest_slots(sweep)


def fewest_slots(sweep: Sweep) -> Sweep:
    """The sweep with each Slurm group cut to the nodes its one run spans, so that the allocation
    asks for those and no more (a group of 8 nodes reproducing a run on one holds one)."""
    (run,) = sweep.runs
    kept: dict[str | None, int] = {}
    hosts = []
    for h in sweep.hosts:
        if h.slurm is None or kept.setdefault(h.cluster, 0) < run.nodes:
            hosts.append(h)
            if h.slurm is not None:
                kept[h.cluster] += 1
    names = {h.name for h in hosts}
    return dataclasses.replace(sweep, hosts=hosts,
                               runs=[dataclasses.replace(run, hosts=tuple(h for h in run.hosts if h.name in names))])


def _secret(name: str, value: str, run_dir: Path) -> str:
    if value != MASK:
        return value
    if name not in os.environ:
        raise InputError(f"the recorded run used the secret {name}; set it in the environment to reproduce",
                         file=str(RunLayout(Path(run_dir)).manifest), key=f"env.{name}")
    return os.environ[name]


def _secret_flag(flag: str, value: Any, run_dir: Path) -> Any:
    """A secret flag's recorded value (each word ***) taken from the environment variables the launch
    script read it from: HARNESS_ARG_API_KEY, then HARNESS_ARG_API_KEY_1... for several values."""
    names: list[str] = []

    def fill(item: Any) -> Any:
        if isinstance(item, list):
            return [fill(v) for v in item]
        if item != MASK:
            return item
        names.append(f"{arg_env_name(flag)}_{len(names)}" if names else arg_env_name(flag))
        return os.environ.get(names[-1])
    filled = fill(value)
    if missing := [n for n in names if n not in os.environ]:
        raise InputError(f"the recorded run gave the secret flag --{flag.lstrip('-')} a value; set "
                         f"{' and '.join(missing)} in the environment to reproduce",
                         file=str(RunLayout(Path(run_dir)).manifest), key=f"args.{flag}")
    return filled


LevelKey = tuple[str | None, str, float | None, bool]
"""A level's scenario, load kind ("concurrency" or "request_rate"), load, and whether it probed max_load."""


def level_key(level: BenchLevel) -> LevelKey:
    """What pairs a level with its counterpart in another run: `BenchLevel.key` (scenario, load kind,
    load) and whether it is a probe of max_load, which pairs only with another probe (as compare pairs
    rows), since a probe and a scenario's own level may share a load."""
    return (*level.key, level.probe)


def _record_key(record: dict) -> LevelKey | None:
    """The key of the level a line of requests.jsonl belongs to (it carries its level's scenario, load
    and probe), None when it names no load."""
    rate, conc = record.get("request_rate"), record.get("concurrency")
    kind, load = ("request_rate", rate) if rate is not None else ("concurrency", conc)
    if not isinstance(load, (int, float)) or isinstance(load, bool):
        return None
    scenario = record.get("scenario")
    return (scenario if isinstance(scenario, str) else None, kind, load, bool(record.get("probe")))


@dataclass
class Row:
    label: str
    level: LevelKey
    before: float | None
    after: float | None
    noise: float            # relative band
    noise_source: str

    @property
    def delta(self) -> float | None:
        if self.before in (None, 0) or self.after is None:
            return None
        return (self.after - self.before) / self.before

    @property
    def beyond_noise(self) -> bool:
        return self.delta is not None and abs(self.delta) > self.noise


def compare_runs(original_dir: Path, new_dir: Path) -> dict:
    """Facts that differ and metric rows for two run directories."""
    original, new = load_run_result(RunLayout(Path(original_dir))), load_run_result(RunLayout(Path(new_dir)))
    before, after = original.manifest, new.manifest
    facts = []
    for key in FACTS:
        a, b = (before.facts or {}).get(key), (after.facts or {}).get(key)
        if a != b:
            facts.append({"fact": key, "before": a, "after": b})
    for key in ("gpu", "gpus"):
        a, b = getattr(before.host, key, None), getattr(after.host, key, None)
        if a != b:
            facts.append({"fact": f"host.{key}", "before": a, "after": b})
    rows = []
    new_levels = {level_key(lv): lv for lv in new.levels}
    repeats = _repeat_levels(original)
    requests = _requests(original.layout)
    for old in original.levels:
        which = level_key(old)
        for metric, q, label in METRICS:
            samples = [s for s in (_value(lv, metric, q) for lv in repeats.get(which, [])) if s]
            if len(samples) >= 2:
                noise = (max(samples) - min(samples)) / statistics.median(samples)
                source = f"spread of {len(samples)} repeats"
            elif (split := _split_half(requests.get(which, []), metric, q)) is not None:
                noise, source = split, "half-split of the original's requests"
            else:
                noise, source = DEFAULT_NOISE, "assumed"
            rows.append(Row(label, which, _value(old, metric, q), _value(new_levels.get(which), metric, q),
                            max(noise, MIN_NOISE), source))
    kernels = {"before": _top(original), "after": _top(new)}
    return {"facts": facts, "rows": rows, "kernels": kernels, "status": (before.status, after.status)}


def _requests(layout: RunLayout) -> dict[LevelKey, list[dict]]:
    """The original's completed requests (requests.jsonl), by the key of their level."""
    out: dict[LevelKey, list[dict]] = {}
    for r in read_requests(layout):
        if not r.get("error") and (key := _record_key(r)) is not None:
            out.setdefault(key, []).append(r)
    return out


def _split_half(requests: list[dict], metric: str, q: str | None) -> float | None:
    """How far the metric moves between the odd and even requests of one run: its noise, from one run."""
    if q is None or len(requests) < 4:
        return None
    def stat(rs: list[dict]) -> float | None:
        if metric == "itl_ms":
            values = [g for r in rs for g in r.get("itl_ms") or []]
        elif metric == "tpot_ms":
            values = [(r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1) for r in rs
                      if r.get("output_tokens", 0) > 1 and r.get("e2e_ms") is not None]
        else:
            values = [r[metric] for r in rs if r.get(metric) is not None]
        return percentile(sorted(values), float(q[1:])) if values else None
    a, b, whole = stat(requests[0::2]), stat(requests[1::2]), stat(requests)
    if a is None or b is None or not whole:
        return None
    return abs(a - b) / whole


def _repeat_levels(run: RunResult) -> dict[LevelKey, list[BenchLevel]]:
    """The same configuration's repeats in the original sweep (this run included), by level key."""
    out: dict[LevelKey, list[BenchLevel]] = {}
    for layout in (RunLayout(p.parent) for p in run.layout.dir.parent.glob(f"*/{run.layout.manifest.name}")):
        try:
            other = load_run_result(layout)
        except Unreadable:
            continue
        if other.manifest.config.name == run.manifest.config.name and other.manifest.ok:
            for lv in other.levels:
                out.setdefault(level_key(lv), []).append(lv)
    return out


def _value(level: BenchLevel | None, metric: str, q: str | None) -> float | None:
    if level is None:
        return None
    return level.stat(metric, q) if q else getattr(level, metric)


def _top(run: RunResult) -> list[tuple[str, float]]:
    return [(k.name, k.share) for k in run.analysis.top[:3]] if run.analysis else []
