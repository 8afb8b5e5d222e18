"""Sweeps on a real Slurm cluster (tests/slurm.py: munged, slurmctld, a slurmd per network namespace).

The harness runs as a user runs it, the `harness` command in a subprocess; the inventory's Slurm group
has no login host, so this machine runs salloc, srun and scancel. What each test checks afterwards
is asked of Slurm itself (squeue), never of the harness's own word.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness.config.inventory import SlurmSettings
from harness.slurm import Allocation
from harness.transport import HostSpec, connect
from harness.transport.base import KILL_BUDGET_S
from harness.transport.slurm import SlurmTransport
from harness.transport.ssh import REMOTE_GRACE_S
from tests.conftest import harness
from tests.e2e.test_sweep import FAST, manifests, playbook, sweep_dir
from tests.slurm import slurm_cluster
from tests.sshd import Sshd

pytestmark = pytest.mark.e2e

HELD = "PENDING,RUNNING,CONFIGURING,SUSPENDED"   # a job in one of these still holds or waits for nodes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=2) as made:
        yield made


def slurm_inventory(tmp_path: Path, venv: Path, *, hosts: dict | None = None, **slurm) -> Path:
    inv = {"all": {"vars": {"workdir": str(tmp_path / "node-work"), "venv": str(venv)},
                   "hosts": hosts or {"localhost": {"transport": "local"}},
                   "children": {"cluster": {"vars": {"scheduler": "slurm",
                                                     "slurm": {"nodes": 2, "gpus_per_node": 1,
                                                               "partition": "test", "time": "10:00",
                                                               "wait_s": 30, **slurm}}}}}}
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv))
    return path


def four_configs(tmp_path: Path, **extra) -> Path:
    return playbook(tmp_path, hosts="cluster", configs=[{"name": f"c{i}", "args": {"tp-size": 1}} for i in range(4)],
                    **extra)


def test_a_sweep_over_a_two_node_allocation_runs_each_run_on_a_node_and_releases_it(tmp_path, cluster,
                                                                                   remote_venv):
    results = tmp_path / "r"
    run = harness("sweep", four_configs(tmp_path), "-i", slurm_inventory(tmp_path, remote_venv), "-o", results,
                  env=cluster.env)
    assert run.returncode == 0, run.stdout + run.stderr + cluster.logs()
    found = manifests(results)
    assert len(found) == 4
    jobs = set()
    for run_id, m in found.items():
        assert m["status"] == "ok", (run_id, m.get("error"))
        placement = m["placement"]
        assert placement["scheduler"] == "slurm"
        assert placement["nodes"] == [m["host"]["name"]] and m["host"]["name"] in cluster.names
        assert placement["step_id"].startswith(placement["job_id"] + ".")
        jobs.add(placement["job_id"])
        assert m["collected"]["files"] > 0
    assert len(jobs) == 1, jobs            # one allocation for the whole sweep
    assert {m["host"]["name"] for m in found.values()} == set(cluster.names)   # both nodes took runs
    (job,) = jobs
    assert f"job {job} granted on n1, n2" in run.stderr and f"released job {job}" in run.stderr
    assert not cluster.jobs(HELD), cluster.jobs()
    # every step launched a server from a node of its own: the step ids differ
    assert len({m["placement"]["step_id"] for m in found.values()}) == 4


def test_a_server_on_both_nodes_of_the_allocation_serves_from_both_and_releases_it(tmp_path, cluster,
                                                                                   remote_venv):
    """`nodes: 2` inside the allocation: node 1 meets node 0 at its NodeAddr, both nodes' logs and
    traces come back, and the manifest names the job and both nodes."""
    results = tmp_path / "r"
    pb = playbook(tmp_path, hosts="cluster", configs=[{"name": "tp2", "nodes": 2, "args": {"tp-size": 2}}],
                  server={"port": 30778, "host": "0.0.0.0", "env": dict(FAST), "startup_timeout_s": 60})
    run = harness("sweep", pb, "-i", slurm_inventory(tmp_path, remote_venv), "-o", results, env=cluster.env)
    assert run.returncode == 0, run.stdout + run.stderr + cluster.logs()
    (m,) = manifests(results).values()
    assert m["status"] == "ok", m["error"]
    head, peer = m["host"]["name"], ({*cluster.names} - {m["host"]["name"]}).pop()
    addresses = dict(zip(cluster.names, (n.address for n in cluster.nodes), strict=True))
    placement = m["placement"]
    assert placement["scheduler"] == "slurm" and placement["nodes"] == [head, peer]
    assert placement["step_id"].startswith(placement["job_id"] + ".")
    assert [(n["rank"], n["host"], n["dir"]) for n in m["nodes"]] == [(0, head, "."), (1, peer, "nodes/node1")]
    assert m["nodes"][0]["address"] == addresses[head]       # Slurm's NodeAddr, reached from node 1
    d = sweep_dir(results) / "runs" / "tp2-1"
    assert all(lv["completed"] == 4 and lv["failed"] == 0
               for lv in json.loads((d / "bench.json").read_text())["levels"])
    assert "node 1 joined" in (d / "server.log").read_text()
    assert "joined node 0" in (d / "nodes" / "node1" / "server.log").read_text()
    assert m["profile"]["status"] == "ok" and m["profile"]["ranks_found"] == 2, m["profile"]
    assert len(list((d / "profile").glob("*.json.gz"))) == 1
    assert len(list((d / "profile" / "node1").glob("*.json.gz"))) == 1
    assert f"released job {placement['job_id']}" in run.stderr
    assert not cluster.jobs(HELD), cluster.jobs()


@pytest.mark.parametrize("fault", ["partition_down", "more_nodes_than_the_cluster_has"])
def test_an_allocation_not_granted_in_time_is_a_clear_error_and_leaves_no_pending_job(tmp_path, cluster,
                                                                                      remote_venv, fault):
    slurm = {"wait_s": 3} if fault == "partition_down" else {"wait_s": 3, "nodes": 3}
    inv = slurm_inventory(tmp_path, remote_venv, **slurm)
    if fault == "partition_down":
        cluster.set_partition("DOWN")
    try:
        run = harness("sweep", four_configs(tmp_path), "-i", inv, "-o", tmp_path / "r", env=cluster.env)
        pending = cluster.jobs(HELD)
    finally:
        cluster.set_partition("UP")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    said = run.stderr.replace("\n", " ")
    assert "slurm group 'cluster' (login localhost): no allocation within" in said, run.stderr
    assert "no allocation within 3 s" in said
    # and why, in Slurm's own word for it
    assert ("reason PartitionDown" if fault == "partition_down" else "reason PartitionNodeLimit") in said, said
    assert not pending, pending
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*/runs/*/manifest.json"))


def test_a_run_from_the_cluster_reproduces_on_an_allocation_of_its_own(tmp_path, cluster, remote_venv):
    """`harness reproduce` of a run that ran on a node: a new allocation of the group (never the login
    host itself), the run on one of its nodes, the job released."""
    inv = slurm_inventory(tmp_path, remote_venv)
    pb = playbook(tmp_path, hosts="cluster", configs=[{"name": "tp1", "args": {"tp-size": 1}}])
    first = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r", env=cluster.env)
    assert first.returncode == 0, first.stdout + first.stderr + cluster.logs()
    (original,) = manifests(tmp_path / "r").values()

    run = harness("reproduce", sweep_dir(tmp_path / "r") / "runs" / "tp1-1", "-i", inv, "-o", tmp_path / "r2",
                  env=cluster.env)
    assert run.returncode == 0, run.stdout + run.stderr + cluster.logs()
    (again,) = manifests(tmp_path / "r2").values()
    assert again["status"] == "ok", again.get("error")
    placement = again["placement"]
    assert placement["scheduler"] == "slurm" and again["host"]["name"] in cluster.names
    assert placement["job_id"] != original["placement"]["job_id"]
    assert f"released job {placement['job_id']}" in run.stderr
    # the group has 2 nodes; the run spans one, and the allocation holds just that one
    assert f"job {placement['job_id']} granted on {again['host']['name']}\n" in run.stderr, run.stderr
    assert "ITL p50 ms" in run.stdout
    assert not cluster.jobs(HELD), cluster.jobs()


def _journal(results: Path) -> list[dict]:
    with contextlib.suppress(FileNotFoundError, ValueError):
        return [json.loads(line) for line in (sweep_dir(results) / "journal.jsonl").read_text().splitlines()]
    return []


def test_a_node_dying_mid_sweep_fails_its_run_as_unreachable_and_the_sweep_ends_releasing_the_job(
        tmp_path, remote_venv):
    """Its own cluster: the node stays dead. Its slurmd and everything running on it are killed while
    a run is in flight there; srun cannot start a step on it any more."""
    with slurm_cluster(tmp_path / "slurm", nodes=2) as own:
        results = tmp_path / "r"
        pb = four_configs(tmp_path, benchmark={"prompt": "hello there", "max_tokens": 64, "concurrency": [1, 2],
                                               "requests": 24, "warmup": 1, "timeout_s": 60})
        sweep = subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i",
                                  str(slurm_inventory(tmp_path, remote_venv)), "-o", str(results),
                                  "--host-retries", "1", "--lease", "12"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **own.env, "COLUMNS": "200"})
        try:
            deadline = time.monotonic() + 120
            while not any(e.get("state") == "running" and e.get("host") == "n2" for e in _journal(results)):
                assert sweep.poll() is None and time.monotonic() < deadline, "no run ever started on n2"
                time.sleep(0.2)
            own.kill_node(1)
            out, err = sweep.communicate(timeout=400)
        finally:
            if sweep.poll() is None:
                sweep.kill()
        assert sweep.returncode in (0, 1), err
        assert "Traceback" not in err
        found = manifests(results)
        assert len(found) == 4
        on_n2 = [e for e in _journal(results) if e.get("host") == "n2" and e.get("error_kind")]
        assert on_n2 and all(e["error_kind"] == "unreachable" for e in on_n2), \
            [(e["run_id"], e["state"], e["error_kind"], found[e["run_id"]].get("error")) for e in on_n2]
        for run_id, m in found.items():
            assert m["status"] == "ok" or m["error"]["kind"] == "unreachable", (run_id, m["error"])
            if m["status"] == "ok":
                assert m["placement"]["nodes"] == ["n1"]   # what n2 had went to n1
        assert "released job" in err, err
        assert not own.jobs(HELD), own.jobs()


def test_the_login_host_runs_slurm_over_ssh(tmp_path, cluster, remote_venv):
    """slurm.login names an SSH host of the inventory: salloc, srun and scancel run there (only its
    sessions know where the cluster's config is: the harness's own environment does not)."""
    with Sshd(tmp_path / "login", env=cluster.env) as login:
        spec = login.host_spec()
        hosts = {"login-01": {"address": spec.address, "port": spec.port, "user": spec.user,
                              "identity_file": spec.identity_file, "known_hosts": spec.known_hosts}}
        pb = playbook(tmp_path, hosts="cluster", configs=[{"name": "a"}, {"name": "b"}], profile="none")
        results = tmp_path / "r"
        run = harness("sweep", pb, "-i", slurm_inventory(tmp_path, remote_venv, hosts=hosts, login="login-01"),
                      "-o", results, env={"SLURM_CONF": "/nonexistent/slurm.conf"})
        assert run.returncode == 0, run.stdout + run.stderr
    found = manifests(results)
    assert {m["status"] for m in found.values()} == {"ok"}
    assert {m["host"]["name"] for m in found.values()} <= set(cluster.names)
    assert "(login login-01)" in run.stderr and "released job" in run.stderr
    assert not cluster.jobs(HELD), cluster.jobs()


def _start(pb: Path, inv: Path, results: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(results)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "COLUMNS": "200"})


def _until(predicate, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the sweep ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout:g} s"
        time.sleep(0.2)


@pytest.mark.parametrize("when", ["waiting_for_the_allocation", "mid_sweep"])
def test_ctrl_c_releases_the_allocation(tmp_path, cluster, remote_venv, when):
    results = tmp_path / "r"
    inv = slurm_inventory(tmp_path, remote_venv, wait_s=300)
    if when == "waiting_for_the_allocation":
        cluster.set_partition("DOWN")
    try:
        sweep = _start(four_configs(tmp_path), inv, results, cluster.env)
        try:
            if when == "waiting_for_the_allocation":
                _until(lambda: cluster.jobs("PENDING"), "pending job", sweep)
            else:
                _until(lambda: any(e.get("state") == "running" for e in _journal(results)), "run in flight", sweep)
            sweep.send_signal(signal.SIGINT)
            out, err = sweep.communicate(timeout=120)
        finally:
            if sweep.poll() is None:
                sweep.kill()
        held = cluster.jobs(HELD)
    finally:
        cluster.set_partition("UP")
    assert sweep.returncode == 130, out + err
    assert "Traceback" not in err
    assert not held, held
    if when == "mid_sweep":
        assert "released job" in err, err


def _steps(cluster, job: str) -> list[str]:
    return [line.strip() for line in cluster.run("squeue", "-h", "-s", "-j", job, "-o", "%i").splitlines()
            if line.strip().startswith(f"{job}.")]


def test_a_bash_env_that_prints_on_the_node_leaves_the_steps_and_the_commands_output_as_they_were(
        tmp_path, cluster, monkeypatch):
    """srun passes the login environment on; a BASH_ENV there (Lmod sets one) that prints is read by
    the node's shell before the wrapper's step line. Before, every step failed on it, as not the
    harness's wrapper."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    rc = tmp_path / "lmod.sh"
    # printing on the node only (a step's shell), where this machine's own shells print nothing
    rc.write_text('[ -n "$SLURM_STEP_ID" ] && echo "Lmod: loading cuda/12.4"\n'
                  'export HARNESS_TEST_FROM_BASH_ENV=loaded\n')
    monkeypatch.setenv("BASH_ENV", str(rc))
    allocation = Allocation("cluster", SlurmSettings(nodes=1, partition="test", time="5:00", wait_s=30), 1,
                            login=HostSpec(name="localhost", transport="local"), name="harness-bash-env-test",
                            connect=connect, log=lambda line: None)
    allocation.request()
    assert allocation.job_id is not None
    try:
        login = connect(HostSpec(name="localhost", transport="local"))
        link = SlurmTransport(HostSpec(name=allocation.nodes[0]), login, job_id=allocation.job_id,
                              node=allocation.nodes[0], python=sys.executable)
        done = link.run("echo $HARNESS_TEST_FROM_BASH_ENV", timeout=30)
        assert done.stdout == "loaded\n" and done.step is not None and done.step.startswith(allocation.job_id + ".")
        link.close()
    finally:
        allocation.release()
    assert not cluster.jobs(HELD)


