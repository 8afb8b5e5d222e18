"""What `--resume` does with a sweep that stopped: which runs are left, and whether the playbook it is
resumed with is still the one the finished runs were measured with.

Each run's inputs are everything of the playbook that reaches that run (the model, server, benchmark
and profile settings, its configuration, the template's text), recorded in sweep.json as a
fingerprint. Resuming with an edited playbook would mix results of two different experiments in one
comparison, so a run whose inputs changed is refused, with the differences, unless the user accepts
them (`--accept-changes`: runs not yet finished use the new inputs; finished ones keep theirs, which
their manifests record). Added configurations simply run; removed ones keep their results and are
named.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness
from harness.errors import InputError
from harness.journal import latest_states
from harness.plan import RunSpec, Sweep
from harness.render import BUILTIN_TEMPLATES
from harness.results import JournalEvent, SweepLayout, SweepRecord, Unreadable, load_run, read_sweep

NOT_INPUTS = ("configs", "matrix", "repeat", "placement", "hosts", "references", "name")
"""Playbook keys that do not change what a run measures (where it runs is placement, not input)."""


def run_inputs(sweep: Sweep, spec: RunSpec) -> dict[str, Any]:
    """The inputs of one run, as plain data (secrets as the redactor shows them)."""
    pb = sweep.playbook.model_dump(mode="json", exclude=set(NOT_INPUTS))
    if (pb.get("search") or {}).get("optuna") is not None:
        pb["search"]["optuna"] = None   # it chooses runs, whose configurations hold its values: a budget may grow
    config = spec.config.model_dump(mode="json")
    config.pop("description", None)
    if not config.get("benchmark"):
        config.pop("benchmark", None)   # as sweeps before per-configuration benchmarks recorded it
    data = {"playbook": pb, "config": config, "repeat": spec.repeat,
            "template": hashlib.sha256(sweep.template.read_bytes()).hexdigest(),
            "includes": template_includes(sweep.template)}
    return sweep.redactor.data(data)


def template_includes(template: Path) -> dict[str, str]:
    """name -> sha256 of every other template the launch template could include (those beside it, over
    the built-in ones: what its loader finds, and what a run's manifest records): `_common.sh.j2`
    edited between a stop and the resume changes every launch script as much as the template would."""
    files = {p.name: p for p in sorted(BUILTIN_TEMPLATES.glob("*.j2"))}
    files |= {p.name: p for p in sorted(template.parent.glob("*.j2"))}
    files.pop(template.name, None)
    return {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items()}


def comparable(recorded: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs as a sweep recorded before `includes` would have them: without that key when its
    record has none, so that an older sweep resumes as it would have."""
    return inputs if "includes" in recorded else {k: v for k, v in inputs.items() if k != "includes"}


def sweep_record(sweep: Sweep, *, started: float, finished: float | None, argv: list[str],
                 kept: list[dict[str, Any]]) -> SweepRecord:
    """sweep.json: the sweep as loaded, every run with its inputs and their fingerprint (what a resume
    compares), and `kept`: runs an edited playbook no longer has, whose results stay."""
    redact = sweep.redactor
    return SweepRecord.model_validate(redact.data({
        "sweep_id": sweep.sweep_id, "harness_version": harness.__version__,
        "playbook_path": str(sweep.doc.path), "playbook": sweep.playbook.model_dump(mode="json"),
        "inventory_path": str(sweep.inventory.path),
        "hosts": [h.public(redact) for h in sweep.hosts],
        "runs": [{"run_id": r.run_id, "config": r.config.name, "hosts": [h.name for h in r.hosts],
                  "inputs": (inputs := run_inputs(sweep, r)), "fingerprint": fingerprint(inputs)}
                 for r in sweep.runs] + kept,
        "argv": argv, "started": started, "finished": finished}))


def fingerprint(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class ResumePlan:
    todo: list[RunSpec]                                   # runs to (re)run, in playbook order
    done: list[str] = field(default_factory=list)         # finished runs left alone
    removed: list[str] = field(default_factory=list)      # in the sweep before, not in the playbook now
    changed: dict[str, list[str]] = field(default_factory=dict)   # run -> differences, when accepted


def plan_resume(sweep: Sweep, sweep_dir: Path, *, retry_failed: bool = False,
                accept_changes: bool = False) -> ResumePlan:
    """The runs a resume would do, from the journal and sweep.json alone (touches no host)."""
    layout = SweepLayout(Path(sweep_dir))
    states = journaled_states(layout)
    recorded = read_sweep(layout)
    before = {r.run_id: r for r in (recorded.runs if recorded else [])}
    final = ("ok",) if retry_failed else ("ok", "failed")
    plan = ResumePlan(todo=[])
    for spec in sweep.runs:
        inputs = run_inputs(sweep, spec)
        old = before.get(spec.run_id)
        if old and old.inputs is not None and fingerprint(inputs := comparable(old.inputs, inputs)) != old.fingerprint:
            plan.changed[spec.run_id] = differences(old.inputs, inputs)
        finished = spec.run_id in states and states[spec.run_id].state in final
        if finished and (spec.run_id not in plan.changed or accept_changes):
            plan.done.append(spec.run_id)   # changed and accepted: it keeps the inputs its manifest records
        else:
            plan.todo.append(spec)
    plan.removed = [run_id for run_id in before if run_id not in {s.run_id for s in sweep.runs}]
    if plan.changed and not accept_changes:
        lines = [f"  {run_id}: {'; '.join(diff)}" for run_id, diff in plan.changed.items()]
        raise InputError("the playbook changed since this sweep started; its results would mix two "
                         "experiments:\n" + "\n".join(lines) + "\nresume with --accept-changes to run what is "
                         "left with the new settings, or start a new sweep", key="--resume")
    return plan


def journaled_states(layout: SweepLayout) -> dict[str, JournalEvent]:
    """Each run's last state: the journal's, or where it is gone (deleted by hand, a disk restored
    without it) what the runs' manifests say, so that a resume keeps the finished runs rather than
    empty their folders and run them all again."""
    if layout.journal.exists():
        return latest_states(layout.journal)
    found = {}
    for run in layout.run_layouts():
        try:
            manifest = load_run(run).manifest
        except Unreadable:
            continue
        if manifest.status in ("ok", "failed"):
            found[run.run_id] = JournalEvent.model_validate({
                "t": manifest.finished or 0, "run_id": run.run_id, "state": manifest.status,
                "host": manifest.host.name if manifest.host else None, "attempts": manifest.attempts})
    return found


def differences(old: Any, new: Any, where: str = "") -> list[str]:
    """`key: old -> new` for every leaf that differs, as JSON tells them apart: `8` and `8.0`, `1` and
    `true` are equal in Python but launch different flags and fingerprint differently, and a refusal
    must name what changed."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            path = f"{where}.{key}" if where else str(key)
            if key not in new:
                out.append(f"{path} removed")
            elif key not in old:
                out.append(f"{path} added: {json.dumps(new[key])}")
            else:
                out += differences(old[key], new[key], path)
        return out
    same = json.dumps(old, sort_keys=True) == json.dumps(new, sort_keys=True)
    return [] if same else [f"{where}: {json.dumps(old)} -> {json.dumps(new)}"]
