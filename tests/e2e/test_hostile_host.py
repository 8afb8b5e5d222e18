"""Hosts whose login prints before every command, over a real sshd on loopback (tests/sshd.py, with a
ForceCommand that stands for the shell's start-up files), and a Slurm login host whose link drops while
a step holds a server. srun is stood in for by a script that runs the step's command as srun runs it
on the node (its options dropped, the step's ids in the environment): what is tested is the transport
on this side of it."""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from harness.errors import RemoteTimeout, UnreachableError
from harness.transport import HostSpec, connect
from harness.transport.slurm import SlurmTransport
from tests.sshd import Sshd

pytestmark = pytest.mark.e2e

LOGIN = """#!/bin/bash
# what the host's shell start-up prints before every command, as `mode` says
case "$(cat {mode})" in
  banner) echo "Welcome to gpu-cluster (quota 91%)" ;;
  number) printf '%s\\n' "$(head -c 5000 /dev/zero | tr '\\0' 7)" ;;
  unterminated) printf 'Last login: today' ;;
  flood) head -c 1000000 /dev/zero | tr '\\0' A ;;
esac
exec bash -c "$SSH_ORIGINAL_COMMAND"
"""

SRUN = """#!/bin/bash
# srun as the node runs a step: its options dropped, the step's ids in the environment
while [ $# -gt 0 ] && [ "$1" != bash ]; do shift; done
export SLURM_JOB_ID=4242 SLURM_STEP_ID=7
exec "$@"
"""


class LoginSshd(Sshd):
    """An sshd whose every session runs `login` first (ForceCommand)."""

    def __init__(self, directory: Path, login: Path, **kwargs):
        super().__init__(directory, **kwargs)
        self._login = login

    def _config(self) -> str:
        return super()._config() + f"ForceCommand {self._login}\n"


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The sshd, and `mode(name)`, which sets what its logins print from now on."""
    root = tmp_path_factory.mktemp("login-host")
    mode = root / "mode"
    mode.write_text("plain")
    (root / "bin").mkdir()
    for path, text in ((root / "login.sh", LOGIN.format(mode=mode)), (root / "bin" / "srun", SRUN)):
        path.write_text(text)
        path.chmod(0o755)
    with LoginSshd(root / "sshd", root / "login.sh", env={"PATH": f"{root / 'bin'}:/usr/bin:/bin"}) as sshd:
        yield sshd, mode.write_text
    mode.write_text("plain")


@pytest.fixture(params=["mux", "exec"])
def starter(request, monkeypatch):
    """"mux": commands through the host's command starter; "exec": an exec channel each (a host without
    python3), as a kill and every Slurm step always take."""
    monkeypatch.setenv("HARNESS_SSH_MUX", "1" if request.param == "mux" else "0")
    return request.param


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("login", ["banner", "number", "unterminated"])
def test_what_a_login_prints_never_reaches_a_commands_output(host, starter, login):
    sshd, mode = host
    mode(login)
    with closing(connect(sshd.host_spec())) as transport:
        assert transport.run("echo '{\"status\": \"healthy\"}'", timeout=10).stdout == '{"status": "healthy"}\n'
        assert transport.run("cat", stdin=b"fed", timeout=10).stdout == "fed"


def test_behind_a_login_banner_a_timed_out_command_is_killed_with_its_whole_process_group(host, starter, tmp_path):
    sshd, mode = host
    mode("banner")
    marker = tmp_path / "child.pid"
    with closing(connect(sshd.host_spec())) as transport:
        with pytest.raises(RemoteTimeout):
            transport.run(f"sleep 300 & echo $! > {marker}; echo started; wait", timeout=2)
        pid = int(marker.read_text())
        try:
            assert not alive(pid)   # by our kill, long before the host's own timer
        finally:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_behind_a_login_banner_a_pull_brings_every_file_back(host, starter, tmp_path):
    sshd, mode = host
    mode("banner")
    remote = tmp_path / "remote"
    (remote / "profile").mkdir(parents=True)
    (remote / "server.log").write_text("ready\n")
    (remote / "profile" / "trace.json").write_bytes(b"{}" * 50_000)
    with closing(connect(sshd.host_spec())) as transport:
        pulled = transport.pull(str(remote), tmp_path / "local", timeout=30)
    assert sorted(pulled.sizes) == ["profile/trace.json", "server.log"]
    assert (tmp_path / "local" / "server.log").read_text() == "ready\n"


def test_a_login_that_prints_without_end_fails_the_command_as_a_lost_link(host, starter):
    sshd, mode = host
    mode("flood")
    with closing(connect(sshd.host_spec())) as transport:
        started = time.monotonic()
        with pytest.raises(UnreachableError, match="not the line that starts a command"):
            transport.run("echo hi", timeout=30)
        assert time.monotonic() - started < 15


def slurm_node(sshd: Sshd) -> SlurmTransport:
    login = connect(sshd.host_spec(name="login"))
    return SlurmTransport(HostSpec(name="n1"), login, job_id="4242", node="n1", python=sys.executable)


def test_a_slurm_node_behind_a_login_banner_runs_its_commands_and_pulls(host, tmp_path):
    sshd, mode = host
    mode("banner")
    (tmp_path / "remote").mkdir()
    (tmp_path / "remote" / "server.log").write_text("ready\n")
    node = slurm_node(sshd)
    try:
        result = node.run("echo hi", timeout=20)
        assert (result.stdout, result.step) == ("hi\n", "4242.7")
        assert sorted(node.pull(str(tmp_path / "remote"), tmp_path / "local", timeout=30).sizes) == ["server.log"]
    finally:
        node.close()


def test_after_the_login_link_drops_under_a_kept_step_the_nodes_next_commands_run(host):
    """The step that launched a server is kept while it holds it; the login host's link drops (its
    sshd sessions die) and the transport connects again. The kept step is out of reach then, and is
    let go: it used to fail every later command on the node as unreachable."""
    sshd, mode = host
    mode("plain")
    node = slurm_node(sshd)
    pid = None
    try:
        launched = node.run("sleep 120 >/dev/null 2>&1 </dev/null & echo $!", timeout=20)
        pid = int(launched.stdout)
        assert len(node._kept) == 1
        for session in sshd._processes():
            if session != sshd.pid:
                os.kill(session, signal.SIGKILL)
        session_lost_by = time.monotonic() + 10
        while node.login._hops and node.login._hops[-1].transport.is_active():
            assert time.monotonic() < session_lost_by
            time.sleep(0.05)
        for _ in range(2):
            assert node.run("echo hi", timeout=20).stdout == "hi\n"
        assert node._kept == []
    finally:
        node.close()
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
