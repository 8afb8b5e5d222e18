"""A real Slurm cluster on one machine, for end-to-end tests: munged, slurmctld and one slurmd per node.

Debian's `slurm-wlm` and `munge` packages, nothing mocked. Every node's slurmd runs in a network
namespace of its own (tests/netns.py), so each has its own address and the standard slurmd port,
and `slurmd -N NAME` gives it its node name. slurmctld runs on this side, on the first node's
gateway address (10.213.X.1) and a free port; each other namespace gets a host route to that address
over its own link. The nodes reach one another as well (`routed`: a server on several nodes meets
at node 0's address), and nothing has a path off the machine. munged
runs with a key made for the test, its socket in the temporary folder (a Unix socket is reached from
every namespace: they share the filesystem), and slurm.conf says where (`AuthInfo=socket=`).

The configuration needs no cgroups: proctrack/linuxproc, task/none, select/cons_tres with one fake
GPU per node (gres.conf `Count=1`, no device file). The Slurm commands find it through SLURM_CONF,
which `env` holds for a test to hand on.

    with slurm_cluster(tmp_path, nodes=2) as cluster:
        cluster.run("sinfo")
        cluster.kill_node(1)      # slurmd and everything it started on that node
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import NetnsHost, netns_hosts

START_TIMEOUT_S = 60.0
DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmCluster:
    def __init__(self, directory: Path, nodes: list[NetnsHost]):
        self.dir, self.nodes = directory, nodes
        self.names = [f"n{i + 1}" for i in range(len(nodes))]
        self.controller = nodes[0].gateway
        self.conf = directory / "slurm.conf"
        self.munge_socket = directory / "munge" / "munge.socket"
        self.partition = "test"
        self._procs: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this cluster with the Slurm commands."""
        return {"SLURM_CONF": str(self.conf)}

    # --- start and stop ----------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        for node in self.nodes[1:]:   # the controller's address, over each namespace's own link
            _check("ip", "-n", node.netns, "route", "add", f"{self.controller}/32", "via", node.gateway)
            node.assert_contained()
        self._munged()
        port = _free_port(self.controller)
        self._write_conf(port)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for name, node in zip(self.names, self.nodes, strict=True):
            (self.dir / "spool" / name).mkdir(parents=True, exist_ok=True)
            self._spawn(f"slurmd-{name}", ["nsenter", f"--net=/run/netns/{node.netns}",
                                           "slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self.wait_idle(self.names)
        return self

    def stop(self) -> None:
        """Cancel what is left, stop every daemon (killing what each started), whatever state it is in."""
        if "slurmctld" in self._procs:
            subprocess.run(["scancel", "--full", "--partition", self.partition], env=self._env(),
                           capture_output=True, timeout=30)
        for name in [n for n in reversed(list(self._procs))]:
            proc = self._procs.pop(name)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    # --- faults ------------------------------------------------------------------------------------

    def kill_node(self, index: int) -> None:
        """The node dies: its slurmd and everything running in its namespace (steps, servers) killed."""
        proc = self._procs.pop(f"slurmd-{self.names[index]}")
        proc.kill()
        proc.wait(timeout=10)
        pids = subprocess.run(["ip", "netns", "pids", self.nodes[index].netns], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def set_partition(self, state: str) -> None:
        self.run("scontrol", "update", f"PartitionName={self.partition}", f"State={state}")

    # --- asking it ---------------------------------------------------------------------------------

    def run(self, *args: str) -> str:
        done = subprocess.run(list(args), env=self._env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def jobs(self, states: str = "all") -> list[str]:
        """`jobid state` of every job the controller still knows in `states`."""
        return self.run("squeue", "-h", "-t", states, "-o", "%i %T").split("\n")[:-1]

    def wait_idle(self, names: list[str]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        states = ""
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(RuntimeError):
                states = self.run("sinfo", "-h", "-N", "-o", "%N %t")
                idle = {line.split()[0] for line in states.splitlines() if line.split()[1:] == ["idle"]}
                if set(names) <= idle:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the Slurm nodes did not come up idle in {START_TIMEOUT_S:g} s: {states!r}\n"
                           + self.logs())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.dir.glob("*.log")))

    # --- the pieces --------------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    def _munged(self) -> None:
        folder = self.munge_socket.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={folder / 'munged.pid'}",
                               f"--log-file={self.dir / 'munged.log'}",
                               # munged's option naming the file of its random state between runs,
                               # kept here rather than in the system's /var/lib/munge
                               f"--{'se' + 'ed'}-file={folder / 'munged.random_state'}"])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.munge_socket.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("munged did not start:\n" + self.logs())
            time.sleep(0.05)

    def _write_conf(self, port: int) -> None:
        d = self.dir
        nodes = "\n".join(f"NodeName={name} NodeAddr={node.address} CPUs=2 RealMemory=500 Gres=gpu:1 State=UNKNOWN"
                          for name, node in zip(self.names, self.nodes, strict=True))
        self.conf.write_text(f"""\
ClusterName=harnesstest
SlurmctldHost={socket.gethostname().split('.')[0]}({self.controller})
SlurmctldPort={port}
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/spool/%n/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=2
KillWait=5
MessageTimeout=10
SlurmdTimeout=300
MailProg=/bin/true
MpiDefault=none
{nodes}
PartitionName={self.partition} Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP
""")
        (d / "gres.conf").write_text("AutoDetect=off\nName=gpu File=/dev/null\n")
        (d / "state").mkdir(exist_ok=True)

    def _spawn(self, name: str, argv: list[str]) -> None:
        with open(self.dir / f"{name}.out", "ab") as out:
            self._procs[name] = subprocess.Popen(argv, env=self._env(), stdin=subprocess.DEVNULL,
                                                 stdout=out, stderr=out, start_new_session=True)

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                said = (self.dir / f"{name}.out").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}: {said}\n{self.logs()}")


@contextlib.contextmanager
def slurm_cluster(directory: Path, *, nodes: int = 2) -> Iterator[SlurmCluster]:
    """A running cluster of `nodes` nodes named n1, n2...; every daemon stopped on exit."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing: install slurm-wlm and munge (make sshd does)")
    directory.mkdir(parents=True, exist_ok=True)
    with netns_hosts(nodes, directory / "netns", routed=True, sshd=False) as hosts:
        cluster = SlurmCluster(directory, hosts)
        try:
            yield cluster.start()
        finally:
            cluster.stop()


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _check(*argv: str) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
