"""Scheduling a sweep's runs over its hosts so that it survives a night alone.

- One worker thread per host, each with its own connection (a shared SFTP client deadlocks across
  threads: paramiko #718); `--jobs` bounds how many runs are in flight at once. With `placement: pool`
  a run goes to whichever of its hosts frees up first; with `each` it is pinned to its host.
- Every state change is appended to the journal (fsync) before anything else happens, so a kill at
  any instant loses at most the runs in flight, and `--resume` knows exactly which those were.
- A failed attempt whose error kind is retried (`Kind.retried`: unreachable, timeout, collect,
  server_died) is tried again with exponential backoff and jitter (tenacity); host-key and auth
  failures never are. Hosts (connecting, backoff, setting aside, leases) are `harness.hosts`.
- `--deadline` stops starting runs; Ctrl-C and SIGTERM stop every running server before exiting.
- A run on several hosts (`nodes: N`) starts only when N of its hosts are free at once: its worker's
  host is node 0 and the others are taken with it in one step, never one by one, so two such runs
  waiting for hosts cannot hold half of them each. Runs start in order: one waiting for its hosts is
  not passed by the runs behind it (which would keep its hosts busy forever).

The executor knows no terminal: it tells `events` (the live display implements them), and it takes
`connect`, so a test can hand it a transport that fails on cue.
"""

from __future__ import annotations

import datetime as dt
import errno
import shlex
import shutil
import signal
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import tenacity

from harness.config.inventory import Host
from harness.errors import HarnessError, Kind, RemoteError, RunFailed
from harness.events import Events, Quiet
from harness.hosts import HOST_BACKOFF_S, Beat, Connect, HostPool, HostState, internal_text
from harness.journal import Journal, latest_states
from harness.lifecycle.context import Node, RunContext
from harness.lifecycle.run import execute, finish, needs_analysis, unfinished, unrun_manifest
from harness.lifecycle.server import stop_command
from harness.lock import SweepLock
from harness.plan import RunSpec, Sweep
from harness.remote import private_workdir, remote_dir, tool_command
from harness.results import (
    ErrorRecord,
    HostRunLayout,
    JournalEvent,
    RunLayout,
    RunManifest,
    SweepLayout,
    Unreadable,
    atomic_write,
    load_run,
    read_sweep,
    write_model,
    write_summary,
)
from harness.resume import plan_resume, sweep_record
from harness.transport import connect as connect_over_transport
from harness.transport.base import Placed
from harness.transport.tarpull import remove_stale_staging

__all__ = ["Executor", "Outcome", "internal_text", "parse_deadline"]


@dataclass
class Outcome:
    sweep_dir: Path
    manifests: list[RunManifest] = field(default_factory=list)
    interrupted: bool = False
    fatal: str | None = None

    @property
    def failed(self) -> list[RunManifest]:
        return [m for m in self.manifests if m.status == "failed"]


class RunSource(Protocol):
    """Runs decided while the sweep goes (a search, harness.search): asked for one more whenever a host
    is free and no run waits, told every run that ends. `next` returns None when it has none to give now."""
    total: int

    def next(self) -> RunSpec | None: ...

    def ended(self, manifest: RunManifest) -> None: ...

    def close(self, *, interrupted: bool) -> None:
        """The sweep is over; `interrupted`: Ctrl-C (or SIGTERM) stopped the runs in flight, which
        were never told and which `--resume` runs again."""


class Stopped(Exception):
    """The sweep stopped (Ctrl-C, SIGTERM, --fail-fast) while a run waited to try again: no new attempt."""


class Attempted(Exception):
    """A run attempt that ended in a way `_run` acts on, with the attempt's manifest."""

    def __init__(self, manifest: RunManifest):
        self.manifest = manifest


class Transient(Attempted):
    """A run attempt that failed in a way worth another try."""


