"""One run, start to finish: preflight, launch, health, bench, profile, teardown (always), collect, analyze.

Each stage is a function of the RunContext that returns what it found into `ctx.found` (a typed
record, one field a stage); this module only sequences them and times them, and `build_manifest`
turns what they found into the manifest without touching a file. Teardown runs whatever happened
before it; collect runs after teardown (so server.log is complete and nsys has written its report) and
even for a failed run, whose log is the first thing a person wants to read. The analysis of the traces
runs last, apart (`finish`, with the hashes of the files brought back): the executor runs it once the
host is free for its next run.
"""

from __future__ import annotations

import hashlib
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from harness.errors import HarnessError, Kind, RemoteError, RunFailed, tail
from harness.facts import facts_for, parse_facts
from harness.lifecycle.context import RunContext
from harness.lifecycle.measure import bench, profile
from harness.lifecycle.preflight import preflight
from harness.lifecycle.server import dead_node, launch, teardown, wait_healthy
from harness.plan import RunSpec, Sweep
from harness.render import BUILTIN_TEMPLATES
from harness.results import ErrorRecord, RunFiles, RunLayout, RunManifest, atomic_write, write_json, write_model
from harness.results.answers import Answer
from harness.results.models import AnalysisRef, Collected, Phase, ProfileRecord
from harness.results.store import read_telemetry
from harness.secrets import masked_args
from harness.transport.base import Placed
from harness.transport.tarpull import TooLarge, outside

UNREACHABLE = ("unreachable", "auth", "host_key")


def execute(ctx: RunContext) -> RunManifest:
    """Run every stage, collect, and write the manifest. The hashes of the files brought back and the
    profile's analysis (CPU work here) are left to `finish`, which the executor runs once the host is
    free for its next run where traces came back.

    A server on several hosts (`ctx.peers`): every node is preflighted, the other nodes are launched
    before node 0 (which waits for them at its rendezvous), health and the benchmark are node 0's, the
    profile counts every node's ranks, and teardown, collection and cleaning up take in every node.
    Any node's server dying fails the run, naming that node."""
    started = time.time()
    error: HarnessError | None = None
    pb = ctx.sweep.playbook
    atomic_write(ctx.layout.launch, ctx.rendered.script)
    for peer in ctx.peers:
        peer.layout.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(peer.layout.launch, peer.rendered.script)
    try:
        with ctx.phase("preflight"):
            for node in ctx.nodes:
                node.found.probe = preflight(node)
        launched = False
        try:
            with ctx.phase("launch"):
                launched = True   # from the first byte sent: secrets or a server may be on the host now
                for node in [*ctx.peers, ctx]:   # node 0 last: it waits for the others
                    launch(node)
            with ctx.phase("health"):
                wait_healthy(ctx)
            with ctx.phase("bench"):
                _bench(ctx)
            if pb.profile.mode != "none":
                with ctx.phase("profile"):
                    ctx.found.profile = profile(ctx)
        finally:
            if launched:
                _teardown(ctx)
    except HarnessError as e:
        error = e
    # a node gone with what it wrote still reachable (collectable) is pulled only where this attempt's
    # preflight emptied its folder first: else what lies there is an earlier attempt's
    if error is None or error.kind not in UNREACHABLE or (
            error.collectable and all(node.found.probe is not None for node in ctx.nodes)):
        error = _collect(ctx, error)
    if error is None:
        for node in ctx.nodes:
            _clean_up(node)
    manifest = build_manifest(ctx, error, read_back(ctx), started=started, finished=time.time())
    write_model(ctx.layout.manifest, manifest)
    return manifest


def _bench(ctx: RunContext) -> None:
    """The benchmark, on node 0; with other nodes, a server that died on any of them fails the run
    naming the node that went first (node 0 fails its requests when another node goes)."""
    try:
        bench(ctx)
    except RunFailed as e:
        if ctx.peers and (died := dead_node(ctx, "benchmark")) is not None:
            raise died from e
        raise
    if ctx.peers and (died := dead_node(ctx, "benchmark")) is not None:
        raise died


def needs_analysis(manifest: RunManifest) -> bool:
    """Whether traces came back that have no analysis yet."""
    profile = manifest.profile
    return (profile is not None and profile.status != "failed" and bool(profile.files) and profile.analysis is None
            and manifest.collected.files > 0)


