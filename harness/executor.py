"""Scheduling a sweep's runs over its hosts so that it survives a night alone.

- One worker thread per host, each with its own connection (a shared SFTP client deadlocks across
  threads: paramiko #718); `--jobs` bounds how many runs are in flight at once. With `placement: pool`
  a run goes to whichever of its hosts frees up first; with `each` it is pinned to its host.
- Every state change is appended to the journal (fsync) before anything else happens, so a kill at
  any instant loses at most the runs in flight, and `--resume` knows exactly which those were.
- Transient failures (unreachable, timeout, collect, server_died) are retried with exponential
  backoff and jitter (tenacity); host-key and auth failures never are. A host that cannot be reached
  is set aside and retried with backoff while its pool runs go to the other hosts.
- A heartbeat renews every running server's lease; the watchdog beside each server stops it when the
  lease lapses, so a killed orchestrator leaves no server holding a GPU. At connect, servers of earlier
  sweeps whose lease lapsed are reaped.
- `--deadline` stops starting runs; Ctrl-C and SIGTERM stop every running server before exiting.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import random
import shlex
import shutil
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import tenacity

import harness
from harness.config.inventory import Host
from harness.errors import HarnessError, Kind
from harness.journal import Journal, latest_states
from harness.lifecycle.context import RunContext
from harness.lifecycle.run import execute
from harness.lifecycle.server import stop_command
from harness.lock import SweepLock
from harness.plan import RunPaths, RunSpec, Sweep
from harness.remote import install, private_workdir, remote_dir, tool_command
from harness.report.live import Display, describe_tick
from harness.results import atomic_write, read_json, write_json, write_summary
from harness.resume import fingerprint, plan_resume, run_inputs
from harness.transport import Transport, connect
from harness.transport.tarpull import remove_stale_staging

HOST_BACKOFF_S = (5.0, 300.0)   # first and largest wait between connection attempts to a host


@dataclass
class Outcome:
    sweep_dir: Path
    manifests: list[dict] = field(default_factory=list)
    interrupted: bool = False
    fatal: str | None = None

    @property
    def failed(self) -> list[dict]:
        return [m for m in self.manifests if m["status"] == "failed"]


@dataclass
class HostState:
    host: Host
    transport: Transport | None = None
    attempts: int = 0               # failed connection attempts in a row
    error: HarnessError | None = None
    dead: bool = False
    lost: bool = False              # the heartbeat stopped hearing from it mid-run


class Stopped(Exception):
    """The sweep stopped (Ctrl-C, SIGTERM, --fail-fast) while a run waited to try again: no new attempt."""


class Transient(Exception):
    """A run attempt that failed in a way worth another try."""

    def __init__(self, manifest: dict):
        self.manifest = manifest


def parse_deadline(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """The next local time HH:MM (today, or tomorrow if it has passed)."""
    now = now or dt.datetime.now()
    hour, minute = (int(x) for x in text.split(":"))
    when = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return when if when > now else when + dt.timedelta(days=1)


class Executor:
    def __init__(self, sweep: Sweep, results: Path, *, jobs: int | None = None, display: Display | None = None,
                 fail_fast: bool = False, retries: int = 1, deadline: dt.datetime | None = None,
                 lease_s: float = 60.0, host_retries: int = 5, resume: bool = False,
                 retry_failed: bool = False, accept_changes: bool = False, argv: list[str] | None = None):
        self.sweep, self.fail_fast, self.retries = sweep, fail_fast, retries
        self.deadline, self.lease_s, self.argv = deadline, lease_s, argv or []
        self.host_attempts = host_retries + 1
        self.display = display or Display(None)
        self.sweep_dir = Path(results) / sweep.sweep_id
        self.journal = Journal(self.sweep_dir / "journal.jsonl")
        self.slots = threading.Semaphore(jobs or len(sweep.hosts))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.hosts = {h.name: HostState(h) for h in sweep.hosts}
        self.in_flight: dict[str, RunContext] = {}
        self.attempts: dict[str, int] = {}
        self.outcome = Outcome(self.sweep_dir)
        self.resume, self.retry_failed, self.accept_changes = resume, retry_failed, accept_changes
        self.kept_runs: list[str] = []
        self.todo: list[RunSpec] = [] if resume else list(sweep.runs)   # resume: found once the lock is ours
        self.started = time.time()
        if resume:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.started = read_json(self.sweep_dir / "sweep.json")["started"]

    # --- the sweep ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        """Run the sweep; raises SweepLocked, before touching anything, when another orchestrator runs it."""
        with SweepLock(self.sweep_dir):
            if self.resume:
                self.todo = self._resume()
            return self._run_locked()

    def _run_locked(self) -> Outcome:
        self._write_sweep_json(finished=None)
        for spec in self.todo:
            self.journal.append(spec.run_id, "pending", config=spec.config.name)
        self.display.start(total=len(self.sweep.runs), done=len(self.outcome.manifests),
                           hosts=list(self.hosts))
        workers = [threading.Thread(target=self._worker, args=(s,), name=f"worker-{n}", daemon=True)
                   for n, s in self.hosts.items()]
        heartbeat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
        try:
            for w in [*workers, heartbeat]:
                w.start()
            for w in workers:
                while w.is_alive():
                    w.join(0.2)
        except KeyboardInterrupt:
            self._interrupt()
        finally:
            self.stop.set()
            self.display.stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self._settle_leftovers()
        write_summary(self.sweep_dir)
        self._write_sweep_json(finished=time.time())
        return self.outcome

    def _take(self, state: HostState) -> RunSpec | None:
        """The next run this host may take; None when there is none, or no more may start."""
        with self.lock:
            if self.stop.is_set() or (self.deadline and dt.datetime.now() >= self.deadline):
                return None
            for i, spec in enumerate(self.todo):
                if any(h.name == state.host.name for h in spec.hosts):
                    return self.todo.pop(i)
        return None

    def _give_back(self, spec: RunSpec) -> None:
        with self.lock:
            self.todo.insert(0, spec)

    def _worker(self, state: HostState) -> None:
        try:
            while (spec := self._take(state)) is not None:
                if state.transport is None and not self._open(state):
                    self._give_back(spec)
                    if state.dead or not self._wait(self._host_backoff(state)):
                        return
                    continue
                with self.slots:
                    if self.stop.is_set():
                        self._give_back(spec)
                        return
                    try:
                        self._run(spec, state)
                    except OSError:
                        raise
                    except Exception as e:  # our own bug, outside the run itself: the run fails, not the sweep
                        self._finish(spec, state, self._internal(spec, state, e))
        except OSError as e:  # the local disk (results) failed us: nothing more can be recorded safely
            self.outcome.fatal = f"cannot write results in {self.sweep_dir}: {e}"
            self.display.log(self.outcome.fatal)
            self.stop.set()
        finally:
            if state.transport is not None:
                state.transport.close()

    def _open(self, state: HostState) -> bool:
        """Connect, upload the agent and client, reap servers of earlier sweeps whose lease lapsed."""
        host = state.host
        try:
            transport = connect(host.spec())
            installed = install(transport, host.workdir, host=host.name)
            host = host.model_copy(update={"workdir": installed.workdir,     # absolute from now on
                                           "venv": installed.resolve(host.venv)})
            assert host.venv is not None  # the sweep refuses a host without one
            python = host.venv + "/bin/python"
            reap = tool_command(python, installed.tools, "agent", "reap", "--workdir", host.workdir,
                                "--lease-s", self.lease_s)
            reaped = transport.run(f"test -x {shlex.quote(python)} && {reap}", timeout=120, check=False).stdout
            if '"pid"' in reaped:
                self.display.log(f"[{host.name}] stopped servers left by an earlier sweep: {reaped.strip()}")
        except Exception as e:  # HarnessError, or our own bug: either way this host is set aside
            if not isinstance(e, HarnessError):
                e = HarnessError(f"the harness failed connecting to {host.name} ({internal_text(e)})",
                                 kind=Kind.INTERNAL)
            state.attempts += 1
            state.error = e
            state.dead = e.kind.host_fatal or state.attempts >= self.host_attempts
            self.display.log(f"[{host.name}] set aside{' for this sweep' if state.dead else ''}: "
                             f"{self.sweep.redactor.text(str(e))}")
            self.display.host(host.name, "down" if not state.dead else f"dead: {e.kind}")
            return False
        state.host, state.transport, state.attempts, state.error, state.lost = host, transport, 0, None, False
        self.display.host(host.name, "idle")
        return True

    def _host_backoff(self, state: HostState) -> float:
        first, most = HOST_BACKOFF_S
        return min(most, first * 2 ** (state.attempts - 1)) * random.uniform(0.75, 1.25)

    def _wait(self, seconds: float) -> bool:
        """Sleep unless the sweep stops; False if it did."""
        return not self.stop.wait(seconds)

    # --- one run, with retries ---------------------------------------------------------------------

    def _run(self, spec: RunSpec, state: HostState) -> None:
        out_of_attempts = tenacity.stop_after_attempt(self.retries + 1)

        def stop(retry_state: tenacity.RetryCallState) -> bool:
            return out_of_attempts(retry_state) or state.lost

        def sleep(seconds: float) -> None:
            self.stop.wait(seconds)

        attempts = tenacity.Retrying(
            stop=stop,
            wait=tenacity.wait_exponential_jitter(multiplier=2, max=60),
            retry=tenacity.retry_if_exception_type(Transient),
            sleep=sleep, reraise=True)
        try:
            manifest = attempts(self._attempt, spec, state)
        except Stopped:
            return   # left for --resume: the run is still pending in the journal, or interrupted
        except Transient as t:
            manifest = t.manifest
            gone = state.lost or manifest["error"]["kind"] == "unreachable"
            if gone:
                # the host went away under us: its next run waits for it with the host backoff
                if state.transport is not None:
                    state.transport.close()
                state.transport, state.attempts = None, state.attempts + 1
            if gone and self._others_alive(spec, state):   # another host runs this one again
                self.journal.append(spec.run_id, "retry", host=state.host.name,
                                    error_kind=manifest["error"]["kind"])
                self._give_back(spec)
                return
        self._finish(spec, state, manifest)

    def _attempt(self, spec: RunSpec, state: HostState) -> dict:
        if self.stop.is_set():   # Ctrl-C came during the backoff before this attempt
            raise Stopped
        host = state.host
        with self.lock:
            attempt = self.attempts[spec.run_id] = self.attempts.get(spec.run_id, 0) + 1
        local_dir = self.sweep_dir / "runs" / spec.run_id
        shutil.rmtree(local_dir, ignore_errors=True)  # a partial earlier attempt: never mixed into this one
        remove_stale_staging(local_dir)               # and what a pull killed with the orchestrator left
        local_dir.mkdir(parents=True)
        transport = state.transport
        assert transport is not None  # the worker opened it before taking the run
        ctx = RunContext(self.sweep, spec, host, transport, self.sweep.render(spec, host), local_dir,
                         remote_dir(host.workdir), lease_s=self.lease_s,
                         on_phase=lambda p: self.display.phase(host.name, spec.run_id, p))
        ctx.record["attempts"] = attempt
        if attempt > 1:
            ctx.sh(f"rm -rf {shlex.quote(ctx.paths.root)}", timeout=120, check=False)
        with self.lock:
            self.in_flight[spec.run_id] = ctx
        self.journal.append(spec.run_id, "running", host=host.name, attempt=attempt)
        try:
            manifest = execute(ctx)
        except Exception as e:  # our own bug inside the run: recorded, its server stopped, the sweep goes on
            manifest = self._internal(spec, state, e, ctx)
        finally:
            with self.lock:
                self.in_flight.pop(spec.run_id, None)
        error = manifest.get("error") or {}
        if (Kind.of(error.get("kind")).retried or state.lost) and not self.stop.is_set():
            self.display.log(f"[{host.name}] {spec.run_id}: attempt {attempt} failed "
                             f"({error['kind']}: {error['message']})")
            raise Transient(manifest)
        return manifest

    def _internal(self, spec: RunSpec, state: HostState, error: Exception, ctx: RunContext | None = None) -> dict:
        """A run that an unexpected exception of the harness's own ended: failed with kind `internal`,
        the traceback in the run's `harness-error.log`, its server stopped. Never retried: the same
        bug would end it again."""
        redact = self.sweep.redactor.text
        local_dir = self.sweep_dir / "runs" / spec.run_id
        trace = redact("".join(traceback.format_exception(error)))
        atomic_write(local_dir / "harness-error.log", trace)
        if ctx is not None:
            try:
                ctx.sh(stop_command(ctx), timeout=120, check=False)
            except Exception as e:  # the watchdog stops it when the lease lapses
                self.display.log(f"[{state.host.name}] could not stop {spec.run_id}: {internal_text(e)}")
        message = redact(f"the harness failed ({internal_text(error)}): a bug, please report it with "
                         f"runs/{spec.run_id}/harness-error.log")
        manifest = {"schema": "harness.run/1", "run_id": spec.run_id, "sweep_id": self.sweep.sweep_id,
                    "config": {"name": spec.config.name}, "host": {"name": state.host.name},
                    "engine": self.sweep.engine.name, "status": "failed",
                    "error": {"kind": Kind.INTERNAL.value, "message": message, "detail": trace},
                    "attempts": self.attempts.get(spec.run_id, 1),
                    "phases": ctx.phases if ctx is not None else {}, "harness_version": harness.__version__}
        write_json(local_dir / "manifest.json", manifest)
        return manifest

    def _others_alive(self, spec: RunSpec, state: HostState) -> bool:
        return any(h.name != state.host.name and not self.hosts[h.name].dead for h in spec.hosts)

    def _finish(self, spec: RunSpec, state: HostState, manifest: dict) -> None:
        if self.stop.is_set() and manifest["status"] != "ok":
            return  # torn down by the interrupt, which journals it
        error = manifest.get("error") or {}
        self.journal.append(spec.run_id, manifest["status"], host=state.host.name,
                            error_kind=error.get("kind"), attempts=manifest.get("attempts"))
        with self.lock:
            self.outcome.manifests.append(manifest)
        self.display.done(manifest)
        if manifest["status"] != "ok" and self.fail_fast:
            self.display.log("--fail-fast: no further runs start")
            self.stop.set()

    # --- leases ---------------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Renew the lease of every running server, over a connection of its own per host.

        It doubles as the failure detector that keepalives are not (paramiko #2463): a host that has
        not answered for a whole lease is lost (its watchdog is stopping the server by now), so its
        worker's connection is closed under the run in flight, which then fails over to another host.
        """
        links: dict[str, Transport] = {}
        answered: dict[str, float] = {}
        interval = max(1.0, self.lease_s / 4)
        while not self.stop.wait(interval):
            with self.lock:
                by_host: dict[str, list[RunContext]] = {}
                for ctx in self.in_flight.values():
                    by_host.setdefault(ctx.host.name, []).append(ctx)
            for name, runs in by_host.items():
                answered.setdefault(name, time.monotonic())
                try:
                    link = links.get(name) or links.setdefault(name, connect(self.hosts[name].host.spec()))
                    # the same round trip brings back how far each benchmark has got (bench.py --progress-file)
                    said = link.run("touch -c " + " ".join(shlex.quote(c.paths.lease) for c in runs)
                                    + "".join(f"; echo; head -c 2000 {shlex.quote(c.paths.bench_progress)} "
                                              "2>/dev/null" for c in runs), timeout=interval, check=False)
                    answered[name] = time.monotonic()
                    self._show_progress(runs, said.stdout)
                except HarnessError:
                    dropped = links.pop(name, None)
                    if dropped is not None:
                        dropped.close()
                    if time.monotonic() - answered[name] > self.lease_s:
                        self._lost(self.hosts[name], time.monotonic() - answered[name])
                        answered.pop(name)
        for link in links.values():
            link.close()

    def _show_progress(self, runs: list[RunContext], stdout: str) -> None:
        """Each run's benchmark progress, as its host reported it: one line a run (empty: none yet)."""
        for ctx, line in zip(runs, stdout.split("\n")[1:], strict=False):
            try:
                state = json.loads(line) if line.strip() else None
            except ValueError:
                continue   # half written, or not ours: the next beat reads it again
            if isinstance(state, dict) and {"level", "levels", "concurrency", "done"} <= set(state):
                self.display.progress(ctx.host.name, ctx.run.run_id, describe_tick(state))

    def _lost(self, state: HostState, silent_s: float) -> None:
        if state.lost:
            return
        state.lost = True
        self.display.log(f"[{state.host.name}] lost: no answer for {silent_s:.0f} s; its runs go elsewhere")
        self.display.host(state.host.name, "lost")
        if state.transport is not None:
            state.transport.close()  # the run in flight fails now instead of waiting on a dead link

    # --- resume and the end -----------------------------------------------------------------------

    def _resume(self) -> list[RunSpec]:
        """The runs still to do; finished runs keep their files, runs in flight are reconciled."""
        plan = plan_resume(self.sweep, self.sweep_dir, retry_failed=self.retry_failed,
                           accept_changes=self.accept_changes)
        states = latest_states(self.journal.path)
        todo = []
        for spec in self.sweep.runs:
            if spec.run_id in plan.done:
                try:
                    self.outcome.manifests.append(read_json(self.sweep_dir / "runs" / spec.run_id /
                                                            "manifest.json"))
                    continue
                except (OSError, ValueError):
                    pass  # journaled as finished but its manifest is gone: run it again
            last = states.get(spec.run_id, {})
            if last.get("state") in ("running", "interrupted") and last.get("host") in self.hosts:
                self._reconcile(spec, self.hosts[last["host"]].host)
            shutil.rmtree(self.sweep_dir / "runs" / spec.run_id, ignore_errors=True)
            todo.append(spec)
        for run_id in plan.removed:
            self.display.log(f"{run_id}: no longer in the playbook; its results are kept")
        for run_id, diff in plan.changed.items():
            self.display.log(f"{run_id}: the playbook changed ({'; '.join(diff)}); accepted")
        self.kept_runs = plan.removed
        return todo

    def _reconcile(self, spec: RunSpec, host: Host) -> None:
        """A run that was in flight when the orchestrator stopped: stop its server, drop its files."""
        try:
            link = connect(host.spec())
            try:
                workdir = private_workdir(link, host.workdir, host=host.name)
                assert host.venv is not None  # the sweep refuses a host without one
                paths = RunPaths.of(host.model_copy(update={"workdir": workdir}), self.sweep.sweep_id, spec.run_id)
                stop = tool_command(host.venv + "/bin/python", remote_dir(workdir), "agent", "stop",
                                    "--pid-file", paths.pid_file, "--port", 1, "--timeout", 20)
                command = f"if [ -f {shlex.quote(paths.pid_file)} ]; then {stop}; fi; rm -rf {shlex.quote(paths.root)}"
                link.run(command, timeout=120, check=False)
            finally:
                link.close()
        except HarnessError as e:  # its watchdog stops it when the lease lapses
            self.display.log(f"[{host.name}] could not reconcile {spec.run_id}: {e}")

    def _settle_leftovers(self) -> None:
        """Runs never started: skipped (deadline, fail-fast, interrupt) or failed (no host could take them)."""
        for spec in self.todo:
            reasons = [self.hosts[h.name].error for h in spec.hosts if self.hosts[h.name].dead]
            if reasons and len(reasons) == len(spec.hosts) and not self.outcome.interrupted:
                err = reasons[0]
                assert err is not None  # a dead host has the error that set it aside
                self._write_unrun(spec, "failed", {"kind": err.kind,
                                                   "message": self.sweep.redactor.text(str(err))})
            elif not self.outcome.interrupted:
                why = ("the deadline passed" if self.deadline and dt.datetime.now() >= self.deadline
                       else "the sweep stopped early")
                self._write_unrun(spec, "skipped", None, why)

    def _write_unrun(self, spec: RunSpec, status: str, error: dict | None, why: str | None = None) -> None:
        manifest = {"schema": "harness.run/1", "run_id": spec.run_id, "sweep_id": self.sweep.sweep_id,
                    "config": {"name": spec.config.name}, "host": {"name": spec.hosts[0].name},
                    "engine": self.sweep.engine.name, "status": status, "error": error, "skipped": why,
                    "attempts": 0, "phases": {}, "harness_version": harness.__version__}
        write_json(self.sweep_dir / "runs" / spec.run_id / "manifest.json", manifest)
        self.outcome.manifests.append(manifest)
        self.journal.append(spec.run_id, status, error_kind=error and error["kind"], reason=why)

    def _interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop starting runs, stop every running server, flush the journal."""
        self.stop.set()
        self.outcome.interrupted = True
        self.display.log("interrupted: stopping the servers of the runs in flight")
        with self.lock:
            in_flight = list(self.in_flight.values())
        for ctx in in_flight:
            try:
                stopper = connect(ctx.host.spec())
                try:
                    stopper.run(stop_command(ctx), timeout=60, check=False)
                finally:
                    stopper.close()
            except HarnessError as e:
                self.display.log(f"[{ctx.host.name}] could not stop {ctx.run.run_id}: {e}")
            self.journal.append(ctx.run.run_id, "interrupted", host=ctx.host.name)

    def _kept_records(self) -> list[dict]:
        """sweep.json's entries of runs an edited playbook no longer has: their results stay."""
        if not self.kept_runs:
            return []
        try:
            before = read_json(self.sweep_dir / "sweep.json").get("runs", [])
        except (OSError, ValueError):
            return []
        return [r for r in before if r.get("run_id") in self.kept_runs]

    def _write_sweep_json(self, finished: float | None) -> None:
        sweep, redact = self.sweep, self.sweep.redactor
        write_json(self.sweep_dir / "sweep.json", redact.data({
            "schema": "harness.sweep/1", "sweep_id": sweep.sweep_id, "harness_version": harness.__version__,
            "playbook_path": str(sweep.doc.path), "playbook": sweep.playbook.model_dump(mode="json"),
            "inventory_path": str(sweep.inventory.path),
            "hosts": [h.public(redact) for h in sweep.hosts],
            "runs": [{"run_id": r.run_id, "config": r.config.name, "hosts": [h.name for h in r.hosts],
                      "inputs": (inputs := run_inputs(sweep, r)), "fingerprint": fingerprint(inputs)}
                     for r in sweep.runs] + self._kept_records(),
            "argv": self.argv, "started": self.started, "finished": finished}))


def internal_text(error: BaseException) -> str:
    """`Type: message` of an unexpected exception, on one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
