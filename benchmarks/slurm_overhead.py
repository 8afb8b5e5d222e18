"""Slurm overhead: a 4-configuration sweep over a 2-node Slurm allocation against the same over 2 SSH hosts.

Both sides are real and on this machine. The SSH side: 2 network namespaces, each with its own
address and sshd (tests/netns.py), reached over SSH with pinned host keys. The Slurm side: munged,
slurmctld and a slurmd in each of 2 namespaces (tests/slurm.py), an inventory group with
`scheduler: slurm` and no login host, so this machine runs salloc and each command of a run is an
`srun --overlap` step on its node; and the same cluster again with a login host over SSH (an sshd
on loopback whose sessions know the cluster's SLURM_CONF), so every srun also crosses SSH, as from
a workstation to a cluster's login node. The engine is the simulator (tests/remote_venv.py), the
same playbook on all three: 4 configurations that cost the same, time scale 0.25, ~4 s of benchmark
each, no profiling, so the figure is the harness's own cost.

For each side it runs the real command line (`python -m harness sweep PLAYBOOK -i INV -o OUT --jobs 2`)
and reads every manifest. Overhead per run counts host time, as sweep_scaling.py does:

    (2 x wall - sum over runs of the phases health + bench) / runs

so it holds connecting, preflight, uploads, launch, collection, teardown, the wait between runs and,
on Slurm, the allocation and its release. Rounds alternate the sides; it prints each, the mean
phases, and the ratio of the Slurm overhead to the SSH one measured in the same round. Last, what one
command costs on each (the median of 20 `true` over an open transport), which is most of the
difference: a run's lifecycle is a few dozen commands.

Needs root (network namespaces) and slurm-wlm and munge (make sshd installs them). Run as:
    .venv/bin/python benchmarks/slurm_overhead.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.config.inventory import SlurmSettings  # noqa: E402
from harness.slurm import Allocation  # noqa: E402
from harness.transport import HostSpec, connect  # noqa: E402
from harness.transport.slurm import SlurmTransport  # noqa: E402
from tests.netns import netns_hosts  # noqa: E402
from tests.remote_venv import make_remote_venv  # noqa: E402
from tests.slurm import slurm_cluster  # noqa: E402
from tests.sshd import Sshd  # noqa: E402

CONFIGS = 4
NODES = 2
PORT = 30700


def playbook(path: Path, hosts: str) -> Path:
    pb = {
        "name": "slurm-overhead",
        "hosts": hosts,
        "engine": "sglang",
        "model": {"path": "/models/GLM-5-NVFP4", "served_name": "glm-5"},
        "server": {"port": PORT, "args": {"tp-size": 8},
                   "env": {"HARNESS_SIM_TIME_SCALE": "0.25", "HARNESS_SIM_STARTUP_S": "1"},
                   "startup_timeout_s": 120},
        "configs": [{"name": f"mem{80 + i}", "args": {"mem-fraction-static": (80 + i) / 100}}
                    for i in range(CONFIGS)],
        "benchmark": {"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 48,
                      "concurrency": [1, 4], "requests": 4, "warmup": 1, "timeout_s": 300},
        "profile": {"mode": "none"},
    }
    path.write_text(yaml.safe_dump(pb, sort_keys=False))
    return path


def ssh_inventory(path: Path, hosts, venv: Path) -> Path:
    inv = {"all": {"children": {"gpu": {
        "vars": {"venv": str(venv)},
        "hosts": {h.name: {"address": h.address, "port": h.sshd.port, "user": h.sshd.user,
                           "identity_file": str(h.sshd.client_key), "known_hosts": str(h.sshd.known_hosts),
                           "workdir": str(h.workdir)} for h in hosts}}}}}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def slurm_inventory(path: Path, venv: Path, workdir: Path, login: Sshd | None = None) -> Path:
    slurm = {"nodes": NODES, "gpus_per_node": 1, "partition": "test", "time": "30:00", "wait_s": 60}
    hosts: dict = {"localhost": {"transport": "local"}}
    if login is not None:
        hosts["login-01"] = {"address": login.address, "port": login.port, "user": login.user,
                             "identity_file": str(login.client_key), "known_hosts": str(login.known_hosts)}
        slurm["login"] = "login-01"
    inv = {"all": {"hosts": hosts,
                   "children": {"cluster": {"vars": {
                       "venv": str(venv), "workdir": str(workdir), "scheduler": "slurm", "slurm": slurm}}}}}
    path.write_text(yaml.safe_dump(inv, sort_keys=False))
    return path


def sweep(pb: Path, inv: Path, out: Path, env: dict[str, str]) -> tuple[float, list[dict]]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(out),
                           "--jobs", str(NODES)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env, "COLUMNS": "200"})
    wall = time.monotonic() - started
    manifests = [json.loads(p.read_text()) for p in out.glob("*/runs/*/manifest.json")]
    failed = [(m["run_id"], m.get("error")) for m in manifests if m["status"] != "ok"]
    if done.returncode != 0 or len(manifests) != CONFIGS or failed:
        raise SystemExit(f"sweep failed ({done.returncode}): {failed}\n{done.stderr[-3000:]}")
    return wall, manifests


def report(label: str, wall: float, manifests: list[dict]) -> float:
    phase = {name: sum(m["phases"][name]["seconds"] for m in manifests) for name in manifests[0]["phases"]}
    server = phase["health"] + phase["bench"]
    overhead = (wall * NODES - server) / len(manifests)
    phases = ", ".join(f"{name} {seconds / len(manifests):.2f}" for name, seconds in phase.items())
    print(f"  {label:14} wall {wall:6.1f} s  health+bench {server:6.1f} s  overhead/run {overhead:5.2f} s"
          f"  (mean phases, s: {phases})")
    return overhead


def per_command(transport, times: int = 20) -> float:
    """The median seconds of `true` over an open transport."""
    took = []
    try:
        for _ in range(times):
            started = time.monotonic()
            transport.run("true", timeout=60)
            took.append(time.monotonic() - started)
    finally:
        transport.close()
    return sorted(took)[len(took) // 2]


def command_costs(hosts, cluster, login: Sshd, venv: Path) -> None:
    os.environ.update(cluster.env)
    allocation = Allocation("cluster", SlurmSettings(nodes=1, partition="test", time="5:00", wait_s=60), 1,
                            login=HostSpec(name="localhost", transport="local"), name="harness-command-cost",
                            connect=connect, log=lambda line: None)
    allocation.request()
    try:
        assert allocation.job_id is not None
        job, node, python = allocation.job_id, allocation.nodes[0], str(venv / "bin" / "python")
        ssh = per_command(connect(hosts[0].host_spec()))
        local = per_command(SlurmTransport(HostSpec(name=node), connect(HostSpec(name="localhost", transport="local")),
                                           job_id=job, node=node, python=python))
        over_ssh = per_command(SlurmTransport(HostSpec(name=node), connect(login.host_spec()), job_id=job, node=node,
                                              python=python))
    finally:
        allocation.release()
    print(f"one command (median of 20 `true`): SSH host {ssh * 1000:.0f} ms, Slurm node {local * 1000:.0f} ms "
          f"({local / ssh:.2f}x), Slurm node with the login host over SSH {over_ssh * 1000:.0f} ms "
          f"({over_ssh / ssh:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="SSH then Slurm, this many times")
    rounds = parser.parse_args().rounds
    print(f"{CONFIGS} configurations of the simulated engine on {NODES} hosts, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.2f} at the start")
    with tempfile.TemporaryDirectory(prefix="slurm-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        venv = make_remote_venv(tmp / "venv", engines=("sglang",))
        with netns_hosts(NODES, tmp / "ssh") as hosts, slurm_cluster(tmp / "slurm", nodes=NODES) as cluster, \
                Sshd(tmp / "login", env=cluster.env) as login:
            ssh_inv = ssh_inventory(tmp / "ssh.yaml", hosts, venv)
            slurm_inv = slurm_inventory(tmp / "slurm.yaml", venv, tmp / "node-work")
            login_inv = slurm_inventory(tmp / "slurm-login.yaml", venv, tmp / "node-work", login)
            ratios, login_ratios = [], []
            for r in range(rounds):
                print(f"round {r + 1}")
                ssh = report("2 SSH hosts", *sweep(playbook(tmp / "ssh-pb.yaml", "gpu"), ssh_inv,
                                                   tmp / f"ssh-{r}", {}))
                slurm = report("2 Slurm nodes", *sweep(playbook(tmp / "slurm-pb.yaml", "cluster"), slurm_inv,
                                                       tmp / f"slurm-{r}", cluster.env))
                over_ssh = report("  login by SSH", *sweep(playbook(tmp / "slurm-pb.yaml", "cluster"), login_inv,
                                                           tmp / f"login-{r}", {}))
                ratios.append(slurm / ssh)
                login_ratios.append(over_ssh / ssh)
                print(f"  Slurm overhead per run {slurm - ssh:+.2f} s against SSH ({slurm / ssh:.2f}x); "
                      f"with the login host over SSH {over_ssh - ssh:+.2f} s ({over_ssh / ssh:.2f}x)")
            command_costs(hosts, cluster, login, venv)
    print(f"summary: Slurm overhead per run {', '.join(f'{x:.2f}x' for x in ratios)} the SSH one, with the "
          f"login host over SSH {', '.join(f'{x:.2f}x' for x in login_ratios)}; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
