"""Shared fixtures: a real sshd on loopback, a "remote" venv whose engines are the simulator, and a
way to run the real `harness` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.remote_venv import REPO, make_remote_venv
from tests.sshd import Sshd


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    with Sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture(scope="session")
def remote_venv(tmp_path_factory) -> Path:
    return make_remote_venv(tmp_path_factory.mktemp("remote") / "venv")


@pytest.fixture
def ssh_inventory(tmp_path, sshd, remote_venv):
    """An inventory with one SSH host `node1` (the test sshd) and `localhost`, both with the remote venv."""
    def write(**host_vars) -> Path:
        node = {"address": sshd.address, "port": sshd.port, "user": sshd.user,
                "identity_file": str(sshd.client_key), "known_hosts": str(sshd.known_hosts),
                "venv": str(remote_venv), **host_vars}
        inv = {"all": {"vars": {"workdir": str(tmp_path / "remote-work")},
                       "hosts": {"localhost": {"transport": "local", "venv": str(remote_venv)}},
                       "children": {"gpu": {"hosts": {"node1": node}}}}}
        path = tmp_path / "inventory.yaml"
        path.write_text(yaml.safe_dump(inv))
        return path
    return write


def harness(*args: str, cwd: Path = REPO, env: dict | None = None, timeout: float = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run the real `harness` command line, as a user would."""
    return subprocess.run([sys.executable, "-m", "harness", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, input=input,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


# --- the sweeps the tests interrupt hear Ctrl-C ---------------------------------------------------------
# A shell script's background job starts with SIGINT ignored, every process it starts inherits that
# through exec, and the tests that interrupt a sweep would find it deaf (they failed so, started by
# `cmd &` from a script). A handler of our own is reset to the default at exec instead.

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# --- no test sends a packet off this machine -----------------------------------------------------------

_leak_watch = None


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its path relative to it: what a pull left there."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def pytest_sessionstart(session):
    """Watch this machine's own interfaces for packets to the test hosts' range (tests/leakwatch.py);
    it takes root, as the namespace hosts do."""
    global _leak_watch
    if os.geteuid() == 0:
        from tests.leakwatch import LeakWatch
        _leak_watch = LeakWatch().__enter__()


def _leaks() -> list[str]:
    if _leak_watch is None:
        return []
    _leak_watch.stop()
    if _leak_watch.unwatched:
        print(f"\nnot watched for packets to the test range: {', '.join(_leak_watch.unwatched)}")
    return [str(leak) for leak in _leak_watch.leaks]


# --- CI must never skip an end-to-end test ------------------------------------------------------------

_skipped_e2e: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and report.nodeid.startswith("tests/e2e/"):
        _skipped_e2e.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if _skipped_e2e and os.environ.get("HARNESS_REQUIRE_E2E") == "1":
        print(f"\nend-to-end tests were skipped, which CI does not allow: {_skipped_e2e}")
        session.exitstatus = 1
    if leaks := _leaks():
        print(f"\npackets to the test hosts' range left this machine ({len(leaks)}): {leaks[:20]}")
        session.exitstatus = 1
