"""Scheduling a sweep's runs over its hosts, journaling every state change, cleaning up on interrupt.

One worker thread per host, each with its own connection (a shared SFTP client deadlocks across
threads: paramiko #718); `--jobs` bounds how many runs are in flight at once. With `placement: pool`
a run goes to whichever of its hosts frees up first; with `each` it is pinned to its host. A host that
cannot be reached is set aside and its pool runs go to the others.
"""

from __future__ import annotations

import hashlib
import shlex
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import harness
from harness.config.inventory import Host
from harness.errors import HarnessError
from harness.journal import Journal
from harness.lifecycle.context import REMOTE_TOOLS, TOOLS_DIR, RunContext
from harness.lifecycle.run import execute
from harness.lifecycle.server import stop_command
from harness.plan import RunSpec, Sweep
from harness.results import write_json, write_summary
from harness.transport import connect

Log = Callable[[str], None]


@dataclass
class Outcome:
    sweep_dir: Path
    manifests: list[dict] = field(default_factory=list)
    interrupted: bool = False

    @property
    def failed(self) -> list[dict]:
        return [m for m in self.manifests if m["status"] != "ok"]


def tools_dir(host: Host) -> str:
    digest = hashlib.sha256(b"".join((TOOLS_DIR / n).read_bytes() for n in REMOTE_TOOLS)).hexdigest()[:12]
    return f"{host.workdir.rstrip('/')}/.harness/{harness.__version__}-{digest}"


