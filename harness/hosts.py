"""The hosts of a sweep: connecting, installing, reaping, backing off, setting aside, and one heartbeat
per host.

A host is connected lazily, when its worker takes its first run: connect, upload the host-side tools
into the private workdir, and stop servers of earlier sweeps whose lease lapsed. A host that cannot be
reached is set aside and retried with exponential backoff (HOST_BACKOFF_S); one whose host key or
authentication fails, or that fails `attempts` times in a row, is dead for the sweep.

Each host has its own heartbeat thread, over a connection of its own, so a frozen host delays no
other host's leases. It renews the lease of every server running there (the watchdog beside a server
stops it when its lease lapses, so a killed orchestrator leaves no server holding a GPU) and brings
back, in the same round trip, how far each benchmark has got. It doubles as the failure detector that
SSH keepalives are not (paramiko #2463): a host that has not answered for a whole lease is lost, and
its worker's connection is closed under the run in flight, which then fails over to another host.
"""

from __future__ import annotations

import contextlib
import random
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from harness.config.inventory import Host
from harness.errors import HarnessError, Kind
from harness.events import Events, parse_tick
from harness.remote import install, tool_command
from harness.remote.names import RunFiles
from harness.transport import HostSpec, Transport

HOST_BACKOFF_S = (5.0, 300.0)   # first and largest wait between connection attempts to a host

Connect = Callable[[HostSpec], Transport]


@dataclass
class HostState:
    host: Host
    transport: Transport | None = None
    attempts: int = 0               # failed connection attempts in a row
    error: HarnessError | None = None
    dead: bool = False
    lost: bool = False              # the heartbeat stopped hearing from it mid-run


@dataclass(frozen=True)
class Beat:
    """What the heartbeat needs of a run in flight: where its lease and progress files are."""
    run_id: str
    lease: str
    progress: str