class Unfit(Attempted):
    """A run attempt whose host, or the host of one of its other nodes, failed the preflight (its venv,
    engine, GPUs, port): those hosts take no further runs of the sweep."""

    def __init__(self, manifest: RunManifest, hosts: list[str]):
        super().__init__(manifest)
        self.hosts = hosts


STOPPABLE = frozenset({"preflight", "launch", "health", "bench", "profile"})
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""The local disk refusing the results (full, over quota, read-only): no bug of ours, and no later run
could be recorded either, so the sweep stops (`--resume` once there is room)."""
"""The phases a run does not begin once the sweep is stopping: an interrupt stops the servers in flight
once, and a run in its preflight then would launch one after it. Teardown and collect still run."""


def parse_deadline(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """The next local time HH:MM (today, or tomorrow if it has passed)."""
    now = now or dt.datetime.now()
    hour, minute = (int(x) for x in text.split(":"))
    when = now.replace(hour=hour, minute=minute, second=0, microsecond=0)
    return when if when > now else when + dt.timedelta(days=1)


class Executor:
    def __init__(self, sweep: Sweep, results: Path, *, jobs: int | None = None, events: Events | None = None,
                 fail_fast: bool = False, retries: int = 1, deadline: dt.datetime | None = None,
                 lease_s: float = 60.0, host_retries: int = 5, resume: bool = False,
                 retry_failed: bool = False, accept_changes: bool = False, argv: list[str] | None = None,
                 connect: Connect = connect_over_transport, source: RunSource | None = None):
        self.sweep, self.fail_fast, self.retries, self.source = sweep, fail_fast, retries, source
        self.deadline, self.lease_s, self.argv = deadline, lease_s, argv or []
        self.events: Events = events or Quiet()
        self.layout = SweepLayout.of(results, sweep.sweep_id)
        self.sweep_dir = self.layout.dir
        self.journal = Journal(self.layout.journal)
        self.slots = threading.Semaphore(jobs or len(sweep.hosts))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)   # the queue changed, or a held run was released
        self.held = 0                                   # runs a worker took and has not released
        self.busy: set[str] = set()                     # hosts running a run (as node 0 or another node)
        self.peers: dict[str, list[HostState]] = {}     # run id -> the other nodes of a run on several hosts
        self.torn_down: set[str] = set()                # runs the interrupt stops (and journals)
        self.told: set[str] = set()                     # runs the source (a search) has been told of
        self.journaled: set[str] = set()                # runs journaled as ended (ok, failed)
        # what is left of a run once its host is free (its files' hashes, its traces' analysis): CPU work
        # here, one run at a time, while the host runs its next run
        self.afterwards = ThreadPoolExecutor(max_workers=1, thread_name_prefix="afterwards")
        self.pool = HostPool(sweep.hosts, connect=connect, events=self.events, lease_s=lease_s,
                             attempts=host_retries + 1, redact=sweep.redactor.text)
        self.in_flight: dict[str, RunContext] = {}
        self.attempts: dict[str, int] = {}
        # run id -> the hosts it was lost under, its last attempt's manifest and host (`_move`)
        self.lost_under: dict[str, tuple[set[str], RunManifest, HostState]] = {}
        self.outcome = Outcome(self.sweep_dir)
        self.resume, self.retry_failed, self.accept_changes = resume, retry_failed, accept_changes
        self.kept_runs: list[str] = []
        self.todo: list[RunSpec] = [] if resume else list(sweep.runs)   # resume: found once the lock is ours
        self.started = time.time()
        if resume and (record := read_sweep(self.layout)) is not None and record.started:
            self.started = record.started

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
        total = self.source.total if self.source else len(self.sweep.runs)
        self.events.start(total=total, done=len(self.outcome.manifests), hosts=list(self.pool.states))
        workers = [threading.Thread(target=self._worker, args=(s,), name=f"worker-{n}", daemon=True)
                   for n, s in self.pool.states.items()]
        previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
        try:
            self.pool.heartbeats(self._beats, self.stop)
            for w in workers:
                w.start()
            for w in workers:
                while w.is_alive():
                    w.join(0.2)
        except KeyboardInterrupt:
            self._interrupt()
        finally:
            self.stop.set()
            self.afterwards.shutdown(wait=True)   # a run is journaled finished once it is completed
            self.events.stop()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self._settle_leftovers()
        if self.source is not None:
            self.source.close(interrupted=self.outcome.interrupted)
        write_summary(self.sweep_dir)
        self._write_sweep_json(finished=time.time())
        return self.outcome

    def _beats(self, host: str) -> list[Beat]:
        """Every node's lease on `host` (each node of a run on several hosts has its own watchdog)."""
        with self.lock:
            return [Beat(c.run.run_id, n.paths.lease, n.paths.bench_progress)
                    for c in self.in_flight.values() for n in c.nodes if n.host.name == host]

    def _take(self, state: HostState) -> RunSpec | None:
        """The next run this host may take (the other hosts of a run on several taken with it, in
        `self.peers`); None when there is none and none can come back (a run another worker holds may:
        its host may be lost), or when no more may start."""
        with self.changed:
            while not self.stop.is_set() and not (self.deadline and dt.datetime.now() >= self.deadline):
                if state.dead:   # set aside: what only it could take fails with its error at the end
                    return None
                for i, spec in enumerate(self.todo if state.host.name not in self.busy else []):
                    if not any(h.name == state.host.name for h in spec.hosts) or self._lost_here(spec, state):
                        continue
                    peers = self._free_peers(spec, state)
                    if peers is None:
                        break   # in order: the runs behind one waiting for its hosts wait too
                    self.held += 1
                    self.busy |= {state.host.name, *(p.host.name for p in peers)}
                    if peers:
                        self.peers[spec.run_id] = peers
                    return self.todo.pop(i)
                if (self.source is not None and not self.todo and state.host.name not in self.busy
                        and (grown := self.source.next()) is not None):
                    self.sweep.runs.append(grown)   # a search's next trial: taken as any waiting run is
                    self.journal.append(grown.run_id, "pending", config=grown.config.name)
                    self.todo.append(grown)
                    continue
                if not self.held:
                    return None
                self.changed.wait(1.0)
        return None

    def _free_peers(self, spec: RunSpec, state: HostState) -> list[HostState] | None:
        """The other nodes a run needs, when enough of its hosts are free now (in inventory order);
        [] for a run on one host; None: not now."""
        if spec.nodes == 1:
            return []
        free = [self.pool[h.name] for h in spec.hosts if h.name != state.host.name
                and h.name not in self.busy and not self.pool[h.name].dead]
        return free[:spec.nodes - 1] if len(free) >= spec.nodes - 1 else None

    def _release(self, spec: RunSpec, *, give_back: bool = False) -> None:
        """The worker is done with `spec`: finished, or handed back for any host to take."""
        with self.changed:
            if give_back:
                self.todo.insert(0, spec)
            self.held -= 1
            for peer in self.peers.pop(spec.run_id, []):
                self.busy.discard(peer.host.name)
                self.events.host(peer.host.name, "idle")
            self.changed.notify_all()

    def _free(self, state: HostState) -> None:
        with self.changed:
            self.busy.discard(state.host.name)
            self.changed.notify_all()

    def _open_peers(self, spec: RunSpec) -> bool:
        """Connect the other nodes of a run that are not connected yet; False (each failure counted
        against its host, as for any host) when one cannot be."""
        return all(p.transport is not None or self.pool.open(p) for p in self.peers.get(spec.run_id, []))

    def _worker(self, state: HostState) -> None:
        try:
            while (spec := self._take(state)) is not None:
                if state.transport is None and not self.pool.open(state):
                    self._release(spec, give_back=True)
                    self._free(state)
                    if state.dead or not self._wait(self.pool.backoff(state)):
                        return
                    continue
                if not self._open_peers(spec):
                    self._release(spec, give_back=True)
                    self._free(state)
                    if not self._wait(HOST_BACKOFF_S[0]):
                        return
                    continue
                with self.slots:
                    if self.stop.is_set():
                        self._release(spec, give_back=True)
                        self._free(state)
                        return
                    given_back = False
                    try:
                        given_back = self._run(spec, state)
                    except OSError:
                        raise
                    except Exception as e:  # our own bug, outside the run itself: the run fails, not the sweep
                        self._finish(spec, state, self._internal(spec, state, e))
                    finally:
                        self._release(spec, give_back=given_back)
                        self._free(state)
        except OSError as e:  # the local disk (results) failed us: nothing more can be recorded safely
            self.outcome.fatal = f"cannot write results in {self.sweep_dir}: {e}"
            self.events.log(self.outcome.fatal)
            self.stop.set()
        finally:
            with self.changed:   # another run's node on this host still uses the connection
                while state.host.name in self.busy:
                    self.changed.wait(1.0)
            self.pool.close(state)

    def _wait(self, seconds: float) -> bool:
        """Sleep unless the sweep stops; False if it did."""
        return not self.stop.wait(seconds)

    # --- one run, with retries ---------------------------------------------------------------------

    def _run(self, spec: RunSpec, state: HostState) -> bool:
        """Attempt the run until it succeeds or runs out of attempts; True when it goes back to the
        queue for another host (this one was lost under it)."""
        out_of_attempts = tenacity.stop_after_attempt(self.retries + 1)

        def stop(retry_state: tenacity.RetryCallState) -> bool:
            return out_of_attempts(retry_state) or state.lost

        def sleep(seconds: float) -> None:
            self.stop.wait(seconds)

        attempts = tenacity.Retrying(
            stop=stop,
            wait=tenacity.wait_exponential(multiplier=2, max=60) + tenacity.wait_random(0, 1),
            retry=tenacity.retry_if_exception_type(Transient),
            sleep=sleep, reraise=True)
        try:
            manifest = attempts(self._attempt, spec, state)
        except Stopped:
            return False   # left for --resume: the run is still pending in the journal, or interrupted
        except Unfit as u:   # a host failed the preflight: the run goes to hosts of its own that are left
            manifest = u.manifest
            assert manifest.error is not None  # what made the host unfit
            for name in u.hosts:
                self.pool.set_aside(self.pool[name], HarnessError(manifest.error.message,
                                                                  kind=Kind.of(manifest.error.kind)))
            # a run whose other node failed is given back as it is: node 0's host may take it again, with
            # other nodes (or it fails, once too few of its hosts are left, with the unfit host's error)
            if state.host.name not in u.hosts or self._move(spec, state, manifest):
                self.journal.append(spec.run_id, "retry", host=state.host.name, error_kind=manifest.error.kind)
                return True
        except Transient as t:
            manifest = t.manifest
            gone = state.lost or (manifest.error is not None and manifest.error.as_kind is Kind.UNREACHABLE)
            if gone:
                self.pool.drop(state)
            if gone and self._move(spec, state, manifest):   # another host runs it again
                self.journal.append(spec.run_id, "retry", host=state.host.name,
                                    error_kind=manifest.error and manifest.error.kind)
                return True
        if self.fail_fast and not manifest.ok:
            self.stop.set()   # before the host takes its next run (`_finish` says why, once journaled)
        if needs_analysis(manifest):   # the traces' analysis and the hashes of their files: once the host is free
            if manifest.ok:   # its result is in (the benchmark's files): told before the next run is asked
                self._tell(spec, manifest)
            try:
                self.afterwards.submit(self._complete_then_finish, spec, state, manifest)
                self.events.host(state.host.name, "idle")   # free for its next run meanwhile
                return False
            except RuntimeError:   # the sweep is ending (Ctrl-C): no more work for later, so now
                pass
        # a run without traces hashes its few files here (and is journaled at once, as a failed run must
        # be for --fail-fast and --resume); one with traces waits for the analysis, which has them
        self._complete_then_finish(spec, state, manifest)
        return False

    def _move(self, spec: RunSpec, state: HostState, manifest: RunManifest) -> bool:
        """Whether a run lost under this host goes back to the queue: only for a host of its own that is
        alive and has not lost it yet, so that a run every host loses (the link drops under it each
        time, though each host reconnects) fails once each has had its attempts, rather than going
        round the hosts all night."""
        with self.changed:
            lost = self.lost_under[spec.run_id][0] if spec.run_id in self.lost_under else set()
            lost.add(state.host.name)
            self.lost_under[spec.run_id] = lost, manifest, state
            return self._takers_left(spec)

    def _takers_left(self, spec: RunSpec) -> bool:
        """Whether a host of the run's that has not lost it is still alive."""
        lost = self.lost_under[spec.run_id][0] if spec.run_id in self.lost_under else set()
        return any(h.name not in lost and not self.pool[h.name].dead for h in spec.hosts)

    def _lost_here(self, spec: RunSpec, state: HostState) -> bool:
        lost = self.lost_under.get(spec.run_id)
        return lost is not None and state.host.name in lost[0]

    def _completed(self, spec: RunSpec, manifest: RunManifest) -> RunManifest:
        """The manifest finished (`lifecycle.run.finish`: its files hashed, its traces analysed); as it
        was when that failed (our own bug, or a manifest that could not be written: the run's
        measurements stand, and a `--resume` finishes it)."""
        layout = self.layout.run(spec.run_id)
        try:
            return finish(layout, manifest)
        except Exception as e:
            self.events.log(f"{spec.run_id}: hashing its files or writing its manifest failed ({internal_text(e)}); "
                            "`harness sweep --resume` finishes it")
            return manifest

    def _complete_then_finish(self, spec: RunSpec, state: HostState, manifest: RunManifest) -> None:
        manifest = self._completed(spec, manifest)
        try:
            self._finish(spec, state, manifest)
        except OSError as e:
            self.outcome.fatal = f"cannot write results in {self.sweep_dir}: {e}"
            self.events.log(self.outcome.fatal)
            self.stop.set()

    def _attempt(self, spec: RunSpec, state: HostState) -> RunManifest:
        if self.stop.is_set():   # Ctrl-C came during the backoff before this attempt
            raise Stopped
        host = state.host
        with self.lock:
            attempt = self.attempts[spec.run_id] = self.attempts.get(spec.run_id, 0) + 1
        layout = self.layout.run(spec.run_id)
        shutil.rmtree(layout.dir, ignore_errors=True)  # a partial earlier attempt: never mixed into this one
        remove_stale_staging(layout.dir)               # and what a pull killed with the orchestrator left
        layout.dir.mkdir(parents=True)
        nodes = [Node(s.host, s.transport) for s in [state, *self.peers.get(spec.run_id, [])]
                 if s.transport is not None]   # the worker opened every one before taking the run
        if len(nodes) < spec.nodes:
            raise RemoteError(f"{spec.nodes - len(nodes)} of the run's hosts lost their connection before "
                              "it started", host=host.name, kind=Kind.UNREACHABLE)
        def on_phase(phase: str) -> None:   # every node's host is in the run's phase
            if self.stop.is_set() and phase in STOPPABLE:   # Ctrl-C came mid-run: no server starts after it
                raise RunFailed(f"interrupted before {phase}", host=host.name, run_id=spec.run_id,
                                kind=Kind.INTERRUPTED)
            self.events.phase(host.name, spec.run_id, phase)
            for rank, node in enumerate(nodes[1:], 1):
                self.events.phase(node.host.name, spec.run_id, f"{phase} (node {rank})")

        ctx = RunContext.of(self.sweep, spec, nodes, layout, lease_s=self.lease_s, on_phase=on_phase)
        ctx.found.attempt = attempt   # the preflight empties the run's folder on each host first
        with self.lock:
            self.in_flight[spec.run_id] = ctx
        self.journal.append(spec.run_id, "running", host=host.name, attempt=attempt,
                            nodes=[n.host.name for n in ctx.nodes] if ctx.peers else None)
        try:
            manifest = execute(ctx)
        except Exception as e:  # our own bug inside the run: recorded, its server stopped, the sweep goes on
            if isinstance(e, OSError) and e.errno in NO_ROOM:   # not a bug: the worker stops the sweep
                self._stop_servers(spec, ctx)
                raise
            manifest = self._internal(spec, state, e, ctx)
        finally:
            with self.lock:
                self.in_flight.pop(spec.run_id, None)
        error = manifest.error
        unfit = [node.host.name for node in ctx.nodes if node.found.host_unfit]
        if error is not None and unfit and not self.stop.is_set():
            raise Unfit(manifest, unfit)
        gone = [n.transport.gone for n in ctx.nodes if isinstance(n.transport, Placed) and n.transport.gone]
        if error is not None and gone:   # its job ended: no node of it comes back, and what it brought back stays
            self.events.log(f"[{host.name}] {spec.run_id}: not tried again ({gone[0]})")
            self.pool.drop(state)   # connected again for its next run, the node is set aside at once
        elif error is not None and (error.as_kind.retried or state.lost) and not self.stop.is_set():
            self.events.log(f"[{host.name}] {spec.run_id}: attempt {attempt} failed ({error.line()})")
            raise Transient(manifest)
        return manifest

    def _internal(self, spec: RunSpec, state: HostState, error: Exception,
                  ctx: RunContext | None = None) -> RunManifest:
        """A run that an unexpected exception of the harness's own ended: failed with kind `internal`,
        the traceback in the run's `harness-error.log`, its server stopped. Never retried: the same
        bug would end it again."""
        redact = self.sweep.redactor.text
        layout = self.layout.run(spec.run_id)
        trace = redact("".join(traceback.format_exception(error)))
        atomic_write(layout.harness_error, trace)
        self._stop_servers(spec, ctx)
        message = redact(f"the harness failed ({internal_text(error)}): a bug, please report it with "
                         f"{layout.harness_error.relative_to(self.sweep_dir)}")
        manifest = unrun_manifest(self.sweep, spec, state.host.name, "failed",
                                  ErrorRecord(kind=Kind.INTERNAL, message=message, detail=trace),
                                  attempts=self.attempts.get(spec.run_id, 1),
                                  phases=ctx.phases if ctx is not None else {})
        write_model(layout.manifest, manifest)
        return manifest

    def _stop_servers(self, spec: RunSpec, ctx: RunContext | None) -> None:
        for node in ctx.nodes if ctx is not None else []:
            try:
                node.sh(stop_command(node), timeout=120, check=False)
            except Exception as e:  # the watchdog stops it when the lease lapses
                self.events.log(f"[{node.host.name}] could not stop {spec.run_id}: {internal_text(e)}")

    def _tell(self, spec: RunSpec, manifest: RunManifest) -> None:
        """The run source (a search) learns how the run ended, once: an ok run with traces as its host's
        slot ends (`_run`), any other when it is journaled. Not a failure the interrupt made (the run is
        left interrupted, for --resume), nor a failed run before its journal (a resume runs that
        again, and a trial told twice would count twice)."""
        with self.lock:
            if (self.source is None or spec.run_id in self.told
                    or (spec.run_id in self.torn_down and not manifest.ok)):
                return
            self.told.add(spec.run_id)
        self.source.ended(manifest)

    def _finish(self, spec: RunSpec, state: HostState, manifest: RunManifest) -> None:
        """Journal the run, every record of it written, and tell whoever waits on it."""
        with self.lock:
            if spec.run_id in self.torn_down and not manifest.ok:
                return  # torn down by the interrupt, which journaled it
            self.journaled.add(spec.run_id)   # the interrupt no longer journals it interrupted after this
        self.journal.append(spec.run_id, manifest.status, host=state.host.name,
                            error_kind=manifest.error and manifest.error.kind, attempts=manifest.attempts)
        self._tell(spec, manifest)
        with self.lock:
            self.outcome.manifests.append(manifest)
        self.events.done(manifest)
        if not manifest.ok and self.fail_fast:
            self.events.log("--fail-fast: no further runs start")
            self.stop.set()

    # --- resume and the end -----------------------------------------------------------------------

    def _resume(self) -> list[RunSpec]:
        """The runs still to do; finished runs keep their files, runs in flight are reconciled."""
        rebuilt = not self.journal.path.exists()   # the finished runs are known by their manifests
        plan = plan_resume(self.sweep, self.sweep_dir, retry_failed=self.retry_failed,
                           accept_changes=self.accept_changes)
        if rebuilt and plan.done:
            self.events.log(f"{self.journal.path.name} is missing: {len(plan.done)} finished runs found by "
                            "their manifests are kept")
        states = latest_states(self.journal.path)
        todo = []
        for spec in self.sweep.runs:
            layout = self.layout.run(spec.run_id)
            if spec.run_id in plan.done:
                try:
                    manifest = load_run(layout).manifest
                    if unfinished(manifest):   # stopped before its hashes or analysis were written
                        manifest = self._completed(spec, manifest)
                    self.outcome.manifests.append(manifest)
                    if rebuilt:   # journaled again, or a later resume would know nothing of it
                        self.journal.append(spec.run_id, manifest.status, host=manifest.host.name,
                                            attempts=manifest.attempts)
                    continue
                except Unreadable:
                    pass  # journaled as finished but its manifest is gone: run it again
            last = states.get(spec.run_id)
            # an ok run whose last journal line is "running" or "interrupted" (the interrupt came as it
            # ended, or while it waited for its analysis) is kept
            if (last is not None and last.state in ("running", "interrupted") and spec.run_id not in plan.changed
                    and (finished := self._finished_unjournaled(spec, layout)) is not None):
                self.journal.append(spec.run_id, finished.status, host=last.host, attempts=finished.attempts)
                self.outcome.manifests.append(finished)
                continue
            self._stop_in_flight(spec.run_id, last)
            shutil.rmtree(layout.dir, ignore_errors=True)
            todo.append(spec)
        for run_id in plan.removed:
            if self._stop_in_flight(run_id, states.get(run_id)):   # its server would hold the port
                self.journal.append(run_id, "interrupted", host=states[run_id].host)
                self.events.log(f"{run_id}: no longer in the playbook; it was in flight: its server stopped")
            else:
                self.events.log(f"{run_id}: no longer in the playbook; its results are kept")
        for run_id, diff in plan.changed.items():
            self.events.log(f"{run_id}: the playbook changed ({'; '.join(diff)}); accepted")
        self.kept_runs = plan.removed
        return todo

    def _finished_unjournaled(self, spec: RunSpec, layout: RunLayout) -> RunManifest | None:
        """A run the journal says was running (or interrupted) whose manifest says ok: it had ended (torn
        down, its files brought back, its host folder cleaned) and waited only for the hashes of its files
        and the analysis of its traces, or its journal line, when the orchestrator stopped. It is kept,
        finished now, never run again; None otherwise.
        Each attempt starts by emptying the run's folder here, so a manifest found is its last one's."""
        try:
            manifest = load_run(layout).manifest
        except Unreadable:
            return None
        if not manifest.ok:
            return None
        self.events.log(f"{spec.run_id}: had finished ok before the stop; kept, its files hashed and its traces "
                        "analysed now")
        return self._completed(spec, manifest)

    def _stop_in_flight(self, run_id: str, last: JournalEvent | None) -> bool:
        """Reconcile a run the journal last saw in flight, on every node of it; whether it was."""
        if last is None or last.state not in ("running", "interrupted") or last.host is None:
            return False
        for rank, name in enumerate(last.nodes or [last.host]):
            if name in self.pool:   # every node of a run on several hosts
                self._reconcile(run_id, self.pool[name].host, rank)
        return True

    def _reconcile(self, run_id: str, host: Host, node_rank: int = 0) -> None:
        """A run that was in flight when the orchestrator stopped: stop its server, drop its files."""
        try:
            link = self.pool.connect(host.spec())
            try:
                workdir = private_workdir(link, host.workdir, host=host.name)
                assert host.venv is not None  # the sweep refuses a host without one
                paths = HostRunLayout.of(workdir, self.sweep.sweep_id, run_id, node_rank)
                stop = tool_command(host.venv + "/bin/python", remote_dir(workdir), "agent", "stop",
                                    "--pid-file", paths.pid_file, "--port", 1, "--timeout", 20)
                command = f"if [ -f {shlex.quote(paths.pid_file)} ]; then {stop}; fi; rm -rf {shlex.quote(paths.root)}"
                link.run(command, timeout=120, check=False)
            finally:
                link.close()
        except HarnessError as e:  # its watchdog stops it when the lease lapses
            self.events.log(f"[{host.name}] could not reconcile {run_id}: {e}")

    def _settle_leftovers(self) -> None:
        """Runs never started: skipped (deadline, fail-fast, interrupt) or failed (no host could take
        them); a run lost under a host, whose other hosts were set aside before one could take it,
        fails as its last attempt did."""
        for spec in self.todo:
            if spec.run_id in self.lost_under and not self.outcome.interrupted and not self._takers_left(spec):
                _, manifest, state = self.lost_under[spec.run_id]
                self._finish(spec, state, self._completed(spec, manifest))
                continue
            reasons = [self.pool[h.name].error for h in spec.hosts if self.pool[h.name].dead]
            if reasons and len(spec.hosts) - len(reasons) < spec.nodes and not self.outcome.interrupted:
                err = reasons[0]
                assert err is not None  # a dead host has the error that set it aside
                self._write_unrun(spec, "failed", ErrorRecord(kind=err.kind,
                                                              message=self.sweep.redactor.text(str(err))))
            elif not self.outcome.interrupted:
                why = ("the deadline passed" if self.deadline and dt.datetime.now() >= self.deadline
                       else "the sweep stopped early")
                self._write_unrun(spec, "skipped", None, why)

    def _write_unrun(self, spec: RunSpec, status: str, error: ErrorRecord | None, why: str | None = None) -> None:
        manifest = unrun_manifest(self.sweep, spec, spec.hosts[0].name, status, error, skipped=why, attempts=0)
        write_model(self.layout.run(spec.run_id).manifest, manifest)
        self.outcome.manifests.append(manifest)
        self.journal.append(spec.run_id, status, error_kind=error and error.kind, reason=why)

    def _interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop starting runs, stop every running server, flush the journal."""
        self.stop.set()
        self.outcome.interrupted = True
        self.events.log("interrupted: stopping the servers of the runs in flight")
        with self.lock:   # torn down from now on: a run that fails as its server stops is no failure to tell
            in_flight = list(self.in_flight.values())
            self.torn_down.update(ctx.run.run_id for ctx in in_flight)
        for ctx in in_flight:
            for node in ctx.nodes:
                try:
                    self.pool.run_once(node.host, stop_command(node), timeout=60)
                except HarnessError as e:
                    self.events.log(f"[{node.host.name}] could not stop {ctx.run.run_id}: {e}")
            with self.lock:
                if ctx.run.run_id in self.journaled:   # it ended by itself meanwhile, ok
                    continue
            self.journal.append(ctx.run.run_id, "interrupted", host=ctx.host.name,
                                nodes=[n.host.name for n in ctx.nodes] if ctx.peers else None)

    def _write_sweep_json(self, finished: float | None) -> None:
        before = read_sweep(self.layout) if self.kept_runs else None
        kept = [r.model_dump(mode="json") for r in before.runs if r.run_id in self.kept_runs] if before else []
        write_model(self.layout.record, sweep_record(self.sweep, started=self.started, finished=finished,
                                                     argv=self.argv, kept=kept))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
