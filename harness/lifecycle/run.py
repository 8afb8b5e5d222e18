"""One run, start to finish: preflight, launch, health, bench, profile, teardown (always), collect, analyze.

Each stage is a function of the RunContext that returns what it found into `ctx.found` (a typed
record, one field a stage); this module only sequences them and times them, and `build_manifest`
turns what they found into the manifest without touching a file. Teardown runs whatever happened
before it; collect runs after teardown (so server.log is complete and nsys has written its report) and
even for a failed run, whose log is the first thing a person wants to read. The analysis of the traces
runs last, apart (`analyze`): the executor runs it once the host is free for its next run.
"""

from __future__ import annotations

import hashlib
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from harness.errors import HarnessError, Kind, RemoteError, tail
from harness.facts import facts_for, parse_facts
from harness.lifecycle.context import RunContext
from harness.lifecycle.measure import bench, profile
from harness.lifecycle.preflight import preflight
from harness.lifecycle.server import launch, teardown, wait_healthy
from harness.plan import RunSpec, Sweep
from harness.render import BUILTIN_TEMPLATES
from harness.results import ErrorRecord, RunFiles, RunLayout, RunManifest, atomic_write, write_json, write_model
from harness.results.models import AnalysisRef, Collected
from harness.transport.base import Placed
from harness.transport.tarpull import TooLarge

UNREACHABLE = ("unreachable", "auth", "host_key")


def execute(ctx: RunContext) -> RunManifest:
    """Run every stage, collect, and write the manifest. The profile's analysis (CPU work here) is
    left to `analyze`, so the host can start its next run meanwhile."""
    started = time.time()
    error: HarnessError | None = None
    pb = ctx.sweep.playbook
    atomic_write(ctx.layout.launch, ctx.rendered.script)
    try:
        with ctx.phase("preflight"):
            ctx.found.probe = preflight(ctx)
        launched = False
        try:
            with ctx.phase("launch"):
                launched = True   # from the first byte sent: secrets or a server may be on the host now
                launch(ctx)
            with ctx.phase("health"):
                wait_healthy(ctx)
            with ctx.phase("bench"):
                bench(ctx)
            if pb.profile.mode != "none":
                with ctx.phase("profile"):
                    ctx.found.profile = profile(ctx)
        finally:
            if launched:
                _teardown(ctx)
    except HarnessError as e:
        error = e
    if error is None or error.kind not in UNREACHABLE:
        error = _collect(ctx, error)
    if error is None:
        _clean_up(ctx)
    manifest = build_manifest(ctx, error, read_back(ctx), started=started, finished=time.time())
    write_model(ctx.layout.manifest, manifest)
    return manifest


def needs_analysis(manifest: RunManifest) -> bool:
    """Whether traces came back that have no analysis yet."""
    profile = manifest.profile
    return (profile is not None and profile.status != "failed" and bool(profile.files) and profile.analysis is None
            and manifest.collected.files > 0)


def analyze(layout: RunLayout, manifest: RunManifest) -> RunManifest:
    """analysis.json of the traces brought back, its summary in the manifest (written again). The steps
    asked of the profiler stand in only when the traces mark no steps themselves: an engine may run
    more steps than asked (vLLM 0.26 ran 318 for 10) or count only the steps with work (SGLang)."""
    from harness.analysis import analyze_path  # heavy-ish; only runs with traces
    if manifest.profile is None or not needs_analysis(manifest):
        return manifest
    try:
        analysis = analyze_path(layout.profile, requested_steps=manifest.profile.num_steps)
        write_json(layout.analysis, analysis)
        ref = AnalysisRef(file=layout.analysis.name, total_gpu_ms=analysis.get("total_gpu_ms"),
                          steps=analysis.get("steps"), steps_source=analysis.get("steps_source"),
                          per_step_ms=analysis.get("per_step_ms"))
    except HarnessError as e:
        ref = AnalysisRef(error=str(e))
    updated = manifest.model_copy(update={"profile": manifest.profile.model_copy(update={"analysis": ref})})
    write_model(layout.manifest, updated)
    return updated