def unfinished(manifest: RunManifest) -> bool:
    """Whether the run has work left here once its host is free: files to hash, traces to analyze."""
    return bool(manifest.collected.unhashed) or needs_analysis(manifest)


def finish(layout: RunLayout, manifest: RunManifest) -> RunManifest:
    """What is left of a run once its host is free for the next one, all of it here: the sha256 of
    every file brought back, as it lies in the run folder (text files masked already), then the
    analysis of its traces into analysis.json, its summary in the manifest. The manifest is written
    again once, with both and the time they took (`phases.finish`). The steps asked of the profiler
    stand in only when the traces mark no steps themselves: an engine may run more steps than asked
    (vLLM 0.26 ran 318 for 10) or count only the steps with work (SGLang)."""
    started = time.monotonic()
    update: dict[str, Any] = {}
    if manifest.collected.unhashed:
        update["collected"], gone = _hashed(layout, manifest.collected)
        if gone:
            update["warnings"] = [*manifest.warnings, *(f"{name}: not in the run folder when its sha256 was taken"
                                                        for name in gone)]
    if manifest.profile is not None and needs_analysis(manifest):
        update["profile"] = manifest.profile.model_copy(update={"analysis": _analysis(layout, manifest.profile)})
    if not update:
        return manifest
    update["phases"] = {**manifest.phases, "finish": Phase(seconds=round(time.monotonic() - started, 3))}
    finished = manifest.model_copy(update=update)
    write_model(layout.manifest, finished)
    return finished


def _hashed(layout: RunLayout, collected: Collected) -> tuple[Collected, list[str]]:
    """`collected` with the sha256 of each of its unhashed files, and the names of those no longer
    there. Only names inside the run folder are read (the manifest's own, from a pull that refused
    any other)."""
    sha256, gone = dict(collected.sha256), []
    for name in collected.unhashed:
        path = layout.dir / name
        try:
            if outside(name) or path.is_symlink():
                raise FileNotFoundError(name)
            with path.open("rb") as f:
                sha256[name] = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError:
            gone.append(name)
    return collected.model_copy(update={"sha256": sha256, "unhashed": []}), gone


def _analysis(layout: RunLayout, profile: ProfileRecord) -> AnalysisRef:
    from harness.analysis import analyze_path  # heavy-ish; only runs with traces
    try:
        analysis = analyze_path(layout.profile, requested_steps=profile.num_steps)
        write_json(layout.analysis, analysis)
        return AnalysisRef(file=layout.analysis.name, total_gpu_ms=analysis.get("total_gpu_ms"),
                           steps=analysis.get("steps"), steps_source=analysis.get("steps_source"),
                           per_step_ms=analysis.get("per_step_ms"))
    except HarnessError as e:
        return AnalysisRef(error=str(e))
    except Exception as e:  # our own bug, or our disk: the hashes and the run's measurements stand
        return AnalysisRef(error=f"the analysis failed ({type(e).__name__}: {e}); `harness analyze "
                                 f"{layout.profile}` runs it again")


def _clean_up(ctx: RunContext) -> None:
    """Everything of a good run is here now: its folder on the host goes (a failed run's stays, for
    whoever looks into it there)."""
    try:
        ctx.sh(f"rm -rf {shlex.quote(ctx.paths.root)}", timeout=300, check=False)
    except HarnessError as e:
        ctx.found.warnings.append(f"cleaning up on the host: {e}")


def _teardown(ctx: RunContext) -> None:
    """Every node's server stopped, node 0 first (SGLang's other nodes wait for its shutdown
    broadcast, and a killed node 0 takes them down with it): a failure on one never keeps the others
    running."""
    with ctx.phase("teardown"):
        for node in ctx.nodes:
            try:
                node.found.teardown = teardown(node)
            except HarnessError as e:  # never hide the error that brought us here; record this one
                ctx.found.warnings.append(f"teardown{' of ' + node.label if ctx.peers else ''}: {e}")


