"""A server process that leaves its session (setsid, as Ray's daemons and some launchers do) is out of
reach of any signal to the launch wrapper's process group and session: it held the port (or the GPUs)
after stop, the watchdog and reap, and the next run's preflight found them taken.

Real processes, launched by the real launch wrapper (`server.launch`, its shell run here by bash) with
the real agent's stop, watch and reap: a launch script whose helper double-forks, calls setsid,
ignores SIGTERM and listens on the run's port."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.facts import await_script
from harness.lifecycle import server
from harness.remote.agent import group_members
from harness.results.answers import read_answer
from tests.e2e.test_faults import listening
from tests.unit.test_agent_processes import free_port, live, orphaned_group, wait_for

REPO = Path(__file__).resolve().parents[2]

# Double-forks, the middle process calling setsid: the grandchild is in neither the wrapper's process
# group nor its session. It ignores SIGTERM when told (its third argument), listens on the port given
# and writes its pid when it does.
ESCAPER = """
import os, signal, socket, sys, time
if os.fork():
    os.wait()
    sys.exit(0)
os.setsid()
if os.fork():
    os._exit(0)
if sys.argv[3] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[2])))
s.listen()
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(1)
"""


def agent_words(*args) -> list[str]:
    return [sys.executable, "-m", "harness.remote", "agent", *map(str, args)]


def agent(*args) -> subprocess.CompletedProcess:
    return subprocess.run(agent_words(*args), cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def sh(command: str, timeout: float, stdin: bytes | None = None, check: bool = True, **as_user) -> SimpleNamespace:
    """The host's shell, as a transport runs a command there."""
    r = subprocess.run(["bash", "-c", command], input=stdin, capture_output=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, **as_user)
    return SimpleNamespace(stdout=r.stdout.decode(), stderr=r.stderr.decode(), exit_code=r.returncode,
                           command=command, step=None)


def context(run_dir: Path, script: str, port: int, lease_s: float) -> SimpleNamespace:
    """What `server.launch` and `server.teardown` read of a run's context, for a run on this machine."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return SimpleNamespace(
        paths=SimpleNamespace(root=str(run_dir), pid_file=str(run_dir / "server.pid"),
                              lease=str(run_dir / "lease"), secrets_file=str(run_dir / ".secrets.env")),
        take_facts=lambda: await_script(str(run_dir.parent / ".host" / "facts"), str(run_dir / "facts")),  # none
        rendered=SimpleNamespace(secret_env={}, script=script, port=port, args={}),
        agent_command=lambda *args: shlex.join(agent_words(*args)),
        sh=sh, lease_s=lease_s, host=SimpleNamespace(name="testhost"), server_address="127.0.0.1",
        found=SimpleNamespace(server_step=None, server_pid=None, warnings=[], probe=None),
        sweep=SimpleNamespace(playbook=SimpleNamespace(profile=SimpleNamespace(mode="none"))),
        fail=lambda kind, message, output="": AssertionError(f"{message}\n{output}"),
        parse_agent=lambda model, what, result: read_answer(model, result.stdout),
    )


class Launched(SimpleNamespace):
    ctx: SimpleNamespace
    run_dir: Path
    port: int
    wrapper: int
    escaped: int


@pytest.fixture
def launch(tmp_path):
    """Launches a server through the real wrapper whose script starts the escaper, then either stays
    (`exec sleep`) or exits at once (as `ray start` does); afterwards kills whatever is left. The
    escaper ignores SIGTERM unless told otherwise (the watchdog and reap wait 15 s before SIGKILL)."""
    started: list[Launched] = []

    def start(stays: bool, run_dir: Path | None = None, sigterm: str = "ignore") -> Launched:
        run_dir = run_dir or tmp_path / "run"
        helper = tmp_path / "escaper.py"
        helper.write_text(ESCAPER)
        port = free_port()
        child = run_dir / "escaped.pid"
        script = (shlex.join([sys.executable, str(helper), str(child), str(port), sigterm]) + "\n"
                  + ("exec sleep 600\n" if stays else "exit 0\n"))
        ctx = context(run_dir, script, port, lease_s=600)
        wrapper = server.launch(ctx)   # type: ignore[arg-type]
        assert wait_for(lambda: child.exists(), 60), (run_dir / "server.log").read_text()
        s = Launched(ctx=ctx, run_dir=run_dir, port=port, wrapper=wrapper, escaped=int(child.read_text()))
        started.append(s)
        assert listening(port)
        return s

    yield start
    for s in started:   # what a failed test left: the watchdog, the escaped process, the server's group
        try:
            watchdog = int((s.run_dir / "watchdog.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            watchdog = 0
        for pid in [watchdog, s.escaped, *group_members(s.wrapper)]:
            if pid and live(pid):
                os.kill(pid, signal.SIGKILL)


def kill_watchdog(s: Launched) -> None:
    """The launch's watchdog gone, as on a host whose earlier sweep's watchdog was killed."""
    pid_file = s.run_dir / "watchdog.pid"
    assert wait_for(pid_file.exists, 60)
    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)


@pytest.mark.parametrize("stays", [True, False], ids=["server-running", "server-exited"])
def test_stop_ends_a_process_that_left_the_session(launch, stays):
    s = launch(stays)
    if not stays:
        assert wait_for(lambda: not live(s.wrapper), 60)
    answer = agent("stop", "--pid-file", s.run_dir / "server.pid", "--port", s.port, "--timeout", 4)
    assert answer.returncode == 0, answer.stderr
    assert wait_for(lambda: not live(s.escaped), 60), f"the escaped process outlived the stop: {answer.stdout}"
    stop = json.loads(answer.stdout.splitlines()[-1])
    assert (stop.get("escaped"), stop.get("escaped_alive"), stop["group_alive"], stop["port_closed"]) == (
        1, 0, False, True)
    assert not (s.run_dir / "server.pid").exists()


def test_teardown_says_how_many_escaped_processes_it_stopped(launch):
    s = launch(True, sigterm="obey")
    answer = server.teardown(s.ctx)   # type: ignore[arg-type]
    assert wait_for(lambda: not live(s.escaped), 60)
    assert answer.port_closed and not answer.group_alive
    assert any("1 server process(es) on testhost had left the server's session" in w for w in s.ctx.found.warnings), \
        s.ctx.found.warnings


@pytest.mark.parametrize("stays", [True, False], ids=["server-running", "server-exited"])
def test_the_watchdog_ends_a_process_that_left_the_session_when_the_lease_lapses(launch, stays):
    """The launch's own watchdog (with a long lease) is replaced by one of a short lease, started once
    the process has escaped: no race between the escape and the lapse."""
    s = launch(stays, sigterm="obey")
    kill_watchdog(s)
    if not stays:
        assert wait_for(lambda: not live(s.wrapper), 60)
    lease = s.run_dir / "lease"
    os.utime(lease, (time.time() - 100, time.time() - 100))
    wd = subprocess.Popen(agent_words("watch", "--pid-file", s.run_dir / "server.pid", "--lease", lease,
                                      "--lease-s", 1), cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert wd.wait(timeout=120) == 0
        said = wd.stdout.read() if wd.stdout else ""
        assert wait_for(lambda: not live(s.escaped) and not live(s.wrapper), 60), said
        assert "processes that had left the session" in said
        assert not listening(s.port)
        assert not (s.run_dir / "server.pid").exists()
    finally:
        if wd.poll() is None:
            wd.kill()
            wd.wait()


def test_reap_ends_what_an_earlier_sweep_left_outside_the_session(launch, tmp_path):
    """The earlier sweep's server exited, its watchdog is gone, the process it left holds the port."""
    workdir = tmp_path / "work"
    s = launch(False, run_dir=workdir / "sweep-1" / "run-1", sigterm="obey")
    kill_watchdog(s)
    assert wait_for(lambda: not live(s.wrapper), 60)
    lease = s.run_dir / "lease"
    os.utime(lease, (time.time() - 1000, time.time() - 1000))
    answer = agent("reap", "--workdir", workdir, "--lease-s", 60)
    assert answer.returncode == 0, answer.stderr
    assert wait_for(lambda: not live(s.escaped), 60), answer.stdout
    assert '"escaped": 1' in answer.stdout
    assert not listening(s.port) and not (s.run_dir / "server.pid").exists()


