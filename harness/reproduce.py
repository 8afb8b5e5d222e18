"""`harness reproduce RUN_DIR`: run a recorded run again from its directory alone, and say what differs.

A run directory carries its resolved one-configuration playbook and every launch template it was
rendered from (manifest.json `playbook` and `template.files`). Reproducing writes those beside the new
results (`RESULTS/.reproduce/<run_id>-<time>/`), runs them as a new sweep on the chosen host, and puts
the two runs side by side: host facts that differ, and every metric with its delta and whether that
delta is beyond the run-to-run noise (the spread of the original's repeats when it had some).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness.errors import InputError
from harness.plan import Sweep, load_sweep
from harness.remote.stats import percentile
from harness.results import read_json
from harness.secrets import MASK

METRICS = [("ttft_ms", "p50", "TTFT p50 ms"), ("itl_ms", "p50", "ITL p50 ms"), ("itl_ms", "p99", "ITL p99 ms"),
           ("tpot_ms", "p50", "TPOT p50 ms"), ("output_tok_s", None, "tok/s")]
FACTS = ("gpus", "cuda", "engine_version", "engine_git", "python", "kernel", "env")
DEFAULT_NOISE = 0.05   # relative band assumed when neither repeats nor requests can tell
MIN_NOISE = 0.02


def load_run(run_dir: Path) -> dict:
    manifest_path = Path(run_dir) / "manifest.json"
    try:
        manifest = read_json(manifest_path)
    except FileNotFoundError:
        raise InputError("not a run directory (no manifest.json)", file=str(run_dir)) from None
    except ValueError as e:
        raise InputError(f"unreadable manifest: {e}", file=str(manifest_path)) from None
    for key in ("playbook", "template"):
        if key not in manifest or (key == "template" and "files" not in manifest["template"]):
            raise InputError(f"the manifest has no `{key}` record: it was written by an older harness and "
                             "cannot be reproduced from the directory alone", file=str(manifest_path))
    # a run directory may come from anyone: its names must not lead a write out of the results folder
    names = [manifest["template"].get("name"), *manifest["template"]["files"]]
    if not isinstance(manifest.get("run_id"), str) or not SAFE_NAME.match(manifest["run_id"]):
        raise InputError(f"run_id {manifest.get('run_id')!r} is not a plain name", file=str(manifest_path),
                         key="run_id")
    for name in names:
        if not isinstance(name, str) or not TEMPLATE_NAME.match(name):
            raise InputError(f"template file name {name!r} is not a plain file name", file=str(manifest_path),
                             key="template.files")
    return manifest


SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*\.j2$")


def prepare(run_dir: Path, inventory: Path, *, host: str | None, results: Path) -> Sweep:
    """Write the recorded playbook and templates beside the results and load them as a new sweep."""
    manifest = load_run(run_dir)
    playbook = manifest["playbook"]
    target = host or playbook["hosts"]
    for section in (playbook["server"], *playbook["configs"]):
        section["env"] = {k: _secret(k, v, run_dir) for k, v in section.get("env", {}).items()}
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    where = Path(results) / ".reproduce" / f"{manifest['run_id']}-{stamp}"
    where.mkdir(parents=True, exist_ok=True)
    template = manifest["template"]
    for name, text in template["files"].items():
        (where / name).write_text(text)
    playbook = playbook | {"hosts": target, "template": str(where / template["name"])}
    (where / "playbook.yaml").write_text(yaml.safe_dump(playbook, sort_keys=False))
    if (where / "playbook.yaml").stat().st_mode & 0o077:
        os.chmod(where / "playbook.yaml", 0o600)  # it may hold secrets taken from the environment
    return load_sweep(where / "playbook.yaml", inventory, sweep_id=f"{playbook['name']}-reproduce-{stamp}")


def _secret(name: str, value: str, run_dir: Path) -> str:
    if value != MASK:
        return value
    if name not in os.environ:
        raise InputError(f"the recorded run used the secret {name}; set it in the environment to reproduce",
                         file=str(Path(run_dir) / "manifest.json"), key=f"env.{name}")
    return os.environ[name]


@dataclass
class Row:
    label: str
    concurrency: int | None
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
    before, after = read_json(original_dir / "manifest.json"), read_json(new_dir / "manifest.json")
    facts = []
    for key in FACTS:
        a, b = (before.get("facts") or {}).get(key), (after.get("facts") or {}).get(key)
        if a != b:
            facts.append({"fact": key, "before": a, "after": b})
    for key in ("gpu", "gpus"):
        a, b = before["host"].get(key), after["host"].get(key)
        if a != b:
            facts.append({"fact": f"host.{key}", "before": a, "after": b})
    rows = []
    old_levels = _levels(original_dir)
    new_levels = _levels(new_dir)
    repeats = _repeat_levels(original_dir, before)
    requests = _requests(original_dir)
    for conc, old in old_levels.items():
        new = new_levels.get(conc, {})
        for metric, q, label in METRICS:
            samples = [s for s in (_value(lv, metric, q) for lv in repeats.get(conc, [])) if s]
            if len(samples) >= 2:
                noise = (max(samples) - min(samples)) / statistics.median(samples)
                source = f"spread of {len(samples)} repeats"
            elif (split := _split_half(requests.get(conc, []), metric, q)) is not None:
                noise, source = split, "half-split of the original's requests"
            else:
                noise, source = DEFAULT_NOISE, "assumed"
            rows.append(Row(label, conc, _value(old, metric, q), _value(new, metric, q), max(noise, MIN_NOISE),
                            source))
    kernels = {"before": _top(original_dir), "after": _top(new_dir)}
    return {"facts": facts, "rows": rows, "kernels": kernels, "status": (before["status"], after["status"])}


def _requests(run_dir: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    try:
        lines = (run_dir / "requests.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not r.get("error"):
            out.setdefault(r["concurrency"], []).append(r)
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


def _levels(run_dir: Path) -> dict[int, dict]:
    try:
        return {lv["concurrency"]: lv for lv in read_json(run_dir / "bench.json")["levels"]}
    except (OSError, ValueError, KeyError):
        return {}


def _repeat_levels(run_dir: Path, manifest: dict) -> dict[int, list[dict]]:
    """The same configuration's repeats in the original sweep (this run included)."""
    out: dict[int, list[dict]] = {}
    for other in run_dir.parent.glob("*/manifest.json"):
        try:
            m = read_json(other)
        except (OSError, ValueError):
            continue
        if m.get("config", {}).get("name") == manifest["config"]["name"] and m.get("status") == "ok":
            for conc, lv in _levels(other.parent).items():
                out.setdefault(conc, []).append(lv)
    return out


def _value(level: dict, metric: str, q: str | None) -> float | None:
    if not level:
        return None
    v = level.get(metric)
    return v.get(q) if q and isinstance(v, dict) else v


def _top(run_dir: Path) -> list[tuple[str, float]]:
    try:
        return [(k["name"], k["share"]) for k in read_json(run_dir / "analysis.json")["top"][:3]]
    except (OSError, ValueError, KeyError):
        return []
