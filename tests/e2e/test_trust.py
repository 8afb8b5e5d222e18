"""Nothing on a host that is not ours (RELIABILITY cases 25, 26, 28, 29): a real sshd, real sweeps.

Every sshd of the tests runs commands as root, so "another user" is made with chown/chmod the way
another account on a shared GPU host would leave things.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import harness
from tests.e2e.test_sweep import manifests, playbook

pytestmark = pytest.mark.e2e


def sweep(tmp_path, inventory, **extra):
    return harness("sweep", playbook(tmp_path, profile="none", configs=[{"name": "one"}], **extra),
                   "-i", inventory, "-o", tmp_path / "r")


def test_the_default_workdir_is_the_ssh_users_own_private_folder(tmp_path, ssh_inventory, remote_venv):
    """`~/` in workdir and venv is the SSH user's home on the host (quoted, it would be a folder named ~)."""
    name = f"harness-test-{secrets.token_hex(4)}"
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    (home / f"{name}-venv").symlink_to(remote_venv)
    try:
        run = sweep(tmp_path, ssh_inventory(workdir=f"~/{name}", venv=f"~/{name}-venv"))
        assert run.returncode == 0, run.stdout + run.stderr
        m = manifests(tmp_path / "r")["one-1"]
        assert m["host"]["workdir"] == str(home / name)            # resolved on the host, absolute
        assert m["host"]["venv"] == str(home / f"{name}-venv")
        assert stat.S_IMODE((home / name).stat().st_mode) == 0o700
    finally:
        shutil.rmtree(home / name, ignore_errors=True)
        (home / f"{name}-venv").unlink()


@pytest.mark.parametrize("mode, owner, why", [
    (0o777, None, "is writable by others (mode 777)"),
    (0o770, None, "is writable by others (mode 770)"),
    (0o700, "nobody", "belongs to nobody, not to the SSH user"),
], ids=["world-writable", "group-writable", "foreign-owned"])
def test_a_workdir_others_could_write_in_is_refused_before_anything_runs(tmp_path, ssh_inventory, mode,
                                                                         owner, why):
    work = tmp_path / "shared-work"
    work.mkdir()
    work.chmod(mode)
    if owner:
        os.chown(work, pwd.getpwnam(owner).pw_uid, -1)
    run = sweep(tmp_path, ssh_inventory(workdir=str(work)))
    assert run.returncode == 1, run.stdout + run.stderr
    m = manifests(tmp_path / "r")["one-1"]
    assert (m["status"], m["error"]["kind"]) == ("failed", "preflight")
    assert why in m["error"]["message"]
    assert os.listdir(work) == []                                  # no agent was ever put there