def test_the_marker_is_matched_exactly_and_a_zombie_is_not_a_live_process():
    """A value that merely starts with the marker, or another run's, is another run's process; a
    zombie carrying it is dead (its environment reads empty) and is never waited for."""
    from harness.remote.agent import MARKER, marked
    token = "0123456789abcdef0123456789abcdef"
    env = {**os.environ}
    ours = subprocess.Popen(["sleep", "600"], env={**env, MARKER: token})
    longer = subprocess.Popen(["sleep", "600"], env={**env, MARKER: token + "0"})
    other = subprocess.Popen(["sleep", "600"], env={**env, "OTHER": f"{MARKER}={token}"})
    zombie = subprocess.Popen(["true"], env={**env, MARKER: token})
    try:
        assert wait_for(lambda: not live(zombie.pid), 60)
        assert marked(token) == [ours.pid]
        assert marked("") == []
    finally:
        for p in (ours, longer, other, zombie):
            p.kill()
            p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to be another user)")
def test_another_users_process_with_the_marker_is_left_alone():
    from harness.remote.agent import MARKER, marked
    token = "fedcba9876543210fedcba9876543210"
    theirs = subprocess.Popen(["sleep", "600"], env={MARKER: token, "PATH": os.environ["PATH"]},
                              user=65534, group=65534)
    try:
        assert wait_for(lambda: live(theirs.pid), 60)
        assert marked(token) == []
    finally:
        theirs.kill()
        theirs.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to be another user) and a python the other user can run")
def test_teardown_warns_when_server_processes_outlive_the_stop():
    """The stop could not end the server (here: its pid file names another user's group, which the
    SSH user may not signal): the run's warnings say so, naming the host and what to do. Before, the
    teardown passed in silence and the next run's preflight found the port or GPUs taken."""
    run_dir = Path(tempfile.mkdtemp())
    child_file = run_dir / "child"
    try:
        os.chmod(run_dir, 0o755)
        daemon = orphaned_group(child_file)
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        (run_dir / "server.pid").write_text(f"{daemon.pid} 1 {boot}\n")
        os.chmod(run_dir / "server.pid", 0o644)
        ctx = context(run_dir, "", free_port(), lease_s=600)
        ctx.agent_command = lambda *args: shlex.join(["/usr/bin/python3", "-m", "harness.remote", "agent",
                                                      *map(str, args)])
        ctx.sh = lambda command, timeout, check=True: sh(command, timeout, user=65534, group=65534)
        answer = server.teardown(ctx)   # type: ignore[arg-type]
        assert answer.group_alive and answer.signal is None
        assert any("server processes still run on testhost after teardown" in w for w in ctx.found.warnings), \
            ctx.found.warnings
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(child_file.read_text()), signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
