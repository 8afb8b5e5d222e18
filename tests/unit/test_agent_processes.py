"""The agent's stop and watchdog as a host runs them: real processes, real pid and lease files.

A server that moves a process to a group of its own, a lease whose mtime the host's clock put in the
future or far in the past, and a pid file whose number now names another user's group."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.remote.agent import write_pid

REPO = Path(__file__).resolve().parents[2]

# A server that ignores SIGTERM, and a child of it that leaves its process group (setpgid) and ignores
# SIGTERM too: the child's pid is written to the file given.
SERVER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setpgid(0, 0)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    while True:
        time.sleep(1)
while True:
    time.sleep(1)
"""


def live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def agent(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.remote", "agent", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orphaned_group(child_file: Path) -> subprocess.Popen:
    """A process group whose leader has exited, its one member (pid in `child_file`) asleep for two
    minutes: what another user's daemon leaves under a number that was once our server's."""
    daemon = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                               "if os.fork(): sys.exit(0)\n"
                               f"open({str(child_file)!r}, 'w').write(str(os.getpid()))\n"
                               "time.sleep(120)\n"], start_new_session=True)
    daemon.wait(timeout=30)
    assert wait_for(lambda: child_file.exists() and child_file.read_text(), 30)
    return daemon


@pytest.fixture
def server(tmp_path):
    """A server leading its own session and group (as the launch wrapper does), its pid file written."""
    child_file = tmp_path / "child.pid"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(child_file)], start_new_session=True)
    assert wait_for(child_file.exists, 30)
    child = int(child_file.read_text())
    write_pid(str(tmp_path / "server.pid"), proc.pid)
    yield proc, child
    for pid in (child, proc.pid):
        if live(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_stop_also_ends_a_server_process_that_left_the_group(tmp_path, server):
    proc, child = server
    answer = agent("stop", "--pid-file", str(tmp_path / "server.pid"), "--port", str(free_port()),
                   "--timeout", "4")
    assert answer.returncode == 0, answer.stderr
    assert wait_for(lambda: not live(child) and not live(proc.pid), 10), "a server process outlived the stop"
    assert '"group_alive": false' in answer.stdout
    assert not (tmp_path / "server.pid").exists()


def watchdog(tmp_path: Path, lease_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.remote", "agent", "watch", "--pid-file",
                             str(tmp_path / "server.pid"), "--lease", str(tmp_path / "lease"),
                             "--lease-s", str(lease_s)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_lease_whose_mtime_is_in_the_future_still_lapses(tmp_path, server):
    """The host's clock stepped back after the last touch: the orchestrator is gone all the same."""
    proc, child = server
    lease = tmp_path / "lease"
    lease.touch()
    os.utime(lease, (time.time() + 3600, time.time() + 3600))
    wd = watchdog(tmp_path, 1)
    try:
        assert wait_for(lambda: not live(proc.pid) and not live(child), 60), "the server outlived its lease"
        assert wd.wait(timeout=60) == 0
        assert not (tmp_path / "server.pid").exists() and not (tmp_path / "watchdog.pid").exists()
    finally:
        if wd.poll() is None:
            wd.kill()
            wd.wait()


def test_a_lease_touched_while_the_clock_is_off_is_kept(tmp_path, server):
    """Touches whose time is far behind (the clock stepped forward since): each one still renews."""
    proc, child = server
    lease = tmp_path / "lease"
    lease.touch()
    past = time.time() - 1000
    os.utime(lease, (past, past))
    wd = watchdog(tmp_path, 2)
    try:
        for i in range(1, 16):   # 4.5 s of touches, each 0.3 s apart
            time.sleep(0.3)
            os.utime(lease, (past + i, past + i))
            assert live(proc.pid) and wd.poll() is None, wd.stdout.read() if wd.stdout else ""
        # then the touches stop: it lapses
        assert wait_for(lambda: not live(proc.pid) and not live(child), 60)
        assert wd.wait(timeout=60) == 0
    finally:
        if wd.poll() is None:
            wd.kill()
            wd.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to be another user) and a python the other user can run")
def test_a_pid_file_naming_another_users_group_signals_nothing_and_says_so():
    """server.pid's number is now the group of another user's daemon, whose leader exited (the number
    of a gone leader is taken for the group it started): the agent, as a user, may not signal it."""
    run_dir = Path(tempfile.mkdtemp())
    try:
        os.chmod(run_dir, 0o755)
        child_file = run_dir / "child"
        daemon = orphaned_group(child_file)
        child = int(child_file.read_text())
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        (run_dir / "server.pid").write_text(f"{daemon.pid} 1 {boot}\n")
        os.chmod(run_dir / "server.pid", 0o644)
        try:
            answer = subprocess.run(["/usr/bin/python3", "-m", "harness.remote", "agent", "stop", "--pid-file",
                                     str(run_dir / "server.pid"), "--port", str(free_port()), "--timeout", "2"],
                                    cwd=REPO, capture_output=True, text=True, timeout=120, user=65534, group=65534)
            assert "Traceback" not in answer.stderr, answer.stderr
            assert answer.returncode == 0 and '"signal": null' in answer.stdout
            assert live(child)
        finally:
            if live(child):
                os.kill(child, signal.SIGKILL)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to be another user) and a python the other user can run")
