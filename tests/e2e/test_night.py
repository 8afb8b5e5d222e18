"""A night on several hosts (network namespaces, real sshd in each): links that drop, links that blip,
every host busy. docs/reliability.md cases 5, 6 and 23 at the level of a whole sweep."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_faults import journal, wait_until
from tests.e2e.test_sweep import FAST, manifests
from tests.netns import netns_hosts
from tests.remote_venv import make_remote_venv


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with netns_hosts(3, tmp_path_factory.mktemp("night")) as made:
        yield made


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    return make_remote_venv(tmp_path_factory.mktemp("night-venv") / "venv", engines=("sglang",))


def write_inventory(path: Path, hosts, venv: Path) -> Path:
    path.write_text(yaml.safe_dump({"all": {"children": {"gpu": {"vars": {"venv": str(venv)}, "hosts": {
        h.name: {"address": h.address, "port": h.sshd.port, "user": h.sshd.user,
                 "identity_file": str(h.sshd.client_key), "known_hosts": str(h.sshd.known_hosts),
                 "workdir": str(h.workdir)} for h in hosts}}}}}))
    return path


def write_playbook(path: Path, configs: int, time_scale: str) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "night", "hosts": "gpu", "engine": "sim", "model": {"path": "/m", "served_name": "m"},
        "server": {"port": 30555, "env": {**FAST, "HARNESS_SIM_TIME_SCALE": time_scale}, "startup_timeout_s": 60},
        "configs": [{"name": f"c{i}", "args": {"mem-fraction-static": 0.8 + i / 100}} for i in range(configs)],
        "benchmark": {"prompt": "hi", "max_tokens": 24, "concurrency": [1], "requests": 4, "timeout_s": 60}}))
    return path


def sweep(tmp_path: Path, hosts, venv, *, configs: int, time_scale: str, extra=()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "sweep", str(write_playbook(tmp_path / "pb.yaml", configs, time_scale)),
         "-i", str(write_inventory(tmp_path / "inv.yaml", hosts, venv)), "-o", str(tmp_path / "r"), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def running_on(results: Path, host: str) -> bool:
    try:
        states = {e["run_id"]: e for e in journal(results)}
    except (OSError, ValueError):
        return False
    return any(e["state"] == "running" and e.get("host") == host for e in states.values())


def test_case5_a_host_whose_link_drops_mid_run_is_set_aside_and_its_run_finishes_elsewhere(tmp_path, hosts, venv):
    proc = sweep(tmp_path, hosts, venv, configs=4, time_scale="0.5", extra=["--lease", "6", "--host-retries", "1"])
    lost = hosts[0]
    try:
        assert wait_until(lambda: running_on(tmp_path / "r", lost.name), 120), proc.stderr.read()
        lost.link_down()
        out, err = proc.communicate(timeout=300)
    finally:
        lost.link_up()
    assert proc.returncode == 0, out + err
    runs = manifests(tmp_path / "r")
    assert {m["status"] for m in runs.values()} == {"ok"} and len(runs) == 4
    retried = [e for e in journal(tmp_path / "r") if e["state"] == "retry"]
    assert retried and retried[0]["host"] == lost.name
    assert runs[retried[0]["run_id"]]["host"]["name"] != lost.name
    assert f"[{lost.name}] lost" in err
    # its watchdog stopped the server on the host that was cut off: nothing of ours runs there
    assert wait_until(lambda: not _serving(lost), 30)


def test_case6_a_short_blip_fails_nothing(tmp_path, hosts, venv):
    proc = sweep(tmp_path, hosts, venv, configs=3, time_scale="0.3", extra=["--lease", "20"])
    blipped = hosts[1]
    assert wait_until(lambda: running_on(tmp_path / "r", blipped.name), 120), proc.stderr.read()
    blipped.link_down()
    time.sleep(2)
    blipped.link_up()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    assert not [e for e in journal(tmp_path / "r") if e["state"] == "retry"]
    assert all(m["attempts"] == 1 for m in manifests(tmp_path / "r").values())


def test_every_host_is_kept_busy(tmp_path, hosts, venv):
    proc = sweep(tmp_path, hosts, venv, configs=6, time_scale="0.2")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    used = {m["host"]["name"] for m in manifests(tmp_path / "r").values()}
    assert used == {h.name for h in hosts}


def _serving(host) -> bool:
    done = subprocess.run(["ip", "netns", "exec", host.netns, "ss", "-ltn", "sport = :30555"],
                          capture_output=True, text=True)
    return "30555" in done.stdout