def _collect(ctx: RunContext, error: HarnessError | None) -> HarnessError | None:
    """Node 0's run folder into the run's; each other node's into nodes/node<k>/, its traces into
    profile/node<k>/ (names that stay unique whatever the engine calls them). Under `profile.max_mb`,
    node 0's traces too come in a pull of their own, after everything else: a profile over the cap
    fails the profile alone, and the run's benchmark, log and facts are here whatever the traces do.
    (Without the cap one pull brings node 0's folder whole: a second costs a tenth of a collect.)"""
    capped = ctx.sweep.playbook.profile.max_mb is not None and ctx.sweep.playbook.profile.mode != "none"
    pulls: list[tuple[RunContext, str, Path, tuple[str, ...], bool]] = [
        (ctx, ctx.paths.root, ctx.local_dir, (RunFiles.SECRETS, RunFiles.PROFILE) if capped else (RunFiles.SECRETS,),
         False)]
    pulls += [(peer, peer.paths.root, peer.local_dir, (RunFiles.SECRETS, RunFiles.PROFILE), False)
              for peer in ctx.peers]
    pulls += [(node, node.paths.profile_dir, ctx.layout.node_profile(node.node_rank) if node is not ctx
               else ctx.layout.profile, (), True) for node in ctx.nodes if node is not ctx or capped]
    with ctx.phase("collect"):
        for node, remote, local, exclude, traces in pulls:
            error = _pull(ctx, node, remote, local, exclude, error, traces=traces)
            if error is not None and error.kind is Kind.COLLECT:
                break
    if ctx.found.collected is not None:
        _redact_texts(ctx)
    return error


def _pull(ctx: RunContext, node: RunContext, remote: str, local: Path, exclude: tuple[str, ...],
          error: HarnessError | None, *, traces: bool) -> HarnessError | None:
    max_mb = ctx.sweep.playbook.profile.max_mb if traces else None
    had = ctx.found.collected or Collected()
    try:   # the pull itself refuses what the local disk cannot hold
        budget = int(max_mb * 1e6) - ctx.found.trace_bytes if max_mb else None
        pulled = node.transport.pull(remote, local, timeout=3600, exclude=exclude,
                                     max_bytes=max(1, budget) if budget is not None else None)
        prefix = local.relative_to(ctx.local_dir).as_posix() + "/" if local != ctx.local_dir else ""
        ctx.found.collected = Collected(files=had.files + pulled.files, bytes=had.bytes + pulled.bytes,
                                        unhashed=had.unhashed + [prefix + k for k in pulled.sizes],
                                        skipped=had.skipped + [prefix + k for k in pulled.skipped])
        if traces:
            ctx.found.trace_bytes += pulled.bytes
    except HarnessError as e:
        if isinstance(e, TooLarge) and max_mb:   # the cap the playbook set: the profile fails, the run stands
            ctx.found.profile = (ctx.found.profile or {"mode": ctx.sweep.playbook.profile.mode}) | {
                "status": "failed", "error": f"not brought back: {e.message}",
                "hint": "raise profile.max_mb, or profile fewer steps (profile.num_steps)"}
            return error
        if isinstance(e, TooLarge) and not max_mb:
            hinted = RemoteError(f"{e.message}, or cap the profile with profile.max_mb", kind=Kind.COLLECT,
                                 output=getattr(e, "output", ""))
            hinted.__cause__ = e
            e = hinted
        if error is None:   # whatever broke the pull (a timeout, a lost link), the run failed collecting
            if e.kind is Kind.COLLECT:
                return e
            failed = RemoteError(f"collecting the run's files{' from ' + node.label if ctx.peers else ''} "
                                 f"failed: {e.message}", kind=Kind.COLLECT, output=getattr(e, "output", ""))
            failed.__cause__ = e
            return failed
        ctx.found.warnings.append(f"collect{' from ' + node.label if ctx.peers else ''}: {e}")
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
    for section in (pb["server"], config):
        section["env"] = sweep.redactor.env(section["env"], sweep.secret_names)
        section["args"] = masked_args(section["args"], sweep.secret_names)
    # a server on several hosts: every node's, node 0 first; a Slurm node's group, which the next
    # allocation takes its nodes from (the node itself is no host of the inventory)
    hosts = ",".join(dict.fromkeys(n.host.cluster or n.host.name for n in ctx.nodes))
    if sweep.playbook.optuna is not None:   # a trial: its config holds the point, the run searches nothing
        pb["search"] = None
    return pb | {"hosts": hosts, "configs": [config], "repeat": 1, "placement": "pool"}


