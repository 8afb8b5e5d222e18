"""Sweeps on a real Slurm cluster (tests/slurm.py) against what a night on a shared cluster brings: a
second sweep of the same name, nodes drained under a request. Each check is asked of Slurm itself
(squeue), never of the harness's own word."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time

import pytest

from harness.config.inventory import SlurmSettings
from harness.errors import HarnessError
from harness.plan import load_sweep
from harness.slurm import Allocation, NodeConnect, allocations
from harness.transport import HostSpec, connect
from tests.e2e.test_slurm import HELD, _start, _until, four_configs, slurm_inventory
from tests.e2e.test_sweep import playbook
from tests.slurm import slurm_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=2) as made:
        yield made


def _granted(said: list[str]) -> str:
    (job,) = [m[1] for line in said if (m := re.search(r"job (\d+) granted", line))]
    return job


def test_a_second_sweep_of_the_same_id_that_gets_no_allocation_leaves_the_first_ones_job(
        tmp_path, cluster, remote_venv, monkeypatch):
    """`--resume` of a sweep still running elsewhere (its lock is refused only once an allocation
    came), or two sweeps of one playbook started in the same second: one sweep id, so one job name.
    The second's request, held back behind the first's nodes, was withdrawn by that name, and
    scancel --name cancelled the first sweep's running job with it."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    pb = four_configs(tmp_path)
    first = load_sweep(pb, slurm_inventory(tmp_path, remote_venv), sweep_id="night-20260101-000000")
    (tmp_path / "b").mkdir()
    second = load_sweep(pb, slurm_inventory(tmp_path / "b", remote_venv, wait_s=2), sweep_id=first.sweep_id)
    said: list[str] = []
    with allocations(first, log=said.append):
        job = _granted(said)
        with pytest.raises(HarnessError, match="no allocation within 2 s"), allocations(second, log=said.append):
            pass
        assert f"{job} RUNNING" in cluster.jobs(), (cluster.jobs(), said)
    assert not cluster.jobs(HELD), cluster.jobs()


def test_a_request_held_back_by_drained_nodes_says_slurms_reason(tmp_path, cluster, remote_venv, monkeypatch):
    """Nodes drained (or down) under a request: squeue's reason names them in a host list,
    `ReqNodeNotAvail, UnavailableNodes:n[1-2]`, and the error says it."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    sweep = load_sweep(four_configs(tmp_path), slurm_inventory(tmp_path, remote_venv, wait_s=3))
    cluster.run("scontrol", "update", "NodeName=n1,n2", "State=DRAIN", "Reason=maintenance")
    try:
        with pytest.raises(HarnessError) as e, allocations(sweep, log=lambda line: None):
            pass
    finally:
        cluster.run("scontrol", "update", "NodeName=n1,n2", "State=RESUME")
        cluster.wait_idle(cluster.names)
    # Slurm 22.05's words; later releases say `ReqNodeNotAvail, UnavailableNodes:n[1-2]`
    assert re.search(r"reason (ReqNodeNotAvail|Nodes required for job are DOWN, DRAINED)", str(e.value)), str(e.value)
    assert not cluster.jobs(HELD), cluster.jobs()


# what a batch job's environment holds for the steps it would start: `sbatch --export=NONE -c 2`
OUTER_JOB = {"SLURM_JOB_ID": "99999", "SLURM_JOBID": "99999", "SLURM_NNODES": "1", "SLURM_NTASKS": "1",
             "SLURM_NODELIST": "n1", "SLURM_CPUS_PER_TASK": "2", "SRUN_CPUS_PER_TASK": "2",
             "SLURM_EXPORT_ENV": "NONE"}


@pytest.mark.parametrize("var", sorted(OUTER_JOB))
def test_a_sweep_started_inside_a_job_of_its_own_runs_its_steps(tmp_path, cluster, remote_venv, monkeypatch, var):
    """The harness run by a batch job (no `slurm.login`: this machine runs srun), whose environment
    srun reads as options. Before, `--export=NONE` started every step without PATH (`execve(): bash:
    No such file or directory`) and `-c 2` asked more CPUs than the step had (`More processors
    requested than permitted`): every run failed as `unreachable`."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    monkeypatch.setenv(var, OUTER_JOB[var])
    sweep = load_sweep(four_configs(tmp_path), slurm_inventory(tmp_path, remote_venv, wait_s=10))
    said: list[str] = []
    with allocations(sweep, log=said.append) as (bound, connect):
        job = _granted(said)
        for host in bound.hosts:
            link = connect(host.spec())
            try:
                done = link.run("echo $SLURM_JOB_ID; command -v bash", timeout=30)
            finally:
                link.close()
            assert done.stdout.splitlines()[0] == job and done.stdout.splitlines()[1].endswith("/bash"), done
            assert done.step is not None and done.step.startswith(f"{job}.")
    assert not cluster.jobs(HELD), cluster.jobs()