class Executor:
    def __init__(self, sweep: Sweep, results: Path, *, jobs: int | None = None, log: Log = print,
                 fail_fast: bool = False, argv: list[str] | None = None):
        self.sweep, self.log, self.fail_fast = sweep, log, fail_fast
        self.sweep_dir = Path(results) / sweep.sweep_id
        self.journal = Journal(self.sweep_dir / "journal.jsonl")
        self.slots = threading.Semaphore(jobs or len(sweep.hosts))
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.todo: list[RunSpec] = list(sweep.runs)
        self.in_flight: dict[str, RunContext] = {}
        self.down: dict[str, HarnessError] = {}
        self.outcome = Outcome(self.sweep_dir)
        self.argv = argv or []

    # --- the sweep ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        self._write_sweep_json(finished=None)
        for spec in self.todo:
            self.journal.append(spec.run_id, "pending", config=spec.config.name)
        workers = [threading.Thread(target=self._worker, args=(h,), name=f"worker-{h.name}", daemon=True)
                   for h in self.sweep.hosts]
        previous = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
        try:
            for w in workers:
                w.start()
            for w in workers:
                while w.is_alive():
                    w.join(0.2)
        except KeyboardInterrupt:
            self._interrupt()
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        self._fail_unplaced()
        write_summary(self.sweep_dir)
        self._write_sweep_json(finished=time.time())
        return self.outcome

    def _next_run(self, host: Host) -> RunSpec | None:
        with self.lock:
            for i, spec in enumerate(self.todo):
                if any(h.name == host.name for h in spec.hosts):
                    return self.todo.pop(i)
        return None

    def _worker(self, host: Host) -> None:
        transport = None
        try:
            while not self.stop.is_set():
                spec = self._next_run(host)
                if spec is None:
                    return
                if transport is None:
                    try:
                        transport = self._connect(host)
                    except HarnessError as e:
                        self.log(f"[{host.name}] set aside: {e}")
                        with self.lock:
                            self.down[host.name] = e
                            self.todo.insert(0, spec)
                        return
                with self.slots:
                    if self.stop.is_set():
                        with self.lock:
                            self.todo.insert(0, spec)
                        return
                    self._run_one(spec, host, transport)
        finally:
            if transport is not None:
                transport.close()

    def _connect(self, host: Host):
        transport = connect(host.spec())
        remote = tools_dir(host)
        transport.run(f"mkdir -p {shlex.quote(remote)}", timeout=60)
        for name in REMOTE_TOOLS:
            transport.put((TOOLS_DIR / name).read_bytes(), f"{remote}/{name}", mode=0o644)
        return transport

    def _run_one(self, spec: RunSpec, host: Host, transport) -> None:
        local_dir = self.sweep_dir / "runs" / spec.run_id
        local_dir.mkdir(parents=True, exist_ok=True)
        ctx = RunContext(self.sweep, spec, host, transport, self.sweep.render(spec, host), local_dir,
                         tools_dir(host), on_phase=lambda p: self._phase(spec, host, p))
        with self.lock:
            self.in_flight[spec.run_id] = ctx
        self.journal.append(spec.run_id, "running", host=host.name)
        self.log(f"[{host.name}] {spec.run_id}: started")
        manifest = execute(ctx)
        with self.lock:
            self.in_flight.pop(spec.run_id, None)
            if self.stop.is_set() and manifest["status"] != "ok":
                return  # torn down by the interrupt; journaled there
            self.outcome.manifests.append(manifest)
        error = manifest.get("error") or {}
        self.journal.append(spec.run_id, manifest["status"], host=host.name, error_kind=error.get("kind"))
        self.log(f"[{host.name}] {spec.run_id}: {manifest['status']}"
                 + (f" ({error.get('kind')}: {error.get('message')})" if error else ""))
        if manifest["status"] != "ok" and self.fail_fast:
            self.stop.set()

    def _phase(self, spec: RunSpec, host: Host, phase: str) -> None:
        self.log(f"[{host.name}] {spec.run_id}: {phase}")

    def _fail_unplaced(self) -> None:
        """Runs that no host could take: every one of their hosts was set aside."""
        for spec in self.todo:
            reasons = [self.down[h.name] for h in spec.hosts if h.name in self.down]
            if self.outcome.interrupted or not reasons:
                self.journal.append(spec.run_id, "skipped" if not reasons else "failed")
                continue
            err = reasons[0]
            manifest = {"schema": "harness.run/1", "run_id": spec.run_id, "sweep_id": self.sweep.sweep_id,
                        "config": {"name": spec.config.name}, "host": {"name": spec.hosts[0].name},
                        "engine": self.sweep.engine.name, "status": "failed",
                        "error": {"kind": err.kind, "message": self.sweep.redactor.text(str(err))},
                        "attempts": 0, "phases": {}, "harness_version": harness.__version__}
            write_json(self.sweep_dir / "runs" / spec.run_id / "manifest.json", manifest)
            self.outcome.manifests.append(manifest)
            self.journal.append(spec.run_id, "failed", error_kind=err.kind)

    # --- interrupt --------------------------------------------------------------------------------

    def _interrupt(self) -> None:
        """Ctrl-C or SIGTERM: stop starting runs, stop every running server, flush the journal."""
        self.stop.set()
        self.outcome.interrupted = True
        self.log("interrupted: stopping the servers of the runs in flight")
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
                self.log(f"[{ctx.host.name}] could not stop {ctx.run.run_id}: {e}")
            self.journal.append(ctx.run.run_id, "interrupted", host=ctx.host.name)

    def _write_sweep_json(self, finished: float | None) -> None:
        sweep, redact = self.sweep, self.sweep.redactor
        write_json(self.sweep_dir / "sweep.json", redact.data({
            "schema": "harness.sweep/1", "sweep_id": sweep.sweep_id, "harness_version": harness.__version__,
            "playbook_path": str(sweep.doc.path), "playbook": sweep.playbook.model_dump(mode="json"),
            "inventory_path": str(sweep.inventory.path),
            "hosts": [h.public(redact) for h in sweep.hosts],
            "runs": [{"run_id": r.run_id, "config": r.config.name, "hosts": [h.name for h in r.hosts]}
                     for r in sweep.runs],
            "argv": self.argv, "started": self.__dict__.setdefault("_started", time.time()),
            "finished": finished}))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
