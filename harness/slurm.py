"""A Slurm cluster as the hosts of a sweep: one allocation per sweep, its nodes handed to the executor.

An inventory group with `scheduler: slurm` has no hosts of its own: the loader gives it one slot per
node (`GROUP-1`, `GROUP-2`...), so a plan can be shown before anything is allocated. The sweep
command wraps the executor in `allocations(sweep)`, which

1. asks for one allocation per Slurm group on its login host (`salloc --no-shell --immediate=WAIT`,
   with the group's nodes, GPUs per node, partition, account and time): Slurm itself bounds the wait
   and withdraws a request it could not grant in time. salloc rather than a holding batch job: the
   allocation holds no process of its own that could die, and salloc reports the grant or the
   reason it could not be granted in words that go straight into the error;
2. learns its nodes (`squeue -o %N`, expanded by `scontrol show hostnames`), each name checked, and
   gives the executor a sweep whose hosts are those nodes (each slot's settings, named after its node,
   addressed by its NodeAddr, with a workdir of its own under the group's: `WORKDIR/NODE`)
   and a `connect` that reaches a node through `harness.transport.slurm` (srun over the login
   host's transport) and any other host as before;
3. releases the allocation (`scancel`) however the sweep ends: finished, Ctrl-C, a fatal error, an
   allocation that did not come in time (then by job name, so that nothing is left pending even
   when salloc was stopped before saying its job id; a name of this request's own, `job_name`).

Nothing is renewed by hand: the allocation lasts until released or until its time limit, which is the
cluster's business. `--resume` is a new sweep invocation, so it takes a new allocation.

A job that ends under the sweep (its time limit, a scancel, a preemption) is not replaced either: the
time limit is a bound the user set, and a cancel someone's decision, so a sweep that went on in a new
allocation would overrule both, unattended. The first step that fails asks squeue why
(`transport.slurm.JobWatch`, one per allocation); from then on every node of the job fails at once
(`JobEnded`, then a host error of kind preflight when its worker connects again, which sets the node
aside for the sweep without a backoff), so the run in flight and every run left for the allocation
fail within seconds naming the job and why, and `--resume --retry-failed` runs them on a new one.
The run in flight still brings back what it wrote, through the login host, where its workdir is on
a filesystem the login host shares (`SlurmTransport.pull`).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from harness.config.inventory import HOST_NAME, Host, SlurmSettings
from harness.errors import HarnessError, Kind, RemoteError
from harness.hosts import Connect
from harness.plan import Sweep
from harness.transport import HostSpec, Transport
from harness.transport import connect as connect_over_transport
from harness.transport.process import ProcessTransport
from harness.transport.slurm import JOB_ID, JobWatch, SlurmTransport

GRANTED = re.compile(r"Granted job allocation (\d+)")
QUERY_TIMEOUT_S = 60       # squeue, scontrol, scancel
SALLOC_SLACK_S = 60        # past --immediate, before the harness stops waiting for salloc itself
JOB_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


def salloc_command(settings: SlurmSettings, *, nodes: int, name: str) -> str:
    """salloc's command line: every value validated (the inventory's model, here) and quoted."""
    if not JOB_NAME.match(name):
        raise ValueError(f"not a job name: {name!r}")
    words = ["salloc", "--no-shell", f"--immediate={max(1, round(settings.wait_s))}", f"--job-name={name}",
             f"--nodes={nodes}", "--ntasks-per-node=1"]
    if settings.gpus_per_node:
        words.append(f"--gpus-per-node={settings.gpus_per_node}")
    if settings.cpus_per_node:   # one task a node: its CPUs are the node's share of the allocation
        words.append(f"--cpus-per-task={settings.cpus_per_node}")
    for flag in ("partition", "account", "time"):
        if (value := getattr(settings, flag)) is not None:
            words.append(f"--{flag}={value}")
    return shlex.join(words)


def job_name(sweep_id: str, cluster: str) -> str:
    """A job name of this request alone: the sweep's id and group, and a random suffix. One sweep id
    may ask twice at once (two sweeps of one playbook started in the same second), and a request that
    did not come is withdrawn by its name: that name must never be another sweep's job's."""
    return f"harness-{sweep_id}-{cluster}"[:190] + f"-{secrets.token_hex(4)}"


def granted_job(said: str) -> str | None:
    """The job id in salloc's `Granted job allocation N`, if it said so."""
    found = GRANTED.search(said)
    return found[1] if found else None


def held_reason(said: str) -> str:
    """What to add to the error from squeue's `JOB/REASON` lines: the last job's reason, as Slurm
    words it, a host list in brackets included (`ReqNodeNotAvail, UnavailableNodes:gpu[01-04]`, the
    reason of nodes down or drained); nothing from a line of another shape."""
    reasons = [line.strip() for line in said.splitlines()
               if re.fullmatch(r"\d+/[\w(),:.=\[\] -]{1,200}", line.strip())]
    if not reasons:
        return ""
    job, _, reason = reasons[-1].partition("/")
    return f"; squeue gives job {job} the reason {reason}"