def unrelated_job():
    """A process of its own session and group, as another user's job on a GPU host would be."""
    return subprocess.Popen(["setsid", "sleep", "120"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stale_run(work: Path, record: str) -> Path:
    run_dir = work / "old-sweep" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "server.pid").write_text(record + "\n")
    (run_dir / "lease").touch()
    os.utime(run_dir / "lease", (1, 1))         # lapsed long ago
    return run_dir


def agent(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "harness.remote", "agent", *args], capture_output=True, text=True,
                          timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


@pytest.mark.parametrize("record", [
    lambda pid: f"{pid} 1 {boot_id()}",                 # the pid was reused: another start time
    lambda pid: f"{pid} {start_time(pid)} 00000000-0000-0000-0000-000000000000",   # before a reboot
    lambda pid: f"{pid}",                                # an old record without identity
], ids=["reused-pid", "other-boot", "no-identity"])
def test_a_stale_pid_file_naming_another_process_signals_nothing(tmp_path, record):
    job = unrelated_job()
    try:
        time.sleep(0.2)   # setsid has exec'd sleep: its start time is final
        run_dir = stale_run(tmp_path / "work", record(job.pid))
        assert agent("reap", "--workdir", str(tmp_path / "work"), "--lease-s", "1")["stopped"] == []
        agent("stop", "--pid-file", str(run_dir / "server.pid"), "--port", "1", "--timeout", "2")
        assert job.poll() is None, "an unrelated process was signalled"
    finally:
        job.kill()
        job.wait()


def test_a_pid_file_that_still_names_our_server_is_reaped_and_removed(tmp_path):
    job = unrelated_job()   # stands in for a server of an earlier sweep whose orchestrator died
    try:
        time.sleep(0.2)
        run_dir = stale_run(tmp_path / "work", f"{job.pid} {start_time(job.pid)} {boot_id()}")
        stopped = agent("reap", "--workdir", str(tmp_path / "work"), "--lease-s", "1")["stopped"]
        assert [s["pid"] for s in stopped] == [job.pid]
        assert job.wait(timeout=30) is not None
        agent("stop", "--pid-file", str(run_dir / "server.pid"), "--port", "1", "--timeout", "2")
        assert not (run_dir / "server.pid").exists()
    finally:
        job.kill()


def test_a_run_that_fails_after_its_secrets_reached_the_host_leaves_them_nowhere(tmp_path, ssh_inventory):
    """RELIABILITY case 29: the secrets file is uploaded before the server starts; when the start
    fails, the server is stopped, the file is removed on the host and never pulled into the results,
    though the failed run's folder stays on the host for whoever looks into it."""
    secret = "hf_" + secrets.token_hex(8)
    run = harness(
        "sweep", playbook(tmp_path, profile="none", configs=[
            {"name": "dies", "env": {"HF_TOKEN": secret, "HARNESS_SIM_FAULT": "oom_at_start"}}]),
        "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1, run.stdout + run.stderr
    m = manifests(tmp_path / "r")["dies-1"]
    assert m["error"]["kind"] == "oom" and "teardown" in m["phases"]
    remote_runs = list((tmp_path / "remote-work").glob("e2e-sglang-*/dies-1"))
    assert remote_runs and (remote_runs[0] / "server.log").exists()        # kept: the run failed
    assert not (remote_runs[0] / ".secrets.env").exists()
    local = [p for p in (tmp_path / "r").rglob("*") if p.is_file()]
    assert not [p for p in local if p.name == ".secrets.env"]
    assert not [p for p in local if secret in p.read_text(errors="replace")]


def test_a_good_runs_folder_leaves_the_host_once_collected(tmp_path, ssh_inventory):
    run = sweep(tmp_path, ssh_inventory())
    assert run.returncode == 0, run.stdout + run.stderr
    (sweep_root,) = (tmp_path / "remote-work").glob("e2e-sglang-*")
    assert not (sweep_root / "one-1").exists()
    assert list((tmp_path / "r").glob("*/runs/one-1/server.log"))


def test_names_from_a_playbook_or_a_shared_run_directory_never_lead_a_write_outside(tmp_path, ssh_inventory):
    """RELIABILITY: a playbook name of `../x` made the sweep folder outside the results; a run folder
    from a colleague (or anyone) could name a template file `../../x.j2`. Both are refused at load."""
    pb = playbook(tmp_path, profile="none", configs=[{"name": "one"}])
    bad = pb.read_text().replace("name: e2e-sglang", "name: ../../outside", 1)
    (tmp_path / "bad.yaml").write_text(bad)
    run = harness("sweep", tmp_path / "bad.yaml", "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 2 and "bad.yaml" in run.stderr and ": name:" in run.stderr, run.stderr
    assert not (tmp_path / "outside").exists() and not (tmp_path / "r").exists()
    good = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert good.returncode == 0, good.stderr
    (run_dir,) = (tmp_path / "r").glob("*/runs/one-1")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["template"]["files"]["../../../escape.j2"] = "x"
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    again = harness("reproduce", run_dir, "-i", ssh_inventory(), "-o", tmp_path / "again")
    assert again.returncode == 2 and "is not a plain file name" in " ".join(again.stderr.split()), again.stderr
    assert not list(tmp_path.rglob("escape.j2"))


def test_a_prompt_of_200_kb_that_starts_with_a_dash_is_benchmarked_as_given(tmp_path, ssh_inventory):
    """RELIABILITY case 36: on a command line such a prompt broke the launch of the client (a word
    over the kernel's 128 KiB) or was read as an option; it reaches the host in a file instead."""
    prompt = "-v " + "x" * 200_000
    pb = playbook(tmp_path, configs=[{"name": "long"}],
                  benchmark={"prompt": prompt, "max_tokens": 4, "requests": 2, "warmup": 0})
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    (bench,) = (tmp_path / "r").glob("*/runs/long-1/bench.json")
    result = json.loads(bench.read_text())
    assert result["prompt"] == prompt and result["levels"][0]["completed"] == 2


def test_inventory_names_with_shell_metacharacters_are_refused_at_load(tmp_path, ssh_inventory):
    """RELIABILITY case 28: host names, env names and secret names reached launch.sh unquoted."""
    marker = tmp_path / "pwned"
    for host_vars in ({"env": {f"X;touch {marker}": "1"}}, {"secrets": [f"$(touch {marker})"]}):
        run = harness("plan", playbook(tmp_path, profile="none"), "-i", ssh_inventory(**host_vars))
        assert run.returncode == 2 and "not a valid environment variable name" in " ".join(run.stderr.split())
    inventory = tmp_path / "names.yaml"
    inventory.write_text(f'all: {{hosts: {{"n1;touch {marker}": {{transport: local}}}}}}\n')
    run = harness("plan", playbook(tmp_path, profile="none", hosts="all"), "-i", inventory)
    assert run.returncode == 2 and "use letters, digits" in " ".join(run.stderr.split()), run.stderr
    assert not marker.exists()


@pytest.mark.parametrize(("answer", "said"), [
    ('[1]', "no answer"),
    ('{"module_ok": true, "port_free": true, "gpus": [1]}', "gpus: Input should be"),
    ('{"module_ok": true, "port_free": false, "port_holders": [1]}', "port_holders.0: Input should be"),
    ('{"module_ok": "maybe", "port_free": true}', "module_ok: Input should be a valid boolean"),
])
def test_a_probe_answer_of_another_shape_fails_the_run_at_preflight_naming_the_field(tmp_path, ssh_inventory,
                                                                                  remote_venv, answer, said):
    """A host is not trusted: a venv whose python answers the agent's probe with what the agent never
    sends fails the run as preflight, naming what is wrong, never as the harness's own bug; `harness
    check` says so too."""
    venv = tmp_path / "odd-venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(remote_venv / "bin" / "activate", venv / "bin" / "activate")
    (tmp_path / "answer.json").write_text(answer + "\n")
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *"agent probe"*) cat {tmp_path / "answer.json"}; exit 0;; esac\n'
                      f'exec {remote_venv / "bin" / "python"} "$@"\n')
    python.chmod(0o755)
    inventory = ssh_inventory(venv=str(venv))
    run = sweep(tmp_path, inventory)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "internal" not in run.stderr
    error = manifests(tmp_path / "r")["one-1"]["error"]
    assert error["kind"] == "preflight" and said in error["message"], error

    check = harness("check", "-i", inventory, "--limit", "node1")
    assert check.returncode == 1 and "Traceback" not in check.stderr, check.stdout + check.stderr
    assert said in " ".join(check.stdout.split()), check.stdout