class HostPool:
    def __init__(self, hosts: list[Host], *, connect: Connect, events: Events, lease_s: float,
                 attempts: int, redact: Callable[[str], str] = str):
        self.connect, self.events, self.lease_s, self.attempts = connect, events, lease_s, attempts
        self.redact = redact
        self.states = {h.name: HostState(h) for h in hosts}

    def __getitem__(self, name: str) -> HostState:
        return self.states[name]

    def __contains__(self, name: object) -> bool:
        return name in self.states

    # --- connections -----------------------------------------------------------------------------------

    def open(self, state: HostState) -> bool:
        """Connect, upload the tools, reap servers of earlier sweeps whose lease lapsed; False (the host
        set aside, its error kept) when any of it fails."""
        host = state.host
        transport: Transport | None = None
        try:
            transport = self.connect(host.spec())
            installed = install(transport, host.workdir, host=host.name)
            host = host.model_copy(update={"workdir": installed.workdir,     # absolute from now on
                                           "venv": installed.resolve(host.venv)})
            assert host.venv is not None  # the sweep refuses a host without one
            python = host.venv + "/bin/python"
            reaped = transport.run(reap_command(python, installed.tools, host.workdir, self.lease_s),
                                   timeout=120, check=False).stdout
            if '"pid"' in reaped:
                self.events.log(f"[{host.name}] stopped servers left by an earlier sweep: {reaped.strip()}")
        except Exception as e:  # HarnessError, or our own bug: either way this host is set aside
            if not isinstance(e, HarnessError):
                e = HarnessError(f"the harness failed connecting to {host.name} ({internal_text(e)})",
                                 kind=Kind.INTERNAL)
            if transport is not None:   # connected, then the tools or the reap failed: not kept
                with contextlib.suppress(Exception):
                    transport.close()
            state.attempts += 1
            state.error = e
            state.dead = e.kind.host_fatal or state.attempts >= self.attempts
            self.events.log(f"[{host.name}] set aside{' for this sweep' if state.dead else ''}: "
                            f"{self.redact(str(e))}")
            self.events.host(host.name, "down" if not state.dead else f"dead: {e.kind}")
            return False
        state.host, state.transport, state.attempts, state.error, state.lost = host, transport, 0, None, False
        self.events.host(host.name, "idle")
        return True

    def set_aside(self, state: HostState, error: HarnessError) -> None:
        """The host cannot run this sweep's runs (its venv, its engine, its GPUs): dead for the sweep,
        with `error` for the runs only it could take."""
        state.dead, state.error = True, error
        self.close(state)
        self.events.log(f"[{state.host.name}] set aside for this sweep: {self.redact(str(error))}")
        self.events.host(state.host.name, f"dead: {error.kind}")

    def drop(self, state: HostState) -> None:
        """The host went away under a run: its next run waits for it with the host backoff."""
        self.close(state)
        state.attempts += 1

    def close(self, state: HostState) -> None:
        if state.transport is not None:
            state.transport.close()
            state.transport = None

    def backoff(self, state: HostState) -> float:
        first, most = HOST_BACKOFF_S
        return min(most, first * 2 ** (state.attempts - 1)) * random.uniform(0.75, 1.25)

    def run_once(self, host: Host, command: str, *, timeout: float) -> None:
        """One command over a connection of its own (stopping servers at an interrupt, reconciling)."""
        link = self.connect(host.spec())
        try:
            link.run(command, timeout=timeout, check=False)
        finally:
            link.close()

    # --- leases ----------------------------------------------------------------------------------------

    def heartbeats(self, runs_on: Callable[[str], list[Beat]], stop: threading.Event) -> list[threading.Thread]:
        """One started heartbeat thread per host; each ends when `stop` is set."""
        threads = [threading.Thread(target=self._heartbeat, args=(state, runs_on, stop),
                                    name=f"heartbeat-{name}", daemon=True) for name, state in self.states.items()]
        for t in threads:
            t.start()
        return threads

    def _heartbeat(self, state: HostState, runs_on: Callable[[str], list[Beat]], stop: threading.Event) -> None:
        link: Transport | None = None
        answered: float | None = None
        interval = max(1.0, self.lease_s / 4)
        try:
            while not stop.wait(interval):
                runs = runs_on(state.host.name)
                if not runs:
                    answered = None
                    continue
                answered = answered or time.monotonic()
                try:
                    link = link or self.connect(state.host.spec())
                    # the same round trip brings back how far each benchmark has got
                    said = link.run("touch -c " + " ".join(shlex.quote(r.lease) for r in runs)
                                    + "".join(f"; echo; head -c 2000 {shlex.quote(r.progress)} 2>/dev/null"
                                              for r in runs), timeout=interval, check=False)
                    answered = time.monotonic()
                    for run, line in zip(runs, said.stdout.split("\n")[1:], strict=False):
                        if (tick := parse_tick(line)) is not None:
                            self.events.progress(state.host.name, run.run_id, tick)
                except HarnessError:
                    if link is not None:
                        link.close()
                        link = None
                    if time.monotonic() - answered > self.lease_s:
                        self.lost(state, time.monotonic() - answered)
                        answered = None
        finally:
            if link is not None:
                link.close()

    def lost(self, state: HostState, silent_s: float) -> None:
        if state.lost:
            return
        state.lost = True
        self.events.log(f"[{state.host.name}] lost: no answer for {silent_s:.0f} s; its runs go elsewhere")
        self.events.host(state.host.name, "lost")
        if state.transport is not None:
            state.transport.close()  # the run in flight fails now instead of waiting on a dead link


def reap_command(python: str, tools: str, workdir: str, lease_s: float) -> str:
    """The agent's reap of `workdir`, started only where a run folder there still holds a server's pid
    file or its secrets (the files the reap looks for): on a host that earlier sweeps left clean, which
    is most connections, no Python is started for it. The venv's Python is checked first, as the
    preflight does, so a missing venv is named there and not here."""
    reap = tool_command(python, tools, "agent", "reap", "--workdir", workdir, "--lease-s", lease_s)
    left = " ".join(f"{shlex.quote(workdir)}/*/*/{shlex.quote(name)}" for name in (RunFiles.PID, RunFiles.SECRETS))
    return f"test -x {shlex.quote(python)} && for f in {left}; do if [ -e \"$f\" ]; then {reap}; break; fi; done"


def internal_text(error: BaseException) -> str:
    """`Type: message` of an unexpected exception, on one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]