def _clean_up(ctx: RunContext) -> None:
    """Everything of a good run is here now: its folder on the host goes (a failed run's stays, for
    whoever looks into it there)."""
    try:
        ctx.sh(f"rm -rf {shlex.quote(ctx.paths.root)}", timeout=300, check=False)
    except HarnessError as e:
        ctx.found.warnings.append(f"cleaning up on the host: {e}")


def _teardown(ctx: RunContext) -> None:
    try:
        with ctx.phase("teardown"):
            ctx.found.teardown = teardown(ctx)
    except HarnessError as e:  # never hide the error that brought us here; record this one
        ctx.found.warnings.append(f"teardown: {e}")


def _collect(ctx: RunContext, error: HarnessError | None) -> HarnessError | None:
    max_mb = ctx.sweep.playbook.profile.max_mb
    try:
        with ctx.phase("collect"):   # the pull itself refuses what the local disk cannot hold
            pulled = ctx.transport.pull(ctx.paths.root, ctx.local_dir, timeout=3600, exclude=(RunFiles.SECRETS,),
                                        max_bytes=int(max_mb * 1e6) if max_mb else None)
        ctx.found.collected = Collected(files=pulled.files, bytes=pulled.bytes, sha256=pulled.sha256,
                                        skipped=list(pulled.skipped))
        _redact_texts(ctx)
    except HarnessError as e:
        if isinstance(e, TooLarge) and not max_mb:
            hinted = RemoteError(f"{e.message}, or cap the profile with profile.max_mb", kind=Kind.COLLECT,
                                 output=getattr(e, "output", ""))
            hinted.__cause__ = e
            e = hinted
        if error is None:   # whatever broke the pull (a timeout, a lost link), the run failed collecting
            if e.kind is Kind.COLLECT:
                return e
            failed = RemoteError(f"collecting the run's files failed: {e.message}", kind=Kind.COLLECT,
                                 output=getattr(e, "output", ""))
            failed.__cause__ = e
            return failed
        ctx.found.warnings.append(f"collect: {e}")
    return error


TEXT_SUFFIXES = (".log", ".txt", ".out", ".err")


def _redact_texts(ctx: RunContext) -> None:
    """Engines log their own arguments (SGLang's server_args, vLLM's non-default args): a secret flag's
    value would reach server.log. Every pulled text file is masked as the harness's own output is."""
    redact = ctx.sweep.redactor
    for path in ctx.local_dir.rglob("*"):
        if path.suffix in TEXT_SUFFIXES and path.is_file() and path.stat().st_size < (64 << 20):
            text = path.read_text(errors="surrogateescape")
            masked = redact.text(text)
            if masked != text:
                atomic_write(path, masked.encode(errors="surrogateescape"))


def _nsys_reports(layout: RunLayout, record: dict) -> dict:
    """Under nsys the report appears when the server exits: look for it in what was collected."""
    reports = sorted(p for p in layout.profile.glob("*") if p.suffix in (".nsys-rep", ".qdrep", ".qdstrm"))
    files: list[dict[str, Any]] = [{"name": p.name, "bytes": p.stat().st_size} for p in reports]
    if any(p.suffix != ".qdstrm" for p in reports):
        return record | {"status": "ok", "files": files, "bytes": sum(f["bytes"] for f in files)}
    return record | {"status": "failed", "files": files,
                     "error": f"nsys wrote no report into {record['dir']}" + (
                         " (only a .qdstrm: nsys could not convert it on the host)" if files else ""),
                     "hint": "check server.log for nsys's own messages; nsys needs time at exit to write"}


def template_record(template: Path) -> dict:
    """The launch template and every template it could include (those beside it, then the built-in
    ones), text and sha256: enough to render again."""
    files = {p.name: p.read_text() for p in sorted(BUILTIN_TEMPLATES.glob("*.j2"))}
    files |= {p.name: p.read_text() for p in sorted(template.parent.glob("*.j2"))}
    files[template.name] = template.read_text()
    return {"path": str(template), "name": template.name,
            "sha256": hashlib.sha256(files[template.name].encode()).hexdigest(),
            "text": files[template.name], "files": files}


