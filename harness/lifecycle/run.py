"""One run, start to finish: preflight, launch, health, bench, profile, teardown (always), collect, analyze.

Each stage is a function of the RunContext; this module only sequences them, times them, and turns
what happened into the manifest. Teardown runs whatever happened before it; collect runs after
teardown (so server.log is complete and nsys has written its report) and even for a failed run, whose
log is the first thing a person wants to read.
"""

from __future__ import annotations

import hashlib
import shlex
import time
from pathlib import Path
from typing import Any

import harness
from harness.errors import HarnessError, Kind, RemoteError, tail
from harness.facts import facts_for, parse_facts
from harness.lifecycle.context import RunContext
from harness.lifecycle.measure import bench, profile
from harness.lifecycle.preflight import preflight
from harness.lifecycle.server import launch, teardown, wait_healthy
from harness.plan import SECRETS_FILE
from harness.render import BUILTIN_TEMPLATES
from harness.results import atomic_write, write_json
from harness.transport.tarpull import TooLarge

UNREACHABLE = ("unreachable", "auth", "host_key")


def execute(ctx: RunContext) -> dict:
    """Run every stage; return the manifest (also written to the run directory)."""
    started = time.time()
    error: HarnessError | None = None
    profile_record: dict | None = None
    pb = ctx.sweep.playbook
    atomic_write(ctx.local_dir / "launch.sh", ctx.rendered.script)
    try:
        with ctx.phase("preflight"):
            ctx.record["probe"] = preflight(ctx)
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
                    profile_record = profile(ctx)
        finally:
            if launched:
                _teardown(ctx)
    except HarnessError as e:
        error = e
    if error is None or error.kind not in UNREACHABLE:
        error = _collect(ctx, error)
    if error is None:
        _clean_up(ctx)
    return _manifest(ctx, error, profile_record, started)


def _clean_up(ctx: RunContext) -> None:
    """Everything of a good run is here now: its folder on the host goes (a failed run's stays, for
    whoever looks into it there)."""
    try:
        ctx.sh(f"rm -rf {shlex.quote(ctx.paths.root)}", timeout=300, check=False)
    except HarnessError as e:
        ctx.record.setdefault("warnings", []).append(f"cleaning up on the host: {e}")


def _teardown(ctx: RunContext) -> None:
    try:
        with ctx.phase("teardown"):
            ctx.record["teardown"] = teardown(ctx)
    except HarnessError as e:  # never hide the error that brought us here; record this one
        ctx.record.setdefault("warnings", []).append(f"teardown: {e}")


def _collect(ctx: RunContext, error: HarnessError | None) -> HarnessError | None:
    max_mb = ctx.sweep.playbook.profile.max_mb
    try:
        with ctx.phase("collect"):   # the pull itself refuses what the local disk cannot hold
            pulled = ctx.transport.pull(ctx.paths.root, ctx.local_dir, timeout=3600, exclude=(SECRETS_FILE,),
                                        max_bytes=int(max_mb * 1e6) if max_mb else None)
        ctx.record["collected"] = {"files": pulled.files, "bytes": pulled.bytes, "sha256": pulled.sha256,
                                   "skipped": list(pulled.skipped)}
        _redact_texts(ctx)
    except HarnessError as e:
        if isinstance(e, TooLarge) and not max_mb:
            e.message += ", or cap the profile with profile.max_mb"
        if error is None:   # whatever broke the pull (a timeout, a lost link), the run failed collecting
            if e.kind is Kind.COLLECT:
                return e
            failed = RemoteError(f"collecting the run's files failed: {e.message}", kind=Kind.COLLECT,
                                 output=getattr(e, "output", ""))
            failed.__cause__ = e
            return failed
        ctx.record.setdefault("warnings", []).append(f"collect: {e}")
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


