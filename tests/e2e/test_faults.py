"""Faults a night alone brings (docs/reliability.md), with real sshd, real processes and real files.

Each test names its case. The sweep runs as a user runs it: the `harness` command in a subprocess.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import harness
from tests.e2e.test_sweep import manifests, playbook, sweep_dir


def port_of(pb: Path) -> int:
    return yaml.safe_load(pb.read_text())["server"]["port"]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def journal(results: Path) -> list[dict]:
    return [json.loads(line) for line in (sweep_dir(results) / "journal.jsonl").read_text().splitlines()]


def start_sweep(pb: Path, inv: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", "sweep", str(pb), "-i", str(inv), "-o", str(out),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def two_hosts(ssh_inventory, tmp_path, **node2) -> Path:
    """node1 as usual, node2 a copy of it with `node2` overrides (a closed port, a wrong key...)."""
    inv = ssh_inventory()
    data = yaml.safe_load(inv.read_text())
    gpu = data["all"]["children"]["gpu"]["hosts"]
    gpu["node2"] = {**gpu["node1"], "workdir": str(tmp_path / "remote-work-2"), **node2}
    inv.write_text(yaml.safe_dump(data))
    return inv


def test_case2_a_changed_host_key_sets_that_host_aside_and_the_sweep_goes_on(tmp_path, ssh_inventory, sshd):
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(f"[{sshd.address}]:{sshd.port} ssh-ed25519 "
                     "AAAAC3NzaC1lZDI1NTE5AAAAIOcWSk6oNYUqWjFmHqLYsaEJ3Go9qAyWxLOLTnzLdOGn\n")
    inv = two_hosts(ssh_inventory, tmp_path, known_hosts=str(wrong))
    run = harness("sweep", playbook(tmp_path, hosts="gpu", profile="none"), "-i", inv, "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    assert {m["host"]["name"] for m in manifests(tmp_path / "r").values()} == {"node1"}
    assert run.stderr.count("[node2] set aside") == 1  # refused once, never retried
    assert "CHANGED" in run.stderr


def test_case3_an_unreachable_host_is_set_aside_with_bounded_backoff(tmp_path, ssh_inventory):
    inv = two_hosts(ssh_inventory, tmp_path, port=1)
    pb = playbook(tmp_path, hosts="gpu", profile="none", placement="each", configs=[{"name": "one"}])
    run = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r", "--host-retries", "1")
    assert run.returncode == 1
    runs = manifests(tmp_path / "r")
    assert runs["one-node1-1"]["status"] == "ok"
    assert runs["one-node2-1"]["status"] == "failed" and runs["one-node2-1"]["error"]["kind"] == "unreachable"
    assert run.stderr.count("[node2] set aside") == 2  # the first attempt and one retry after a backoff


def killed_while_second_runs(tmp_path: Path, ssh_inventory, *, lease: float) -> tuple[Path, Path, Path]:
    """A sweep of `first` (quick) and `second` (slow), its orchestrator SIGKILLed once first is done
    and second's server listens: the playbook, inventory and results."""
    pb = playbook(tmp_path, profile="none", configs=[
        {"name": "first"}, {"name": "second", "env": {"HARNESS_SIM_TIME_SCALE": "1"}}])
    inv, out = ssh_inventory(), tmp_path / "r"
    proc = start_sweep(pb, inv, out, "--lease", str(lease))
    assert wait_until(lambda: (out.exists() and any(out.glob("*/runs/first-1/manifest.json"))
                               and listening(port_of(pb))), 120), proc.communicate(timeout=5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return pb, inv, out


def test_case10_a_killed_orchestrator_leaves_no_server_and_resume_reruns_only_the_unfinished(tmp_path,
                                                                                            ssh_inventory):
    pb, inv, out = killed_while_second_runs(tmp_path, ssh_inventory, lease=4)
    assert wait_until(lambda: not listening(port_of(pb)), 60), "the watchdog did not stop the orphan"
    first = sweep_dir(out) / "runs" / "first-1" / "manifest.json"
    before = first.stat().st_mtime_ns
    run = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
    assert run.returncode == 0, run.stdout + run.stderr
    assert first.stat().st_mtime_ns == before  # finished runs are left alone
    assert {k: m["status"] for k, m in manifests(out).items()} == {"first-1": "ok", "second-1": "ok"}
    assert len(list(out.iterdir())) == 1  # the same sweep, continued
    assert [e["run_id"] for e in journal(out) if e["state"] == "ok"] == ["first-1", "second-1"]


def test_a_run_in_flight_at_the_kill_and_removed_from_the_playbook_has_its_server_stopped_at_the_resume(
        tmp_path, ssh_inventory):
    """Its server holds the port until its lease lapses (here far beyond the resume): the resume stops
    it as it stops any run found in flight. Before, only runs still in the playbook were reconciled,
    and the next run's preflight found the port taken and set the host aside."""
    pb, inv, out = killed_while_second_runs(tmp_path, ssh_inventory, lease=600)
    data = yaml.safe_load(pb.read_text())
    data["configs"] = [{"name": "first"}, {"name": "third"}]
    pb.write_text(yaml.safe_dump(data, sort_keys=False))
    run = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "second-1: no longer in the playbook; it was in flight: its server stopped" in run.stderr
    assert {k: m["status"] for k, m in manifests(out).items()} == {"first-1": "ok", "third-1": "ok"}
    assert not listening(port_of(pb))
    assert [e["state"] for e in journal(out) if e["run_id"] == "second-1"][-1] == "interrupted"


def test_case33_a_second_orchestrator_is_refused_and_status_tells_running_from_stopped(tmp_path, ssh_inventory):
    """While a sweep runs, a second `--resume` would stop its servers and rerun its runs: it is refused
    with who holds the sweep, before it touches any host. `status` says who runs it; once that process
    is killed, `status` says stopped (and exits 1: the run in flight is lost) and `--resume` takes over."""
    pb = playbook(tmp_path, profile="none", configs=[{"name": "slow", "env": {"HARNESS_SIM_TIME_SCALE": "1"}}])
    inv, out = ssh_inventory(), tmp_path / "r"
    proc = start_sweep(pb, inv, out)
    try:
        assert wait_until(lambda: out.exists() and listening(port_of(pb)), 120), proc.communicate(timeout=5)
        second = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
        assert second.returncode == 1 and f"is being run by pid {proc.pid}" in second.stderr, second.stderr
        assert "(resumed)" not in second.stdout   # refused before it says it resumes (or allocates)
        assert listening(port_of(pb))                       # the first orchestrator's server untouched
        status = harness("status", out)
        assert status.returncode == 0 and f"running: pid {proc.pid}" in status.stdout, status.stdout
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    status = harness("status", out)
    assert status.returncode == 1 and "stopped before the end" in status.stdout and "lost" in status.stdout
    resumed = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert harness("status", out).returncode == 0


def test_case12_killed_at_random_points_and_resumed_gives_the_exact_result_set(tmp_path, ssh_inventory):
    configs = [{"name": f"c{i}"} for i in range(3)]
    pb = playbook(tmp_path, profile="none", configs=configs)
    inv, out = ssh_inventory(), tmp_path / "r"
    rng = random.Random(12)
    proc = start_sweep(pb, inv, out)
    proc.wait()  # a clean run first, for the set of results to expect
    expected = {k: m["status"] for k, m in manifests(out).items()}
    out2 = tmp_path / "r2"
    for kill in range(3):
        proc = start_sweep(pb, inv, out2, *(["--resume"] if kill else []), "--lease", "3")
        time.sleep(rng.uniform(1.0, 4.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    while True:  # resume until it finishes
        run = harness("sweep", pb, "-i", inv, "-o", out2, "--resume", "--lease", "3")
        if run.returncode == 0:
            break
        assert "no earlier sweep" not in run.stderr, run.stderr
    assert {k: m["status"] for k, m in manifests(out2).items()} == expected
    finished = [e["run_id"] for e in journal(out2) if e["state"] == "ok"]
    assert sorted(finished) == sorted(set(finished)) == sorted(expected)  # each run done exactly once


def test_case13_a_server_dying_mid_benchmark_fails_that_run_and_the_next_starts_clean(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, profile="none", configs=[
        {"name": "crashy", "env": {"HARNESS_SIM_FAULT": "crash_after=2"}}, {"name": "fine"}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r", "--retries", "0")
    assert run.returncode == 1
    runs = manifests(tmp_path / "r")
    assert runs["crashy-1"]["error"]["kind"] == "server_died"
    assert (sweep_dir(tmp_path / "r") / "runs" / "crashy-1" / "server.log").exists()
    assert runs["fine-1"]["status"] == "ok"


def test_case13_transient_failures_are_retried_and_the_attempts_recorded(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, profile="none", configs=[
        {"name": "crashy", "env": {"HARNESS_SIM_FAULT": "crash_after=2"}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r", "--retries", "1")
    assert run.returncode == 1
    assert manifests(tmp_path / "r")["crashy-1"]["attempts"] == 2
    assert [e.get("attempt") for e in journal(tmp_path / "r") if e["state"] == "running"] == [1, 2]


def test_case34_a_server_that_hangs_mid_benchmark_is_a_failed_run_never_ok(tmp_path, ssh_inventory):
    """A hung server once gave `ok in 135 s` with 12 of 16 requests timed out: the figures of such a
    run cannot be believed, so it fails (kind bench) with what failed, and the sweep exits 1."""
    pb = playbook(tmp_path, profile="none", configs=[{"name": "hangs", "env": {"HARNESS_SIM_FAULT": "hang_after=3"}}],
                  benchmark={"prompt": "hello", "max_tokens": 4, "concurrency": [1], "requests": 6, "warmup": 0,
                             "timeout_s": 2})
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1, run.stdout + run.stderr
    m = manifests(tmp_path / "r")["hangs-1"]
    assert (m["status"], m["error"]["kind"]) == ("failed", "bench")
    assert "concurrency 1: 3 of 6 requests failed" in m["error"]["message"]
    level, = json.loads((sweep_dir(tmp_path / "r") / "runs" / "hangs-1" / "bench.json").read_text())["levels"]
    assert (level["completed"], level["failed"]) == (3, 3)
    assert "3/6" in run.stdout     # the comparison shows it too


def test_case32_ctrl_c_during_a_retry_backoff_starts_no_new_attempt(tmp_path, ssh_inventory):
    """The backoff between attempts ends at once on Ctrl-C; the attempt after it used to start anyway,
    with a server that outlived exit 130."""
    pb = playbook(tmp_path, profile="none", configs=[{"name": "crashy", "env": {"HARNESS_SIM_FAULT": "crash_after=1"}}])
    inv, out = ssh_inventory(), tmp_path / "r"
    proc = start_sweep(pb, inv, out, "--retries", "3")
    assert wait_until(lambda: listening(port_of(pb)), 120), "attempt 1 never served"
    assert wait_until(lambda: not listening(port_of(pb)), 120), "attempt 1 never crashed"
    time.sleep(0.5)                              # its teardown, then the backoff (2 s or more) before attempt 2
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    time.sleep(3)                                # long enough for a wrongly started attempt to listen
    assert not listening(port_of(pb))
    attempts = [e.get("attempt") for e in journal(out) if e["state"] == "running"]
    assert attempts == [1], journal(out)


def test_case14_health_that_never_passes_is_a_startup_timeout_with_the_log_tail(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, profile="none", configs=[{"name": "stuck", "env": {"HARNESS_SIM_FAULT": "never_healthy"}}])
    data = yaml.safe_load(pb.read_text())
    data["server"]["startup_timeout_s"] = 3
    pb.write_text(yaml.safe_dump(data))
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1
    m = manifests(tmp_path / "r")["stuck-1"]
    assert m["error"]["kind"] == "startup_timeout" and "503" in m["error"]["message"]
    assert m["error"]["log_tail"] and "teardown" in m["phases"]
    assert not listening(port_of(pb))


def test_case16_a_port_in_use_is_named_in_preflight_and_nothing_is_launched(tmp_path, ssh_inventory):
    pb = playbook(tmp_path, profile="none", configs=[{"name": "one"}])
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port_of(pb)))
        holder.listen()
        run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1
    m = manifests(tmp_path / "r")["one-1"]
    assert m["error"]["kind"] == "preflight" and f"pid {os.getpid()}" in m["error"]["message"]
    assert "launch" not in m["phases"]


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); CI runs as root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)])


def test_case18_a_full_local_disk_accepts_nothing_half_written(tmp_path, ssh_inventory, small_disk):
    pb = playbook(tmp_path, configs=[{"name": "big", "env": {"HARNESS_SIM_TRACE_MB": "2"}}])
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", small_disk)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    root = sweep_dir(small_disk)
    assert not any(p.name.endswith(".tmp") for p in root.rglob("*"))
    states = [e["state"] for e in journal(small_disk)]
    assert "ok" not in states  # the journal never claims what the disk could not hold
    for m in root.glob("runs/*/manifest.json"):
        json.loads(m.read_text())  # whatever is there is whole


def test_case31_a_journal_line_on_a_full_disk_is_written_whole_or_not_at_all(small_disk):
    """tmpfs takes what fits of a write and stops (a short write): that part is cut off again, so the
    next line starts on a line of its own; a torn tail left by a kill is cut when the journal reopens."""
    from harness.journal import Journal, read_journal
    path = small_disk / "journal.jsonl"
    journal_ = Journal(path)
    journal_.append("a-1", "ok")
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):        # the disk fills up...
        while os.write(fd, b"x" * 4096):
            pass
    os.ftruncate(fd, max(0, os.fstat(fd).st_size - 8192))   # ...leaving 8 KB, less than the next line
    os.close(fd)
    f_size = filler.stat().st_size
    with pytest.raises(OSError):
        journal_.append("b-1", "failed", note="y" * 20000)
    assert path.read_bytes().endswith(b"\n") and [e.run_id for e in read_journal(path)] == ["a-1"]
    filler.unlink()
    journal_.append("c-1", "ok")
    assert [e.run_id for e in read_journal(path)] == ["a-1", "c-1"] and f_size > 0
    with open(path, "ab") as f:
        f.write(b'{"t": 1, "run_id": "d-1", "sta')   # a kill mid-write
    Journal(path).append("e-1", "ok")
    assert [e.run_id for e in read_journal(path)] == ["a-1", "c-1", "e-1"]


def test_case35_resuming_an_edited_playbook_is_refused_with_the_differences(tmp_path, ssh_inventory):
    """A resumed sweep must not mix two experiments: a changed input is refused, with what changed,
    unless accepted; --retry-failed runs the failed runs again; added configurations run; a removed one
    keeps its results; --resume --dry-run lists only what would run."""
    inv, out = ssh_inventory(), tmp_path / "r"
    pb = playbook(tmp_path, profile="none", configs=[
        {"name": "a"}, {"name": "b", "env": {"HARNESS_SIM_FAULT": "oom_at_start"}}])
    first = harness("sweep", pb, "-i", inv, "-o", out)
    assert first.returncode == 1 and ({k: m["status"] for k, m in manifests(out).items()}
                                      == {"a-1": "ok", "b-1": "failed"})
    a_manifest = sweep_dir(out) / "runs" / "a-1" / "manifest.json"
    a_written = a_manifest.stat().st_mtime_ns

    data = yaml.safe_load(pb.read_text())
    data["benchmark"]["max_tokens"] = 16
    pb.write_text(yaml.safe_dump(data, sort_keys=False))
    refused = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 2 and "the playbook changed" in said and "benchmark.max_tokens: 12 -> 16" in said

    data["configs"][1]["env"] = {}
    data["configs"].append({"name": "c"})
    pb.write_text(yaml.safe_dump(data, sort_keys=False))
    dry = harness("sweep", pb, "-i", inv, "-o", out, "--resume", "--retry-failed", "--accept-changes", "--dry-run")
    assert dry.returncode == 0 and "would run 2 of 3 runs: b-1, c-1" in " ".join(dry.stdout.split()), dry.stdout
    resumed = harness("sweep", pb, "-i", inv, "-o", out, "--resume", "--retry-failed", "--accept-changes")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert {k: m["status"] for k, m in manifests(out).items()} == {"a-1": "ok", "b-1": "ok", "c-1": "ok"}
    assert a_manifest.stat().st_mtime_ns == a_written                  # finished under its own inputs

    data["configs"] = data["configs"][1:]
    pb.write_text(yaml.safe_dump(data, sort_keys=False))
    again = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
    assert again.returncode == 0 and "a-1: no longer in the playbook; its results are kept" in again.stderr
    assert a_manifest.exists() and "a-1" in {r["run_id"] for r in json.loads(
        (sweep_dir(out) / "sweep.json").read_text())["runs"]}