@dataclass(frozen=True)
class FromFiles:
    """What the files brought back say, read once: the inputs of the manifest that are not in memory."""
    log_tail: str | None
    facts: dict[str, Any]
    template: dict[str, Any]
    profile: dict[str, Any] | None      # the profile's record, nsys's report looked for
    telemetry_errors: tuple[str, ...] = ()   # what the sampler could not read (telemetry.jsonl's notes)


def read_back(ctx: RunContext) -> FromFiles:
    log_tail = next((n.found.log_tail for n in ctx.nodes if n.found.log_tail is not None), None)
    if log_tail is None and ctx.layout.server_log.exists():
        log_tail = tail(ctx.layout.server_log.read_text(errors="replace"), 40)
    record = ctx.found.profile
    if record is not None and record.get("status") == "pending":
        record = _nsys_reports(ctx.layout, record)
    telemetry = read_telemetry(ctx.layout.telemetry)
    hint = ctx.sweep.engine.metrics_hint
    errors = tuple(e + (f": {hint}" if hint and "HTTP 404" in e else "")
                   for e in (telemetry.notes(errors_only=True) if telemetry else ()))
    return FromFiles(log_tail, parse_facts(facts_for(ctx.sweep.engine), ctx.layout.facts),
                     template_record(ctx.sweep.template), record, errors)


PROFILE_FIELDS = ("status", "mode", "files", "missing_ranks", "ranks_found", "expected_ranks", "num_steps", "dir",
                  "bytes", "error", "hint", "answers", "seconds")
"""What the manifest keeps of the agent's answer to `profile`."""


def placement(ctx: RunContext) -> dict[str, Any] | None:
    """Where a scheduler put the run (node 0's step); a server on several nodes lists every node."""
    if not isinstance(ctx.transport, Placed):
        return None
    where = ctx.transport.placement(ctx.found.server_step)
    for peer in ctx.peers:
        if isinstance(peer.transport, Placed):
            where["nodes"] = [*where["nodes"], *(n for n in peer.transport.placement(None)["nodes"]
                                                 if n not in where["nodes"])]
    return where


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
                   "env": redact.env({k: v for k, v in {**ctx.rendered.env, **ctx.rendered.secret_env}.items()
                                      if v is not None}, sweep.secret_names),
                   "unset": [k for k, v in ctx.rendered.env.items() if v is None]},
        "repeat": ctx.run.repeat,
        "host": ctx.host.public(redact),
        "placement": placement(ctx),
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
        "probe": recorded(found.probe),
        "teardown": recorded(found.teardown),
        "nodes": [node_record(ctx, n) for n in ctx.nodes] if ctx.peers else [],
        "warnings": found.warnings + [f"telemetry: {e}" for e in files.telemetry_errors]
                    + [f"{p.label}: {w}" for p in ctx.peers for w in p.found.warnings],
        "started": started,
        "finished": finished,
        "harness_version": harness.__version__,
    }))


def recorded(answer: Answer | None) -> dict[str, Any] | None:
    return answer.record() if answer is not None else None


def node_record(ctx: RunContext, node: RunContext) -> dict[str, Any]:
    """One node of a server on several hosts, as the manifest lists it."""
    record: dict[str, Any] = {"rank": node.node_rank, "host": node.host.name,
                              "teardown": recorded(node.found.teardown),
                              "dir": node.local_dir.relative_to(ctx.local_dir).as_posix() or ".",
                              "profile_dir": RunFiles.PROFILE if not node.node_rank else
                              ctx.layout.node_profile(node.node_rank).relative_to(ctx.local_dir).as_posix()}
    if not node.node_rank and ctx.rendered.node is not None:
        record["address"] = ctx.rendered.node.head_address
    return record


def unrun_manifest(sweep: Sweep, spec: RunSpec, host: str, status: str, error: ErrorRecord | None,
                   **fields: Any) -> RunManifest:
    """The manifest of a run that did not get far enough to write its own: skipped (a deadline,
    --fail-fast), failed before it started (no host could take it), or ended by the harness's own bug."""
    return RunManifest.model_validate({
        "run_id": spec.run_id, "sweep_id": sweep.sweep_id, "config": {"name": spec.config.name},
        "host": {"name": host}, "engine": sweep.engine.name, "status": status, "error": error,
        "harness_version": harness.__version__, **fields})