def test_ctrl_c_while_the_job_is_being_released_still_releases_it(tmp_path, cluster, remote_venv):
    """The sweep over, scancel slow (a busy controller), the user presses Ctrl-C at a sweep that seems
    to hang: the interrupt killed scancel, and the job held its nodes until its time limit."""
    slow = tmp_path / "bin"
    slow.mkdir()
    started = tmp_path / "scancel-started"
    real = shutil.which("scancel")
    (slow / "scancel").write_text(f"#!/bin/bash\ntouch {started}\nsleep 3\nexec {real} \"$@\"\n")
    (slow / "scancel").chmod(0o755)
    results = tmp_path / "r"
    pb = playbook(tmp_path, hosts="cluster", configs=[{"name": "a"}], profile="none")
    sweep = _start(pb, slurm_inventory(tmp_path, remote_venv), results,
                   {**cluster.env, "PATH": f"{slow}:{os.environ['PATH']}"})
    try:
        _until(started.exists, "scancel", sweep, timeout=300)
        sweep.send_signal(signal.SIGINT)
        out, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert "interrupted while releasing its job; releasing it still" in err and "released job" in err, err
    deadline = time.monotonic() + 30          # scancel's own end of the job, never the time limit's
    while cluster.jobs(HELD):
        assert time.monotonic() < deadline, (cluster.jobs(), err)
        time.sleep(0.2)


def test_cpus_per_node_gives_each_node_and_each_of_its_steps_that_many_cpus(tmp_path, cluster, monkeypatch):
    """`slurm.cpus_per_node: 2` (the test nodes have 2): the job holds 2 CPUs a node, and every step
    has them, the server's launch step while the others run beside it (`--overlap`). Before, salloc
    asked none (the job held one CPU a node) and each step one: a server bound to a core."""
    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    allocation = Allocation("cluster", SlurmSettings(nodes=2, cpus_per_node=2, partition="test", time="5:00",
                                                     wait_s=30), 2,
                            login=HostSpec(name="localhost", transport="local"), name="harness-cpus-test",
                            connect=connect, log=lambda line: None)
    allocation.request()
    try:
        job = allocation.job_id
        assert job is not None
        shown = cluster.run("scontrol", "show", "job", job)
        assert "NumCPUs=4 " in shown and "MinCPUsNode=2" in shown, shown
        nodes = NodeConnect({n: allocation for n in allocation.nodes}, connect,
                            {n: sys.executable for n in allocation.nodes})
        for node in allocation.nodes:
            link = nodes(HostSpec(name=node))
            try:
                held = link.run("{ setsid sleep 30 >/dev/null 2>&1 </dev/null & }; echo $SLURM_CPUS_PER_TASK",
                                timeout=30)
                assert held.stdout == "2\n", held
                beside = link.run("echo $SLURM_CPUS_PER_TASK $SLURM_CPUS_ON_NODE", timeout=30)
                assert beside.stdout == "2 2\n" and beside.step != held.step, beside
            finally:
                link.close()
    finally:
        allocation.release()
    assert not cluster.jobs(HELD), cluster.jobs()