def node_names(said: str, *, expected: int) -> list[str]:
    """The node names `scontrol show hostnames` printed, one a line, each checked."""
    names = [line.strip() for line in said.splitlines() if line.strip()]
    bad = [n for n in names if not HOST_NAME.match(n)]
    if bad:
        raise HarnessError(f"Slurm named a node {bad[0][:80]!r}: not a host name the harness accepts")
    if len(names) != expected or len(set(names)) != len(names):
        raise HarnessError(f"the allocation has nodes {names[:20]}, not {expected} distinct ones")
    return names


class Allocation:
    """One Slurm group's allocation: requested on its login host, its nodes, released at the end."""

    def __init__(self, cluster: str, settings: SlurmSettings, nodes: int, *, login: HostSpec, name: str,
                 connect: Connect, log: Callable[[str], None]):
        self.cluster, self.settings, self.count, self.login = cluster, settings, nodes, login
        self.name, self.connect, self.log = name, connect, log
        self.job_id: str | None = None
        self.watch: JobWatch | None = None   # whether the job still holds its nodes, once granted
        self.nodes: list[str] = []
        self.addresses: dict[str, str] = {}

    def _run(self, command: str, *, timeout: float):
        link = self.connect(self.login)
        try:
            return link.run(command, timeout=timeout, check=False)
        finally:
            link.close()

    def request(self) -> None:
        """Wait (bounded by slurm.wait_s) for the allocation and learn its nodes; HarnessError if
        it was not granted, after withdrawing the request."""
        where = f"slurm group {self.cluster!r} (login {self.login.name})"
        self.log(f"{where}: asking for {self.count} node{'s' * (self.count > 1)}, waiting up to "
                 f"{self.settings.wait_s:g} s (job name {self.name})")
        command = salloc_command(self.settings, nodes=self.count, name=self.name)
        try:
            said = self._run(command, timeout=self.settings.wait_s + SALLOC_SLACK_S)
        except HarnessError as e:
            raise HarnessError(f"{where}: salloc did not answer: {e}") from None
        job = granted_job(said.stderr)
        if not said.ok or job is None:
            lines = [line for line in said.stderr.splitlines() if line.strip()]
            why = lines[-1].strip()[:400] if lines else f"salloc exited with {said.exit_code}"
            raise HarnessError(f"{where}: no allocation within {self.settings.wait_s:g} s ({why})"
                               + self._reason())
        self.job_id, self.watch = job, JobWatch(job)
        listed = self._run(f"squeue -h -j {job} -o %N", timeout=QUERY_TIMEOUT_S)
        hostlist = listed.stdout.strip()
        if not listed.ok or not hostlist or not re.fullmatch(r"[A-Za-z0-9_.,\-\[\]]+", hostlist):
            raise HarnessError(f"{where}: job {job} was granted but squeue names no nodes for it "
                               f"({(listed.stderr or listed.stdout).strip()[:300]!r})")
        expanded = self._run(f"scontrol show hostnames {shlex.quote(hostlist)}", timeout=QUERY_TIMEOUT_S)
        self.nodes = node_names(expanded.stdout, expected=self.count)
        self.addresses = self._addresses()
        self.log(f"{where}: job {job} granted on {', '.join(self.nodes)}")

    def _addresses(self) -> dict[str, str]:
        """Each node's address as Slurm reaches it (its NodeAddr, `sinfo %o`): where the other nodes of
        a server on several nodes meet node 0. A node's name where Slurm gives no usable address."""
        said = self._run(f"sinfo -h -N -n {shlex.quote(','.join(self.nodes))} -o '%N %o'", timeout=QUERY_TIMEOUT_S)
        found: dict[str, str] = {}
        for line in (said.stdout.splitlines() if said.ok else []):
            words = line.split()
            if len(words) == 2 and words[0] in self.nodes and HOST_NAME.match(words[1]):
                found.setdefault(words[0], words[1])
        return {node: found.get(node, node) for node in self.nodes}

    def _reason(self) -> str:
        """Why Slurm held the request back, as squeue says while it still knows the job (MinJobAge)."""
        try:
            said = self._run(f"squeue -h -t all --name={shlex.quote(self.name)} -o %i/%r", timeout=QUERY_TIMEOUT_S)
        except HarnessError:
            return ""
        return held_reason(said.stdout) if said.ok else ""

    def release(self) -> None:
        """scancel the job, even through a Ctrl-C: pressed at a sweep that seems to hang on a slow
        scancel (a busy controller), it killed scancel, and the job held its nodes until its time
        limit. Asked once more, then the interrupt goes on."""
        try:
            self._release()
        except KeyboardInterrupt:
            self.log(f"slurm group {self.cluster!r}: interrupted while releasing its job; releasing it still")
            self._release()
            raise

    def _release(self) -> None:
        """scancel the job (or, when its id never came, every job of ours with its name); the error of
        a release that failed is said, not raised: the sweep's own outcome comes first."""
        if self.job_id is not None:
            assert JOB_ID.match(self.job_id)
            command, what = f"scancel {self.job_id}", f"job {self.job_id}"
        else:
            command = f"scancel --user=\"$(id -un)\" --name={shlex.quote(self.name)}"
            what = f"any job named {self.name}"
        try:
            done = self._run(command, timeout=QUERY_TIMEOUT_S)
        except HarnessError as e:
            self.log(f"slurm group {self.cluster!r}: could not release {what}: {e}; it ends at its time limit")
            return
        if self.watch is not None and self.watch.ended:
            self.log(f"slurm group {self.cluster!r}: nothing to release: {self.watch.ended} before the sweep ended")
        elif not done.ok:
            self.log(f"slurm group {self.cluster!r}: scancel of {what} said: {done.stderr.strip()[:300]}")
        elif self.job_id is not None:
            self.log(f"slurm group {self.cluster!r}: released job {self.job_id}")


