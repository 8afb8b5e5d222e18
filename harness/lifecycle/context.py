"""What every lifecycle stage is handed: the run, its host and connection, its paths, and its record.

A server on several hosts is one RunContext per node: node 0's (where the server answers HTTP and the
benchmark runs) holds the others in `peers`, each with its own host, connection, launch script, run
folder on its host and here (nodes/node<k>/), and findings. Who hands the hosts over (the pool of an
inventory, a Slurm allocation) is not the lifecycle's business: it gets a list of `Node`s.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config.inventory import Host
from harness.errors import Kind, RunFailed
from harness.facts import FACTS_WAIT_S, await_script
from harness.plan import Rendered, RunSpec, Sweep
from harness.remote import remote_dir, tool_command
from harness.results.answers import A, AnswerError, Probe, Stop, read_answer
from harness.results.layout import HostCache, HostRunLayout, RunLayout
from harness.results.models import Collected
from harness.transport.base import Result, Transport


@dataclass
class Findings:
    """What the stages of one run found, each field set by the one stage named beside it; the manifest
    is built from it (`harness.lifecycle.run.build_manifest`), and nothing else passes between stages."""
    attempt: int = 1
    probe: Probe | None = None                   # preflight: the agent's probe of the host
    server_pid: int | None = None                # launch
    server_step: str | None = None               # launch: the scheduler's step that started it (Slurm)
    log_tail: str | None = None                  # health: the end of the log of a server that died starting
    prompt_file: str | None = None               # bench (uploaded once, reused by profile)
    bench_stderr: str = ""                       # bench: what the client said
    profile: dict[str, Any] | None = None        # profile: the agent's answer
    teardown: Stop | None = None                 # teardown: the agent's stop
    collected: Collected | None = None           # collect
    trace_bytes: int = 0                         # collect: of which traces (profile/), against profile.max_mb
    host_unfit: bool = False                     # preflight: the host, not the configuration, failed it
    warnings: list[str] = field(default_factory=list)   # any stage: what went wrong without failing the run


@dataclass(frozen=True)
class Node:
    """One host a run was given and the open connection to it: all the lifecycle asks of whoever
    allocates hosts (node 0 first)."""
    host: Host
    transport: Transport


@dataclass
class RunContext:
    sweep: Sweep
    run: RunSpec
    host: Host
    transport: Transport
    rendered: Rendered
    layout: RunLayout                            # the run's folder here
    tools_dir: str                               # where the harness's zipapp lives on the host
    lease_s: float = 60.0                        # the watchdog stops the server when not renewed this long
    on_phase: Callable[[str], None] = lambda phase: None
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    found: Findings = field(default_factory=Findings)
    node_rank: int = 0
    peers: list[RunContext] = field(default_factory=list)   # node 0's: the nodes of rank >= 1

    @classmethod
    def of(cls, sweep: Sweep, run: RunSpec, nodes: list[Node], layout: RunLayout, *, lease_s: float = 60.0,
           on_phase: Callable[[str], None] = lambda phase: None) -> RunContext:
        """The context of a run on `nodes` (node 0 first): each node's launch script rendered for it,
        the other nodes' files here under nodes/node<k>/."""
        hosts = [n.host for n in nodes]

        def context(rank: int, node: Node, local: RunLayout) -> RunContext:
            return cls(sweep, run, node.host, node.transport,
                       sweep.render(run, node.host, hosts if len(hosts) > 1 else ()), local,
                       remote_dir(node.host.workdir), lease_s=lease_s, on_phase=on_phase, node_rank=rank)

        head = context(0, nodes[0], layout)
        head.peers = [context(rank, node, layout.node(rank)) for rank, node in enumerate(nodes[1:], 1)]
        return head

    @property
    def nodes(self) -> list[RunContext]:
        """Every node of the run, node 0 first (just this one for a server on one host)."""
        return [self, *self.peers]

    @property
    def label(self) -> str:
        """How messages name this node: `node 1 (gpu-02)` when the server spans several hosts."""
        many = self.node_rank > 0 or bool(self.peers)
        return f"node {self.node_rank} ({self.host.name})" if many else self.host.name

    @property
    def paths(self) -> HostRunLayout:
        """The run's folder on its host."""
        return self.rendered.paths

    @property
    def host_cache(self) -> HostCache:
        """What the runs of this sweep on this host find once and share (the facts, the flag listing)."""
        return HostCache.of(self.host.workdir, self.sweep.sweep_id, self.host.name)

    def take_facts(self) -> str:
        """Shell that copies the host's facts into the run's folder, waiting a while for their
        collection (harness.facts), silently."""
        return await_script(self.host_cache.facts, self.paths.facts_dir)

    def copy_facts(self) -> None:
        """`take_facts` as a command of its own, where no other command of the run ends with it."""
        self.sh(self.take_facts(), timeout=FACTS_WAIT_S + 60, check=False)

    @property
    def local_dir(self) -> Path:
        return self.layout.dir

    @property
    def venv(self) -> str:
        return self.host.venv or ""

    @property
    def python(self) -> str:
        return f"{self.venv}/bin/python"

    @property
    def server_address(self) -> str:
        """Where a client on the host reaches the server."""
        bind = self.sweep.playbook.server.host
        return "127.0.0.1" if bind in ("0.0.0.0", "::") else bind   # Linux's "::" takes IPv4 too

    @property
    def base_url(self) -> str:
        address = self.server_address
        return f"http://{f'[{address}]' if ':' in address else address}:{self.rendered.port}"

    @contextmanager
    def phase(self, name: str):
        self.on_phase(name)
        start = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = {"seconds": round(time.monotonic() - start, 3)}

    def sh(self, command: str, *, timeout: float, check: bool = True, stdin: bytes | None = None) -> Result:
        return self.transport.run(command, timeout=timeout, check=check, stdin=stdin)

    def in_venv(self, command: str) -> str:
        """A command run with the host's venv activated (the GLM-5 campaign's ModuleNotFoundError came from not)."""
        return f"source {shlex.quote(self.venv + '/bin/activate')} && {command}"

    def agent_command(self, *args: str | int | float) -> str:
        return tool_command(self.python, self.tools_dir, "agent", *args)

    def agent(self, model: type[A], *args: str | int | float, timeout: float) -> A:
        """Run one agent subcommand on the host and return its answer, checked."""
        return self.parse_agent(model, str(args[0]), self.sh(self.agent_command(*args), timeout=timeout, check=False))

    def parse_agent(self, model: type[A], what: str, result: Result) -> A:
        """The agent's answer to `what` in the command's output, as `model`; a run failure naming the
        host when there is none or it has another shape (a host is not trusted)."""
        try:
            return read_answer(model, result.stdout)
        except AnswerError as e:
            raise RunFailed(f"the host agent's answer to {what!r} is not one this harness reads: {e} "
                            f"(exit {result.exit_code})", host=self.host.name, run_id=self.run.run_id,
                            command=result.command, output=result.stderr or result.stdout,
                            kind=Kind.PREFLIGHT) from None

    def fail(self, kind: Kind, message: str, *, output: str = "") -> RunFailed:
        return RunFailed(message, host=self.host.name, run_id=self.run.run_id, output=output, kind=kind)