def _analyze(local_dir: Path, profile_record: dict | None) -> dict | None:
    """analysis.json of the traces brought back. The steps asked of the profiler stand in only when
    the traces mark no steps themselves: an engine may run more steps than asked (vLLM 0.26 ran 318
    for 10) or count only the steps with work (SGLang)."""
    from harness.analysis import analyze_path  # heavy-ish; only runs with traces
    if not profile_record or not profile_record.get("files"):
        return None
    try:
        analysis = analyze_path(local_dir / "profile", requested_steps=profile_record.get("num_steps"))
    except HarnessError as e:
        return {"error": str(e)}
    write_json(local_dir / "analysis.json", analysis)
    return {"file": "analysis.json", "total_gpu_ms": analysis.get("total_gpu_ms"),
            "steps": analysis.get("steps"), "steps_source": analysis.get("steps_source"),
            "per_step_ms": analysis.get("per_step_ms")}


def _nsys_reports(local_dir: Path, record: dict) -> dict:
    """Under nsys the report appears when the server exits: look for it in what was collected."""
    reports = sorted(p for p in (local_dir / "profile").glob("*") if p.suffix in (".nsys-rep", ".qdrep", ".qdstrm"))
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
    pb = sweep.playbook.model_dump(mode="json", exclude={"configs", "repeat", "placement", "template"})
    config = ctx.run.config.model_dump(mode="json")
    pb["server"]["env"] = sweep.redactor.env(pb["server"]["env"], sweep.secret_names)
    config["env"] = sweep.redactor.env(config["env"], sweep.secret_names)
    return pb | {"hosts": ctx.host.name, "configs": [config], "repeat": 1, "placement": "pool"}


def _manifest(ctx: RunContext, error: HarnessError | None, profile_record: dict | None,
              started: float) -> dict:
    sweep, redact = ctx.sweep, ctx.sweep.redactor
    status = "failed" if error else "ok"
    log_tail = ctx.record.get("log_tail")
    if log_tail is None and (ctx.local_dir / "server.log").exists():
        log_tail = tail((ctx.local_dir / "server.log").read_text(errors="replace"), 40)
    profile_out = None
    if profile_record is not None and profile_record.get("status") == "pending":
        profile_record = _nsys_reports(ctx.local_dir, profile_record)
    if profile_record is not None:
        profile_out = {k: profile_record.get(k) for k in
                       ("status", "mode", "files", "missing_ranks", "ranks_found", "expected_ranks", "num_steps", "dir",
                        "bytes", "error", "hint", "answers", "seconds")}
        if profile_record.get("status") != "failed":
            profile_out["analysis"] = _analyze(ctx.local_dir, profile_record)
    manifest = {
        "schema": "harness.run/1",
        "run_id": ctx.run.run_id,
        "sweep_id": sweep.sweep_id,
        "config": {"name": ctx.run.config.name, "description": ctx.run.config.description,
                   "args": ctx.rendered.args,
                   "env": redact.env({**ctx.rendered.env, **ctx.rendered.secret_env}, sweep.secret_names)},
        "repeat": ctx.run.repeat,
        "host": ctx.host.public(redact),
        "engine": sweep.engine.name,
        "protocol": sweep.engine.speaks,
        "model": sweep.playbook.model.model_dump(),
        "gpus_used": sweep.engine.ranks(ctx.rendered.args),
        "port": ctx.rendered.port,
        "template": template_record(sweep.template),
        "playbook": resolved_playbook(ctx),
        "benchmark": sweep.playbook.benchmark.model_dump(),
        "profile_settings": sweep.playbook.profile.model_dump(),
        "status": status,
        "error": ({"kind": error.kind, "message": str(error),
                   "detail": error.detail() if isinstance(error, RemoteError) else str(error),
                   "log_tail": log_tail} if error else None),
        "attempts": ctx.record.get("attempts", 1),
        "phases": ctx.phases,
        "collected": ctx.record.get("collected", {"files": 0, "bytes": 0}),
        "profile": profile_out,
        "facts": parse_facts(facts_for(sweep.engine), ctx.local_dir / "facts"),
        "probe": ctx.record.get("probe"),
        "teardown": ctx.record.get("teardown"),
        "warnings": ctx.record.get("warnings", []),
        "started": started,
        "finished": time.time(),
        "harness_version": harness.__version__,
    }
    manifest = redact.data(manifest)
    write_json(ctx.local_dir / "manifest.json", manifest)
    return manifest