def resolved_playbook(ctx: RunContext) -> dict:
    """A playbook of this one run: what `harness reproduce` runs again (secrets show as ***)."""
    sweep = ctx.sweep
    pb = sweep.playbook.model_dump(mode="json", exclude={"configs", "matrix", "repeat", "placement", "template"})
    config = ctx.run.config.model_dump(mode="json")
    pb["server"]["env"] = sweep.redactor.env(pb["server"]["env"], sweep.secret_names)
    config["env"] = sweep.redactor.env(config["env"], sweep.secret_names)
    return pb | {"hosts": ctx.host.name, "configs": [config], "repeat": 1, "placement": "pool"}


@dataclass(frozen=True)
class FromFiles:
    """What the files brought back say, read once: the inputs of the manifest that are not in memory."""
    log_tail: str | None
    facts: dict[str, Any]
    template: dict[str, Any]
    profile: dict[str, Any] | None      # the profile's record, nsys's report looked for


def read_back(ctx: RunContext) -> FromFiles:
    log_tail = ctx.found.log_tail
    if log_tail is None and ctx.layout.server_log.exists():
        log_tail = tail(ctx.layout.server_log.read_text(errors="replace"), 40)
    record = ctx.found.profile
    if record is not None and record.get("status") == "pending":
        record = _nsys_reports(ctx.layout, record)
    return FromFiles(log_tail, parse_facts(facts_for(ctx.sweep.engine), ctx.layout.facts),
                     template_record(ctx.sweep.template), record)


PROFILE_FIELDS = ("status", "mode", "files", "missing_ranks", "ranks_found", "expected_ranks", "num_steps", "dir",
                  "bytes", "error", "hint", "answers", "seconds")
"""What the manifest keeps of the agent's answer to `profile`."""


def build_manifest(ctx: RunContext, error: HarnessError | None, files: FromFiles, *, started: float,
                   finished: float) -> RunManifest:
    """The manifest of a run from what its stages found and its files said; reads and writes nothing."""
    sweep, redact, found = ctx.sweep, ctx.sweep.redactor, ctx.found
    profile = files.profile
    return RunManifest.model_validate(redact.data({
        "run_id": ctx.run.run_id,
        "sweep_id": sweep.sweep_id,
        "config": {"name": ctx.run.config.name, "description": ctx.run.config.description,
                   "args": ctx.rendered.args,
                   "env": redact.env({**ctx.rendered.env, **ctx.rendered.secret_env}, sweep.secret_names)},
        "repeat": ctx.run.repeat,
        "host": ctx.host.public(redact),
        "placement": (ctx.transport.placement(found.server_step) if isinstance(ctx.transport, Placed)
                      else None),
        "engine": sweep.engine.name,
        "protocol": sweep.engine.speaks,
        "model": sweep.playbook.model.model_dump(),
        "gpus_used": sweep.engine.ranks(ctx.rendered.args),
        "port": ctx.rendered.port,
        "template": files.template,
        "playbook": resolved_playbook(ctx),
        "benchmark": ctx.run.benchmark.model_dump(),
        "profile_settings": sweep.playbook.profile.model_dump(),
        "status": "failed" if error else "ok",
        "error": ({"kind": error.kind, "message": str(error),
                   "detail": error.detail() if isinstance(error, RemoteError) else str(error),
                   "log_tail": files.log_tail} if error else None),
        "attempts": found.attempt,
        "phases": ctx.phases,
        "collected": found.collected.model_dump() if found.collected else {"files": 0, "bytes": 0},
        "profile": {k: profile.get(k) for k in PROFILE_FIELDS} if profile is not None else None,
        "facts": files.facts,
        "probe": found.probe,
        "teardown": found.teardown,
        "warnings": found.warnings,
        "started": started,
        "finished": finished,
        "harness_version": harness.__version__,
    }))


def unrun_manifest(sweep: Sweep, spec: RunSpec, host: str, status: str, error: ErrorRecord | None,
                   **fields: Any) -> RunManifest:
    """The manifest of a run that did not get far enough to write its own: skipped (a deadline,
    --fail-fast), failed before it started (no host could take it), or ended by the harness's own bug."""
    return RunManifest.model_validate({
        "run_id": spec.run_id, "sweep_id": sweep.sweep_id, "config": {"name": spec.config.name},
        "host": {"name": host}, "engine": sweep.engine.name, "status": status, "error": error,
        "harness_version": harness.__version__, **fields})