class NodeConnect:
    """The executor's `connect`: an allocated node through srun on its login host, any other host as
    before. One login connection per node connection, opened and closed with it."""

    def __init__(self, nodes: dict[str, Allocation], base: Connect, pythons: dict[str, str] | None = None):
        self.nodes, self.base, self.pythons = nodes, base, pythons or {}

    def __call__(self, host: HostSpec) -> Transport:
        allocation = self.nodes.get(host.name)
        if allocation is None:
            return self.base(host)
        assert allocation.job_id is not None and allocation.watch is not None  # only granted ones are here
        if allocation.watch.ended:   # host-fatal: the node is set aside for the sweep, its runs fail now
            raise RemoteError(f"node {host.name} of slurm group {allocation.cluster!r} is gone with its job: "
                              f"{allocation.watch.ended}; no new allocation is taken (`harness sweep --resume "
                              "--retry-failed` runs what failed on a new one)", host=host.name, kind=Kind.PREFLIGHT)
        login = self.base(allocation.login)
        if not isinstance(login, ProcessTransport):
            login.close()
            raise HarnessError(f"the login host {allocation.login.name} has a transport srun cannot run over")
        return SlurmTransport(host, login, job_id=allocation.job_id, node=host.name,
                              python=self.pythons.get(host.name, "python3"),
                              cpus=allocation.settings.cpus_per_node or 1, watch=allocation.watch)


def login_spec(sweep: Sweep, settings: SlurmSettings) -> HostSpec:
    if settings.login is None:
        return HostSpec(name="localhost", transport="local")
    return sweep.inventory.hosts[settings.login].spec()


@contextmanager
def allocations(sweep: Sweep, *, connect: Connect = connect_over_transport,
                log: Callable[[str], None] = print) -> Iterator[tuple[Sweep, Connect]]:
    """The sweep with its Slurm slots replaced by allocated nodes, and the connect that reaches
    them; every allocation released on the way out, whatever the way. A sweep without a Slurm group
    comes back as it is."""
    clusters: dict[str, list[Host]] = {}
    for h in sweep.hosts:
        if h.slurm is not None:
            clusters.setdefault(h.cluster or h.name, []).append(h)
    if not clusters:
        yield sweep, connect
        return
    made: list[Allocation] = []
    try:
        bound: dict[str, Host] = {}
        by_node: dict[str, Allocation] = {}
        for cluster, slots in clusters.items():
            settings = slots[0].slurm
            assert settings is not None
            name = job_name(sweep.sweep_id, cluster)
            allocation = Allocation(cluster, settings, len(slots), login=login_spec(sweep, settings),
                                    name=name, connect=connect, log=log)
            made.append(allocation)
            allocation.request()
            for slot, node in zip(slots, allocation.nodes, strict=True):
                if node in sweep.inventory.hosts or node in by_node:
                    raise HarnessError(f"slurm group {cluster!r}: node {node} has the name of another host "
                                       "of the sweep; rename that host in the inventory")
                # a workdir of the node's own: the nodes of one run share the filesystem, not a run folder
                bound[slot.name] = slot.model_copy(update={"name": node, "address": allocation.addresses[node],
                                                           "workdir": f"{slot.workdir.rstrip('/')}/{node}"})
                by_node[node] = allocation
        hosts = [bound.get(h.name, h) for h in sweep.hosts]
        runs = [dataclasses.replace(r, hosts=tuple(bound.get(h.name, h) for h in r.hosts)) for r in sweep.runs]
        # the node's wrapper runs in the venv's Python (the same path on every node)
        pythons = {h.name: f"{h.venv}/bin/python" for h in bound.values() if h.venv}
        yield dataclasses.replace(sweep, hosts=hosts, runs=runs), NodeConnect(by_node, connect, pythons)
    finally:
        interrupted: KeyboardInterrupt | None = None
        for allocation in made:   # each released, a Ctrl-C during one or not
            try:
                allocation.release()
            except KeyboardInterrupt as e:
                interrupted = e
        if interrupted is not None:
            raise interrupted
