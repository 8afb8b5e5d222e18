"""Preflight: before anything is launched, is this host able to run this configuration?

One remote command checks the venv, the engine import, the port, the GPUs and the disk (the agent's
`probe`) and lists the installed engine's flags (so a flag the installed version dropped fails here,
in seconds, not at 3 a.m.), the two at once on the host. A host's first preflight of a sweep also
starts the collection of its facts, which runs while the server starts (harness.facts).
"""

from __future__ import annotations

import contextlib
import difflib
import shlex

from harness.errors import HarnessError, Kind, RunFailed
from harness.facts import agent_words, background_script, collect_script, facts_for
from harness.lifecycle.context import RunContext
from harness.render import flag_pairs
from harness.results.answers import AnswerError, Probe, read_answer

NO_VENV = "__harness_no_venv__"
NO_NSYS = "__harness_no_nsys__"
SEP = "__harness_help__"


def preflight(ctx: RunContext) -> Probe:
    q = shlex.quote
    engine, paths = ctx.sweep.engine, ctx.paths
    # What cannot change between runs of one sweep on one host (the engine imports, its flags, the host's
    # facts) is found once and kept beside the runs: importing a real engine and listing its flags take
    # seconds each, every run.
    kept = ctx.host_cache
    cache, listed = q(kept.root), q(kept.help)
    # The probe marks the host once the engine imports (--imported); later runs ask for no import.
    module = f"$([ -f {q(kept.imported)} ] || echo {q(engine.module)})" if engine.module else ""
    probing = ctx.agent_command("probe", "--port", ctx.rendered.port, "--bind", ctx.server_address,
                                "--dir", paths.root, "--imported", kept.imported) + f' "--module={module}"'
    nsys = (f"( {ctx.in_venv('command -v nsys')} ) >/dev/null 2>&1 || echo {NO_NSYS}; "
            if ctx.sweep.playbook.profile.mode == "nsys" else "")
    # The flag listing runs beside the probe: on a GPU host each imports the engine, seconds apiece, at
    # the first run of a sweep on each host. The listing is written aside and moved into place, so a
    # preflight cut short (a lost link, a timeout) leaves no half of a listing that the host's later
    # runs would take for the whole.
    # Only a listing that worked is kept: one that failed (the engine's import broke for a moment, a
    # driver mid-upgrade) is shown once, as `.failed`, and the next run on the host lists again.
    listing = (f"{{ [ -s {listed} ] || {{ ( {ctx.in_venv(engine.help_command)} ) > {listed}.$$ 2>&1 && "
               f"grep -q -e --help {listed}.$$ && mv -f {listed}.$$ {listed} || mv -f {listed}.$$ {listed}.failed; "
               f"}}; }} & " if engine.help_command else "")
    # The facts are started apart and not waited for here: the run's server starts meanwhile, and the
    # run copies them into its folder when its health check ends (harness.facts), or as it fails.
    collecting = kept.facts + ".tmp"
    facts = background_script(ctx.in_venv(collect_script(
        facts_for(engine), collecting, ctx.agent_command(*agent_words(engine, collecting)))), kept.facts)
    help_tail = (f"if [ -s {listed} ]; then tail -c 2000000 {listed}; else tail -c 2000000 {listed}.failed; "
                 f"rm -f {listed}.failed; fi; " if engine.help_command else "")
    # The run's folder starts empty at every attempt: a failed run's is left on the host for whoever
    # looks into it, and a retry there (or `--resume --retry-failed`) must not pull its old traces.
    command = (f"test -x {q(ctx.python)} || {{ echo {NO_VENV}; exit 0; }}; {nsys}"
               f"rm -rf {q(paths.root)} && mkdir -p {q(paths.profile_dir)} {q(paths.facts_dir)} {cache} && "
               f"{{ {facts}; {listing}{probing}; wait; }}; "
               f"echo {SEP}; {help_tail}true")
    result = ctx.sh(command, timeout=600)
    out = result.stdout
    if NO_VENV in out:
        raise _unfit(ctx, f"the venv {ctx.venv} does not exist on {ctx.host.name} (no "
                       f"{ctx.python}): create it there, or fix `venv:` for this host in the inventory")
    if NO_NSYS in out:
        raise _unfit(ctx, f"profile.mode is nsys but nsys is not on the PATH of {ctx.venv} on "
                       f"{ctx.host.name}: install Nsight Systems there, or use profile.mode engine")
    probe_text, _, help_text = out.partition(SEP)
    try:
        probe = read_answer(Probe, probe_text)
    except AnswerError as e:
        raise _unfit(ctx, f"the venv python {ctx.python} on {ctx.host.name} could not run the "
                       f"harness agent's probe ({e})", output=(probe_text + result.stderr)[-8000:]) from None
    if not probe.module_ok:
        raise _unfit(ctx, f"the venv {ctx.venv} on {ctx.host.name} cannot import "
                       f"{engine.module!r} ({probe.module_error}): install it in that venv, or "
                       f"point `venv:` at the venv that has it")
    if not probe.port_free:
        holders = "; ".join(f"pid {h.pid}: {h.command}" for h in probe.port_holders)
        raise _unfit(ctx, f"port {ctx.rendered.port} on {ctx.host.name} is already in use "
                       f"({holders}); stop that server or choose another server.port")
    if busy := probe.gpus.processes:
        held = "; ".join(f"pid {p.pid} {p.name} ({p.memory_mib} MiB)" for p in busy)
        raise _unfit(ctx, f"the GPUs of {ctx.host.name} are busy: {held}")
    if not engine.help_command:
        return probe
    if "--help" not in help_text:
        raise _unfit(ctx, f"`{engine.help_command}` in {ctx.venv} on {ctx.host.name} listed no "
                       "flags", output=help_text[-2000:])
    unknown = engine.unknown_flags(help_text, sorted({f for f, _ in flag_pairs(ctx.rendered.args)}))
    if unknown:
        known = engine.known_flags(help_text)
        named = "; ".join(f"{flag} (did you mean {near[0]}?)" if (near := difflib.get_close_matches(
            flag, known, n=1, cutoff=0.8)) else flag for flag in unknown)
        raise _failed(ctx, f"the {engine.name} installed in {ctx.venv} on {ctx.host.name} does not "
                       f"accept {named}: not in `{engine.help_command}` (a typo, or a flag this version "
                       "renamed or removed)", output=help_text[-2000:])
    return probe


def _unfit(ctx: RunContext, message: str, *, output: str = "") -> RunFailed:
    """A preflight failure of the host rather than of the configuration (its venv, its engine, its
    GPUs or port held by another job, its flag listing): no run would fare better there, so the
    executor sets the host aside for the sweep and hands the run to another host of its own."""
    ctx.found.host_unfit = True
    return _failed(ctx, message, output=output)


def _failed(ctx: RunContext, message: str, *, output: str = "") -> RunFailed:
    """The preflight's failure, with the host's facts in the run's folder first: nothing else of the
    run comes after it to copy them, and they say what the host has (its engine's version, its GPUs)."""
    with contextlib.suppress(HarnessError):
        ctx.copy_facts()
    return ctx.fail(Kind.PREFLIGHT, message, output=output)