def test_reap_does_not_report_as_stopped_a_group_it_could_not_signal():
    """A lapsed run whose pid file names another user's group: reap signals nothing, and says it
    stopped nothing (it listed the run as stopped, with no signal, and the sweep's log said so)."""
    work = Path(tempfile.mkdtemp())
    run_dir = work / "sweep" / "run"
    child_file = work / "child"
    try:
        run_dir.mkdir(parents=True)
        for d in (work, work / "sweep", run_dir):
            os.chmod(d, 0o755)
        daemon = orphaned_group(child_file)
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        (run_dir / "server.pid").write_text(f"{daemon.pid} 1 {boot}\n")
        (run_dir / "lease").touch()
        os.utime(run_dir / "lease", (time.time() - 1000, time.time() - 1000))
        answer = subprocess.run(["/usr/bin/python3", "-m", "harness.remote", "agent", "reap", "--workdir",
                                 str(work), "--lease-s", "60"], cwd=REPO, capture_output=True, text=True,
                                timeout=120, user=65534, group=65534)
        assert "Traceback" not in answer.stderr, answer.stderr
        assert answer.returncode == 0 and answer.stdout.strip() == '{"stopped": []}', answer.stdout
        assert live(int(child_file.read_text()))
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(child_file.read_text()), signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


# A server that ignores SIGTERM and, at it, notes whether every server listed in its second argument's
# file still ran (none already killed).
PATIENT = """
import os, signal, sys, time
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
def on_term(*_):
    peers = [int(p) for p in open(sys.argv[2]).read().split()]
    with open(sys.argv[1], "w") as f:
        f.write("all running" if all(alive(p) for p in peers) else "one was killed before")
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".up", "w").close()
while True:
    time.sleep(1)
"""


def test_reap_stops_the_lapsed_runs_at_once(tmp_path):
    """Servers that ignore SIGTERM, each given 15 s before SIGKILL: stopped one after the other, a
    reap of several outlasted the time the orchestrator gives it, and the host was set aside with
    servers left on it. Each server here notes at its SIGTERM whether all the others still run."""
    work, peers = tmp_path / "work", tmp_path / "peers"
    run_dirs = [work / "sweep" / f"run-{i}" for i in range(3)]
    procs = []
    try:
        for run_dir in run_dirs:
            run_dir.mkdir(parents=True)
            procs.append(subprocess.Popen([sys.executable, "-c", PATIENT, str(run_dir / "term"), str(peers)],
                                          start_new_session=True))
        assert wait_for(lambda: all((d / "term.up").exists() for d in run_dirs), 60)
        (tmp_path / "peers.tmp").write_text(" ".join(str(p.pid) for p in procs))
        os.rename(tmp_path / "peers.tmp", peers)
        for run_dir, proc in zip(run_dirs, procs, strict=True):
            write_pid(str(run_dir / "server.pid"), proc.pid)
            (run_dir / "lease").touch()
            os.utime(run_dir / "lease", (time.time() - 1000, time.time() - 1000))
        answer = agent("reap", "--workdir", str(work), "--lease-s", "60")
        assert answer.returncode == 0, answer.stderr
        stopped = json.loads(answer.stdout)["stopped"]
        assert sorted(s["pid"] for s in stopped) == sorted(p.pid for p in procs)
        assert [(d / "term").read_text() for d in run_dirs] == ["all running"] * 3
        assert not any((d / "server.pid").exists() for d in run_dirs)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


NVIDIA_SMI_NA = """#!/bin/sh
# memory nvidia-smi cannot read on one GPU ([N/A]), one it failed on (ERR!), and a process whose name
# holds commas
case "$1" in
  --query-gpu=*) echo "0, NVIDIA GH200 480GB, [N/A], [N/A]"; echo "1, NVIDIA GH200 480GB, ERR!, 97871" ;;
  --query-compute-apps=*) echo "4242, python -m x --a 1,2,3, 81000" ;;
esac
"""


def test_gpus_nvidia_smi_cannot_read_are_kept_with_no_figure_and_release_is_not_waited_for(tmp_path, monkeypatch):
    """`[N/A]` memory made the whole answer an error: the probe saw no GPU, and every teardown waited
    its full timeout for a release it could never see. A comma in a process name did the same."""
    from harness.remote import agent
    (tmp_path / "nvidia-smi").write_text(NVIDIA_SMI_NA)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    found = agent.gpus()
    assert [(d["index"], d["memory_used_mib"], d["memory_total_mib"]) for d in found["devices"]] == [
        (0, None, None), (1, None, 97871.0)]
    assert found["processes"] == [{"pid": "4242", "name": "python -m x --a 1, 2, 3", "memory_mib": "81000"}]
    assert agent.gpu_released(",5000", timeout=5)["gpu_released"] is True


def test_stopping_the_sampler_leaves_no_sleep_behind():
    """The sampler gone at its SIGTERM: the killer that would SIGKILL it later is ended, its sleep
    with it (before, the sleep stayed on the host, adopted by init, for the grace's 30 s)."""
    from harness.lifecycle.measure import stop_sampler
    # a grace of this test process's own: the same test may run beside this one on the machine, and the
    # killer's sleep runs in a session of its own, so it is found by its command line alone
    grace = 30 + (os.getpid() % 9973) / 10000
    for _ in range(20):   # the signal lands at another point of the killer's start each time
        shell = subprocess.Popen(["bash", "-c", "sleep 100 & tpid=$!; " + stop_sampler(grace)])
        assert shell.wait(timeout=60) == 0
        left = subprocess.run(["pgrep", "-f", f"^sleep {grace:g}$"], capture_output=True, text=True).stdout.split()
        for pid in left:
            os.kill(int(pid), signal.SIGKILL)
        assert left == []
