"""A Slurm job that ends under the sweep (tests/slurm.py: a real slurmctld and slurmds): cancelled
mid-sweep, or past its time limit. Before, each node's steps failed as a node gone away, and the
executor retried every node with its host backoff, about 165 s, before the runs failed with srun's
last words (`srun could not run a step ...`), never saying that the job was gone or why."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.config.inventory import SlurmSettings
from harness.errors import Kind, RemoteError
from harness.slurm import Allocation, NodeConnect
from harness.transport import HostSpec, connect
from harness.transport.slurm import SlurmTransport
from tests.e2e.test_slurm import HELD, slurm_inventory
from tests.e2e.test_sweep import manifests, playbook, sweep_dir
from tests.slurm import slurm_cluster

pytestmark = pytest.mark.e2e

LOCAL = HostSpec(name="localhost", transport="local")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm"), nodes=2) as made:
        yield made


def _journal(results: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (sweep_dir(results) / "journal.jsonl").read_text().splitlines()]
    except (FileNotFoundError, ValueError):
        return []


def test_a_job_cancelled_mid_sweep_fails_what_is_left_at_once_naming_the_job(tmp_path, cluster, remote_venv):
    """scancel of the sweep's job once a run is done and another's server is up: the first stays ok
    with its files, the one in flight fails naming the job and brings back what it had (server.log)
    through the login host, which shares the workdir, every other run fails naming the job and that
    it was cancelled, and a node connected again is set aside for the sweep at once (no backoff:
    never `set aside:` for a while and tried again)."""
    results = tmp_path / "r"
    pb = playbook(tmp_path, hosts="cluster", configs=[{"name": f"c{i}", "args": {"tp-size": 1}} for i in range(6)],
                  benchmark={"prompt": "hello there", "max_tokens": 64, "concurrency": [1, 2], "requests": 48,
                             "warmup": 1, "timeout_s": 60})
    sweep = subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i",
                              str(slurm_inventory(tmp_path, remote_venv)), "-o", str(results)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **cluster.env, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 300

        def in_flight() -> list[str]:   # runs not ok yet whose server has written its log on the node
            ended = {e["run_id"] for e in _journal(results) if e.get("state") == "ok"}
            return [p.parent.name for p in (tmp_path / "node-work").glob("*/*/*/server.log")   # NODE/SWEEP/RUN
                    if p.parent.name not in ended] if ended else []
        while not (launched := in_flight()):
            assert sweep.poll() is None and time.monotonic() < deadline, "no run ever finished"
            time.sleep(0.2)
        (job,) = [line.split()[0] for line in cluster.jobs("RUNNING")]
        cluster.run("scancel", job)
        out, err = sweep.communicate(timeout=600)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 1, out + err
    assert "Traceback" not in err, err
    found = manifests(results)
    assert len(found) == 6, found.keys()
    ok = {r for r, m in found.items() if m["status"] == "ok"}
    assert ok and len(ok) < 6, {r: m["status"] for r, m in found.items()}
    for run_id in ok:   # what was measured before the cancel stands
        assert found[run_id]["collected"]["files"] > 0
        assert (sweep_dir(results) / "runs" / run_id / "bench.json").is_file()
    for run_id, m in found.items():
        if run_id not in ok:
            assert m["status"] == "failed", (run_id, m)
            assert f"Slurm job {job} was cancelled" in m["error"]["message"], (run_id, m["error"])
    for run_id in launched:   # its node is gone; its folder, on the shared workdir, is not
        assert "server.log" in found[run_id]["collected"]["sha256"], (run_id, found[run_id]["collected"])
        assert found[run_id]["attempts"] == 1   # not tried again on a node of the ended job, which would
        assert "health" in found[run_id]["phases"], found[run_id]["phases"]   # throw away what it brought
        assert (sweep_dir(results) / "runs" / run_id / "server.log").is_file()
    said = err.replace("\n", " ")
    # a node whose worker connects again (it has a run left to take) is set aside at once
    assert any(f"[{node}] set aside for this sweep: [{node}] node {node} of slurm group 'cluster' is gone "
               f"with its job: Slurm job {job} was cancelled" in said for node in cluster.names), err
    for node in cluster.names:
        assert f"[{node}] set aside: " not in said, err   # no backoff, no attempt after the job was gone
    assert f"nothing to release: Slurm job {job} was cancelled" in err, err
    assert not cluster.jobs(HELD), cluster.jobs()


def test_a_job_past_its_time_limit_fails_its_steps_saying_so_and_its_nodes_at_once(tmp_path, cluster,
                                                                                   monkeypatch):
    """A step running as the job reaches its time limit (one minute, Slurm's least): its command
    fails as JobEnded, saying the time limit; the next command of any node of the job fails so too,
    without an srun, and connecting to a node again is an error of a kind that sets it aside."""
    from harness.transport.slurm import JobEnded  # here: the sweep's test above runs on any harness

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    allocation = Allocation("cluster", SlurmSettings(nodes=2, partition="test", time="1", wait_s=30), 2,
                            login=LOCAL, name="harness-expiry-test", connect=connect, log=lambda line: None)
    allocation.request()
    assert allocation.job_id is not None and allocation.watch is not None
    job = allocation.job_id
    nodes = NodeConnect({n: allocation for n in allocation.nodes}, connect,
                        {n: sys.executable for n in allocation.nodes})
    try:
        first, second = (nodes(HostSpec(name=n)) for n in allocation.nodes)
        assert isinstance(first, SlurmTransport) and isinstance(second, SlurmTransport)
        with pytest.raises(JobEnded) as e:
            first.run("sleep 600", timeout=400)   # Slurm ends it within about 90 s
        assert e.value.kind is Kind.UNREACHABLE   # the run moves, and its node is dropped
        assert f"node {allocation.nodes[0]} is gone with its job: Slurm job {job} reached its time limit" \
               in str(e.value), str(e.value)
        with pytest.raises(JobEnded, match=f"Slurm job {job} reached its time limit"):
            second.run("true", timeout=30)
        assert second.step is None   # no srun was started for it
        shared = tmp_path / "shared-run"   # a run's folder on a filesystem the login host shares
        (shared / "profile").mkdir(parents=True)
        (shared / "server.log").write_text("the server's last words\n")
        assert first.pull(str(shared), tmp_path / "back", timeout=30).sizes == {"server.log": 24}
        with pytest.raises(JobEnded, match="not on the login host localhost either"):
            second.pull(str(tmp_path / "on-the-node-only"), tmp_path / "none", timeout=30)
        with pytest.raises(RemoteError) as again:
            nodes(HostSpec(name=allocation.nodes[1]))
        assert again.value.kind.host_fatal and f"Slurm job {job} reached its time limit" in str(again.value)
        first.close()
        second.close()
    finally:
        allocation.release()
    assert not cluster.jobs(HELD), cluster.jobs()


@pytest.mark.parametrize("cut", ["before tar", "srun exits 0", "mid-stream, compressed"])
def test_a_job_that_ends_during_a_pull_brings_the_folder_back_through_the_login_host(tmp_path, cluster,
                                                                                    monkeypatch, cut):
    """The job is cancelled while a node's pull is under way (the pull's own step cancels it): the
    pull falls back to the login host, which shares the run's folder, and brings it back whole.
    Before, the pull failed as the node gone, and the run lost its server.log. The step cancels its
    job before tar starts; or so with srun exiting 0, as srun has been seen to do, its step's stream
    empty (here a `srun` first on PATH runs the real one and says 0; before, that pull failed
    as "not a valid tar stream"); or once 20 kB of a zstd stream have gone out."""
    from harness.transport import tarpull
    from harness.transport.slurm import JobEnded

    monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
    tar_command = tarpull.tar_command
    if cut == "srun exits 0":
        srun = shutil.which("srun")
        assert srun is not None
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "srun").write_text(f'#!/bin/sh\n{shlex.quote(srun)} "$@"\nexit 0\n')
        (tmp_path / "bin" / "srun").chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    if cut == "mid-stream, compressed":
        if not tarpull.ZSTD:
            pytest.skip("zstd is not installed here")
        monkeypatch.setattr(SlurmTransport, "compress_pulls", property(lambda self: True))

    def cancelled_first(*args, **kwargs):   # on the node only: the login host's own pull runs as it is
        tar = tar_command(*args, **kwargs)
        if cut == "mid-stream, compressed":
            return (f'if [ -n "$SLURM_STEP_ID" ]; then {{ {tar}; }} | head -c 20000; sleep 1; scancel "$SLURM_JOB_ID"; '
                    f'sleep 120; fi; {tar}')
        return f'if [ -n "$SLURM_STEP_ID" ]; then scancel "$SLURM_JOB_ID"; sleep 120; fi; {tar}'
    allocation = Allocation("cluster", SlurmSettings(nodes=1, partition="test", time="5:00", wait_s=30), 1,
                            login=LOCAL, name="harness-pull-expiry-test", connect=connect, log=lambda line: None)
    allocation.request()
    assert allocation.job_id is not None
    job, (node,) = allocation.job_id, allocation.nodes
    try:
        link = NodeConnect({node: allocation}, connect, {node: sys.executable})(HostSpec(name=node))
        assert isinstance(link, SlurmTransport)
        shared = tmp_path / "shared-run"
        (shared / "profile").mkdir(parents=True)
        (shared / "server.log").write_text("the server's last words\n")
        (shared / "profile" / "rank0.trace.json.gz").write_bytes(os.urandom(1 << 20))
        monkeypatch.setattr(tarpull, "tar_command", cancelled_first)
        pulled = link.pull(str(shared), tmp_path / "back", timeout=100)
        assert pulled.sizes == {"server.log": 24, "profile/rank0.trace.json.gz": 1 << 20}
        assert (tmp_path / "back" / "server.log").read_text() == "the server's last words\n"
        assert link.gone is not None and f"Slurm job {job}" in link.gone and "cancel" in link.gone.lower(), link.gone
        # the login host's pull gets the time the pull has left, and running out of it says the job is gone
        monkeypatch.setattr(tarpull, "tar_command", lambda *a, **kw: "sleep 60; " + tar_command(*a, **kw))
        with pytest.raises(JobEnded, match=f"gone with its job .*Slurm job {job}.* ran out of time"):
            link.pull(str(shared), tmp_path / "late", timeout=3)
        assert not (tmp_path / "late").exists()
        link.close()
    finally:
        allocation.release()
    assert not cluster.jobs(HELD), cluster.jobs()