@pytest.mark.parametrize("over", ["local", "ssh"])
def test_a_step_lasts_as_long_as_what_its_command_started_and_close_ends_it(tmp_path, cluster, monkeypatch, over):
    """Slurm ends a step's leftover processes with the step (proctrack/cgroup), so the step that
    launches a server must outlive the launch command while the server runs: the command returns at
    once, its step stays until the server is gone (past the command's own deadline: over SSH, the
    deadline's watchdog must not close the login connection under it), and closing the transport
    ends the step and the server with it."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    allocation = Allocation("cluster", SlurmSettings(nodes=1, partition="test", time="5:00", wait_s=30), 1,
                            login=HostSpec(name="localhost", transport="local"), name="harness-step-test",
                            connect=connect,
                            log=lambda line: None)
    allocation.request()
    assert allocation.job_id is not None
    job, (node,) = allocation.job_id, allocation.nodes
    sshd = Sshd(tmp_path / "login", env=cluster.env).start() if over == "ssh" else None
    try:
        login = connect(sshd.host_spec() if sshd else HostSpec(name="localhost", transport="local"))
        link = SlurmTransport(HostSpec(name=node), login, job_id=job, node=node, python=sys.executable)
        marker = f"harness-step-test-{os.getpid()}"
        # a detached sleep, as the launch wrapper starts a server: setsid, no terminal, output elsewhere
        started = link.run(f"{{ setsid bash -c 'exec -a {marker} sleep 300' >/dev/null 2>&1 </dev/null & }}; echo up",
                           timeout=10)
        assert started.stdout == "up\n" and started.step is not None and started.step.startswith(f"{job}.")
        # past the command's deadline and the SSH transport's own timers for it (watchdog, remote timeout)
        time.sleep(10 + max(KILL_BUDGET_S + 1, REMOTE_GRACE_S) + 2)
        assert link.run("echo still", timeout=30).stdout == "still\n"
        assert started.step in _steps(cluster, job)            # the launch's step holds the sleep
        assert subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True).returncode == 0
        link.run(f"pkill -f '^{marker}'", timeout=30)   # ^: never the pkill's own wrapper
        deadline = time.monotonic() + 30
        while started.step in _steps(cluster, job):           # the sleep gone: its step ends
            assert time.monotonic() < deadline, _steps(cluster, job)
            time.sleep(0.2)
        again = link.run(f"{{ setsid bash -c 'exec -a {marker} sleep 300' >/dev/null 2>&1 </dev/null & }}",
                         timeout=30)
        assert again.step in _steps(cluster, job)
        link.close()                                           # a server teardown missed ends with its step
        deadline = time.monotonic() + 30
        while again.step in _steps(cluster, job) or \
                subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, _steps(cluster, job)
            time.sleep(0.2)
    finally:
        allocation.release()
        if sshd is not None:
            sshd.stop()
    assert not cluster.jobs(HELD)
