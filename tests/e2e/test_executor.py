"""The executor in-process, with faults on cue (tests/faulty.py): real servers of the simulated engine,
real files, the real journal; only the transport is told when to fail. Each case takes seconds, and
each has its end-to-end twin over sshd and namespace hosts (test_night.py, test_faults.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from harness.errors import Kind, RemoteError
from harness.events import Quiet
from harness.executor import Executor
from harness.hosts import HostPool
from harness.journal import read_journal
from harness.plan import load_sweep
from tests.e2e.test_sweep import FAST, _free_port
from tests.faulty import Faults, Faulty, bug, timeout
from tests.remote_venv import SGLANG_LAUNCH, make_remote_venv

pytestmark = pytest.mark.e2e

BENCH = r" --max-failed-share "
"""The benchmark client's command line (however the client is shipped to the host)."""


def sweep(tmp_path: Path, *, hosts=("a",), configs=("one",), placement="pool", venv: str = sys.prefix, **extra):
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {
        name: {"transport": "local", "venv": venv, "workdir": str(tmp_path / f"work-{name}")}
        for name in hosts}}}))
    playbook = tmp_path / "pb.yaml"
    playbook.write_text(yaml.safe_dump({
        "name": "faults", "hosts": "all", "engine": "sim", "model": {"path": "/m"}, "placement": placement,
        "server": {"port": _free_port(), "env": dict(FAST), "startup_timeout_s": 60},
        "configs": [{"name": c} for c in configs],
        "benchmark": {"prompt": "hi", "max_tokens": 4, "requests": 2, "warmup": 0}, **extra}))
    return load_sweep(playbook, inventory)


def journal(outcome) -> list[tuple[str, str, str | None]]:
    return [(e.run_id, e.state, e.host) for e in read_journal(outcome.sweep_dir / "journal.jsonl")
            if e.state != "pending"]


def test_a_transient_failure_is_tried_again_on_the_same_host(tmp_path):
    faults = Faults()
    faults.on("a", "run", r" wait --url ", error=timeout, times=1)     # the first health wait times out
    outcome = Executor(sweep(tmp_path), tmp_path / "results", jobs=1, connect=faults.connect).run()
    (m,) = outcome.manifests
    assert (m.status, m.attempts) == ("ok", 2)
    assert journal(outcome) == [("one-1", "running", "a"), ("one-1", "running", "a"), ("one-1", "ok", "a")]


def test_a_run_whose_host_is_lost_mid_run_fails_over_to_another_host(tmp_path):
    """Host a stops answering the heartbeat; once a whole lease passes it is lost, its connection is
    closed under the benchmark, and the run is given to host b."""
    faults = Faults()
    faults.on("a", "run", r"^touch -c ", times=None)                         # a's heartbeat never answers
    executor = Executor(sweep(tmp_path, hosts=("a", "b")), tmp_path / "results", jobs=1, lease_s=4,
                        connect=faults.connect)
    # a's benchmark waits until a is lost, then fails as its closed link would; a lost host cannot be
    # reached again either
    faults.on("a", "run", BENCH, after=lambda: executor.pool["a"].lost)
    faults.on("a", "connect", times=None, when=lambda: executor.pool["a"].lost)
    outcome = executor.run()
    (m,) = outcome.manifests
    assert (m.status, m.host.name) == ("ok", "b")
    assert ("one-1", "retry", "a") in journal(outcome) and journal(outcome)[-1] == ("one-1", "ok", "b")


def test_a_run_that_every_host_loses_fails_once_each_has_had_its_attempts(tmp_path):
    """Both hosts reconnect at once every time, and the link drops under the benchmark every time: the
    run moves from the host that lost it to the other one, and fails once both have lost it, rather
    than going round them all night. (The deadline only ends the sweep should it go round: then the
    run would be skipped, not failed.)"""
    import datetime as dt
    faults = Faults()
    for host in ("a", "b"):
        faults.on(host, "run", BENCH, times=None)
    executor = Executor(sweep(tmp_path, hosts=("a", "b")), tmp_path / "results", jobs=1, retries=1,
                        deadline=dt.datetime.now() + dt.timedelta(minutes=5), connect=faults.connect)
    outcome = executor.run()
    (m,) = outcome.manifests
    assert m.error is not None and (m.status, m.error.kind, m.attempts) == ("failed", "unreachable", 4)
    assert faults.count("a", "run", BENCH) == faults.count("b", "run", BENCH) == 2   # retries + 1 on each
    states = [(state, host) for _, state, host in journal(outcome)]
    assert states.count(("retry", states[0][1])) == 1 and states[-1] == ("failed", m.host.name)
    assert m.host.name != states[0][1]


def test_a_lost_run_whose_other_host_is_set_aside_before_taking_it_fails_as_its_last_attempt(tmp_path):
    """Host a loses the run every time; b, which has not lost it, cannot be reached when it takes it
    and is set aside: the run is not left as skipped, it fails with a's error and attempts."""
    import datetime as dt
    faults = Faults()
    faults.on("a", "run", BENCH, times=None)
    faults.on("b", "connect", times=None)
    executor = Executor(sweep(tmp_path, hosts=("a", "b")), tmp_path / "results", jobs=1, retries=1,
                        host_retries=0, deadline=dt.datetime.now() + dt.timedelta(minutes=5),
                        connect=faults.connect)
    (m,) = executor.run().manifests
    assert m.error is not None
    assert (m.status, m.error.kind, m.attempts, m.host.name) == ("failed", "unreachable", 2, "a")
    assert faults.count("a", "run", BENCH) == 2 and executor.pool["b"].dead


def test_a_host_that_cannot_be_reached_is_set_aside_and_its_pinned_runs_fail_with_its_error(tmp_path):
    faults = Faults()
    faults.on("a", "connect", times=None)
    sw = sweep(tmp_path, hosts=("a", "b"), configs=("x", "y"), placement="each")
    outcome = Executor(sw, tmp_path / "results", jobs=1, host_retries=0, connect=faults.connect).run()
    by_run = {m.run_id: m for m in outcome.manifests}
    assert {r: m.status for r, m in by_run.items()} == {"x-a-1": "failed", "y-a-1": "failed",
                                                        "x-b-1": "ok", "y-b-1": "ok"}
    assert by_run["x-a-1"].error is not None and by_run["x-a-1"].error.kind == "unreachable"
    assert faults.count("a", "connect") == 1                                  # dead after one try: no retries


def test_a_bug_of_ours_fails_that_run_only_and_the_sweep_goes_on(tmp_path):
    faults = Faults()
    faults.on("a", "run", BENCH, error=bug)
    outcome = Executor(sweep(tmp_path, configs=("buggy", "fine")), tmp_path / "results", jobs=1,
                       connect=faults.connect).run()
    buggy, fine = outcome.manifests
    assert buggy.error is not None and (buggy.status, buggy.error.kind, buggy.attempts) == ("failed", "internal", 1)
    assert "ZeroDivisionError: a bug of ours" in buggy.error.message
    assert (outcome.sweep_dir / "runs" / "buggy-1" / "harness-error.log").read_text().count("Traceback") == 1
    assert fine.status == "ok" and outcome.failed == [buggy]


def test_resume_runs_what_fail_fast_skipped_and_leaves_finished_runs_alone(tmp_path):
    faults = Faults()
    faults.on("a", "run", BENCH, error=bug)
    sw = sweep(tmp_path, configs=("first", "second"))
    first = Executor(sw, tmp_path / "results", jobs=1, fail_fast=True, connect=faults.connect).run()
    assert [(m.run_id, m.status) for m in first.manifests] == [("first-1", "failed"), ("second-1", "skipped")]
    again = Executor(sw, tmp_path / "results", jobs=1, resume=True, connect=Faults().connect).run()
    assert [(m.run_id, m.status) for m in again.manifests] == [("first-1", "failed"), ("second-1", "ok")]
    assert [s for r, s, _ in journal(again) if r == "first-1"] == ["running", "failed"]   # not run again


def test_fail_fast_stops_before_the_next_run_when_the_failed_one_brought_files_back(tmp_path):
    """A run that fails with files to hash (its server.log: out of memory at start) stops the sweep
    before the host takes the next run, and is journaled failed with its files hashed."""
    sw = sweep(tmp_path, configs=("first", "second"))
    sw.runs[0].config.env["HARNESS_SIM_FAULT"] = "oom_at_start"
    outcome = Executor(sw, tmp_path / "results", jobs=1, fail_fast=True, connect=Faults().connect).run()
    assert [(m.run_id, m.status) for m in outcome.manifests] == [("first-1", "failed"), ("second-1", "skipped")]
    failed = outcome.manifests[0]
    assert failed.error is not None and failed.error.kind == "oom", failed.error
    run_dir = outcome.sweep_dir / "runs" / "first-1"
    assert failed.collected.sha256["server.log"] == hashlib.sha256((run_dir / "server.log").read_bytes()).hexdigest()
    assert not failed.collected.unhashed
    assert journal(outcome) == [("first-1", "running", "a"), ("first-1", "failed", "a"), ("second-1", "skipped", None)]


def test_a_resume_without_its_journal_hashes_a_kept_run_that_stopped_before_its_hashes(tmp_path):
    """The orchestrator died between a run's manifest and its hashes, and the journal is gone too: the
    resume keeps the run its manifest says finished, and hashes its files then."""
    sw = sweep(tmp_path)
    first = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run()
    run_dir = first.sweep_dir / "runs" / "one-1"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    hashed = manifest["collected"]["sha256"]
    assert len(hashed) == manifest["collected"]["files"] >= 3
    manifest["collected"] |= {"sha256": {}, "unhashed": sorted(hashed)}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    (first.sweep_dir / "journal.jsonl").unlink()
    again = Executor(sw, tmp_path / "results", jobs=1, resume=True, connect=Faults().connect).run()
    (kept,) = again.manifests
    assert kept.collected.sha256 == hashed and not kept.collected.unhashed
    assert json.loads((run_dir / "manifest.json").read_text())["collected"]["sha256"] == hashed
    assert [s for r, s, _ in journal(again) if r == "one-1"] == ["ok"]   # kept, not run again


def test_an_unset_variable_is_recorded_apart_from_the_environment_an_older_harness_reads(tmp_path):
    """`env: {NAME: null}` is unset in the launch script and recorded in `config.unset`: `config.env`
    keeps strings only, which is all a manifest reader of an older harness accepts."""
    sw = sweep(tmp_path)
    sw.playbook.server.env["HARNESS_TEST_UNSET"] = "1"
    sw.runs[0].config.env["HARNESS_TEST_UNSET"] = None
    (m,) = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run().manifests
    assert m.status == "ok" and m.config.unset == ["HARNESS_TEST_UNSET"], (m.error, m.config)
    run_dir = tmp_path / "results" / sw.sweep_id / "runs" / "one-1"
    recorded = json.loads((run_dir / "manifest.json").read_text())
    assert all(isinstance(v, str) for v in recorded["config"]["env"].values()), recorded["config"]
    assert "unset HARNESS_TEST_UNSET" in (run_dir / "launch.sh").read_text()


def test_a_resume_without_its_journal_keeps_the_runs_their_manifests_say_finished(tmp_path):
    """journal.jsonl deleted by hand (or a disk restored without it): the runs whose manifests say ok
    or failed are kept and journaled again; before, every run's folder was emptied and run again."""
    faults = Faults()
    faults.on("a", "run", BENCH, error=bug)
    sw = sweep(tmp_path, configs=("first", "second", "third"))
    first = Executor(sw, tmp_path / "results", jobs=1, fail_fast=True, connect=faults.connect).run()
    assert [(m.run_id, m.status) for m in first.manifests] == [
        ("first-1", "failed"), ("second-1", "skipped"), ("third-1", "skipped")]
    (first.sweep_dir / "journal.jsonl").unlink()
    kept = (first.sweep_dir / "runs" / "first-1" / "manifest.json").stat().st_mtime_ns
    again = Executor(sw, tmp_path / "results", jobs=1, resume=True, connect=Faults().connect).run()
    assert [(m.run_id, m.status) for m in again.manifests] == [
        ("first-1", "failed"), ("second-1", "ok"), ("third-1", "ok")]
    assert (first.sweep_dir / "runs" / "first-1" / "manifest.json").stat().st_mtime_ns == kept
    assert [s for r, s, _ in journal(again) if r == "first-1"] == ["failed"]   # journaled again, not run


def test_a_host_whose_tools_cannot_be_installed_keeps_none_of_its_connections(tmp_path, monkeypatch):
    """Connected, then the upload of the tools timed out: each such attempt closes its connection (a
    flaky host kept one open, with its thread and socket, per attempt all night)."""
    opened, closed = [], []
    monkeypatch.setattr(Faulty, "close", lambda self: (closed.append(self), self.inner.close()))
    faults = Faults()
    faults.on("a", "run", "cat > ", error=timeout, times=None)   # the tools' upload

    def connect(spec):
        opened.append(faults.connect(spec))
        return opened[-1]
    pool = HostPool(sweep(tmp_path).hosts, connect=connect, events=Quiet(), lease_s=60, attempts=6)
    for _ in range(3):
        assert not pool.open(pool["a"]) and pool["a"].error.kind is Kind.TIMEOUT
    assert len(opened) == 3 and closed == opened


def test_a_host_left_clean_starts_no_python_to_reap_and_a_lapsed_server_is_stopped(tmp_path):
    """Connecting reaps what earlier sweeps left. Where no run folder holds a server's pid file or its
    secrets, the venv's Python is not started for it (before, every connection started one: 50 ms of
    CPU on this machine, more in a large venv). A lapsed server and a failed run's secrets are still
    found and ended."""
    from tests.e2e.test_trust import boot_id, stale_run, start_time, unrelated_job

    calls = tmp_path / "python-calls"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    sw = sweep(tmp_path, venv=str(tmp_path / "venv"))
    pool = HostPool(sw.hosts, connect=Faults().connect, events=Quiet(), lease_s=1, attempts=6)
    assert pool.open(pool["a"])
    assert not calls.exists(), calls.read_text()        # before: "... agent reap --workdir ..."
    pool.close(pool["a"])
    job = unrelated_job()   # stands in for the server of an earlier sweep whose orchestrator died
    try:
        time.sleep(0.2)     # setsid has exec'd sleep: its start time is final
        stale_run(tmp_path / "work-a", f"{job.pid} {start_time(job.pid)} {boot_id()}")
        assert pool.open(pool["a"])
        assert " agent reap " in calls.read_text()
        assert job.wait(timeout=30) is not None
        pool.close(pool["a"])
        left = tmp_path / "work-a" / "old-sweep" / "run-2"   # a run that failed with its secrets there
        left.mkdir()
        (left / ".secrets.env").write_text("API_KEY=x\n")
        (left / "lease").touch()
        os.utime(left / "lease", (1, 1))
        assert pool.open(pool["a"])
        assert not (left / ".secrets.env").exists()
    finally:
        job.kill()
        job.wait()
        pool.close(pool["a"])


def test_a_run_retried_in_a_later_sweep_brings_back_only_its_own_traces(tmp_path):
    """A failed run's folder stays on the host for whoever looks into it; `--resume --retry-failed`
    runs it there again as its first attempt of that sweep, and must not pull the old server's traces."""
    sw = sweep(tmp_path, flavor="sglang", profile={"mode": "engine", "num_steps": 2})
    faults = Faults()
    faults.on("a", "pull", error=lambda host, what: RemoteError("link dropped", host=host, kind=Kind.COLLECT),
              times=None)
    (failed,) = Executor(sw, tmp_path / "results", jobs=1, connect=faults.connect).run().manifests
    assert failed.status == "failed"
    left = next((tmp_path / "work-a").glob("faults-*/one-1/profile"))
    assert len(list(left.iterdir())) == 1       # the failed run's trace, left on the host
    again = Executor(sw, tmp_path / "results", jobs=1, resume=True, retry_failed=True,
                     connect=Faults().connect).run()
    (m,) = again.manifests
    assert m.status == "ok" and m.profile is not None and m.profile.status == "ok"
    assert len(m.profile.files) == m.profile.expected_ranks == 1, m.profile.files


def test_a_flag_listing_that_failed_is_not_kept_for_the_hosts_later_runs(tmp_path):
    """The engine's import broke for a moment while its flags were listed: that run fails naming it,
    and once the host is fixed `--resume --retry-failed` lists again instead of reading the failure."""
    venv = make_remote_venv(tmp_path / "venv", engines=("sglang",))
    broken = tmp_path / "broken"
    broken.touch()
    (venv / "shims" / "sglang" / "launch_server.py").write_text(
        f"import os, sys\nif '--help' in sys.argv and os.path.exists({str(broken)!r}):\n"
        "    raise ImportError('libcuda.so.1: cannot open shared object file')\n" + SGLANG_LAUNCH)
    sw = sweep(tmp_path, venv=str(venv), engine="sglang")
    (first,) = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run().manifests
    assert first.error is not None and first.error.kind == "preflight" and "listed no flags" in first.error.message
    broken.unlink()
    (again,) = Executor(sw, tmp_path / "results", jobs=1, resume=True, retry_failed=True,
                        connect=Faults().connect).run().manifests
    assert again.status == "ok", again.error


@pytest.mark.parametrize("last", ["running", "interrupted"])
def test_a_run_that_had_finished_and_waited_for_its_analysis_is_kept_after_a_kill(tmp_path, last):
    """The orchestrator died while a finished run's files waited for their hashes and its traces for
    their analysis (both come once the host is free): its manifest says ok, its journal still says
    running (or interrupted: Ctrl-C came as it ended, and the process was gone before its journal
    line). A resume keeps it (its results are not removed, the run not redone), hashes its files and
    analyses its traces now."""
    sw = sweep(tmp_path, flavor="sglang", profile={"mode": "engine", "num_steps": 2})
    first = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run()
    (done,) = first.manifests
    run_dir = first.sweep_dir / "runs" / "one-1"
    assert done.status == "ok" and (run_dir / "analysis.json").exists()
    (run_dir / "analysis.json").unlink()   # as it was before the analysis ran
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["profile"]["analysis"] = None
    hashed = manifest["collected"]["sha256"]
    assert len(hashed) == manifest["collected"]["files"] >= 3 and not manifest["collected"]["unhashed"]
    manifest["collected"] |= {"sha256": {}, "unhashed": sorted(hashed)}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    with (first.sweep_dir / "journal.jsonl").open("a") as journal_file:   # the kill came before "ok"
        journal_file.write(json.dumps({"t": 1.0, "run_id": "one-1", "state": last, "host": "a",
                                       "attempt": 1}) + "\n")
    started = (run_dir / "bench.json").stat().st_mtime_ns
    again = Executor(sw, tmp_path / "results", jobs=1, resume=True, connect=Faults().connect).run()
    (kept,) = again.manifests
    assert kept.status == "ok" and kept.profile is not None and kept.profile.analysis is not None
    assert kept.collected.sha256 == hashed and not kept.collected.unhashed
    assert json.loads((run_dir / "manifest.json").read_text())["collected"]["sha256"] == hashed
    assert (run_dir / "analysis.json").exists() and (run_dir / "bench.json").stat().st_mtime_ns == started
    assert [s for r, s, _ in journal(again) if r == "one-1"] == ["running", "ok", last, "ok"]


def test_a_profile_over_its_cap_fails_alone_and_the_run_keeps_its_benchmark(tmp_path):
    """`profile.max_mb` refuses traces larger than it: the run stays ok with its benchmark, log and
    facts brought back, the profile fails saying why, and nothing is run again."""
    sw = sweep(tmp_path, flavor="sglang", profile={"mode": "engine", "num_steps": 2, "max_mb": 1})
    sw.playbook.server.env["HARNESS_SIM_TRACE_MB"] = "2"
    outcome = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run()
    (m,) = outcome.manifests
    assert (m.status, m.attempts) == ("ok", 1), m.error
    assert m.profile is not None and m.profile.status == "failed" and "max_bytes" in (m.profile.error or "")
    assert "profile.max_mb" in (m.profile.hint or "")
    run_dir = outcome.sweep_dir / "runs" / "one-1"
    assert (run_dir / "bench.json").exists() and (run_dir / "server.log").exists()
    assert not list((run_dir / "profile").glob("*")) if (run_dir / "profile").exists() else True
    assert [s for r, s, _ in journal(outcome) if r == "one-1"] == ["running", "ok"]


def test_a_host_that_fails_the_preflight_is_set_aside_and_its_run_goes_to_another(tmp_path):
    """Host b has no venv: the first run it takes goes back to the queue, b takes nothing more, and
    host a runs all four (b failed three of them in no time, while a waited)."""
    sw = sweep(tmp_path, hosts=("a", "b"), configs=("one", "two", "three", "four"))
    sw.hosts[1] = sw.hosts[1].model_copy(update={"venv": str(tmp_path / "no-venv")})
    sw.runs = [dataclasses.replace(r, hosts=tuple(sw.hosts)) for r in sw.runs]
    outcome = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run()
    assert sorted((m.run_id, m.status, m.host.name) for m in outcome.manifests) == [
        (f"{c}-1", "ok", "a") for c in sorted(("one", "two", "three", "four"))]
    on_b = [e for e in journal(outcome) if e[2] == "b"]   # whichever run b took first, if it took one
    assert not on_b or on_b == [(on_b[0][0], "running", "b"), (on_b[0][0], "retry", "b")]


def test_runs_only_a_set_aside_host_could_take_fail_with_its_error(tmp_path):
    sw = sweep(tmp_path, configs=("one", "two"), venv=str(tmp_path / "no-venv"))
    outcome = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect).run()
    assert [(m.run_id, m.status, m.error and m.error.kind) for m in outcome.manifests] == [
        ("one-1", "failed", "preflight"), ("two-1", "failed", "preflight")]
    assert all("does not exist on a" in (m.error.message if m.error else "") for m in outcome.manifests)
    assert [s for r, s, _ in journal(outcome) if r == "two-1"] == ["failed"]   # not tried: a was set aside


def test_a_host_that_fails_a_runs_other_node_preflight_is_set_aside_too(tmp_path):
    """Runs on two hosts, a and b; b has no venv. Whichever node b is in the first run, it is set
    aside: the second run is never tried on it, and both fail with b's error (a alone cannot hold
    them). Before, b as the other node failed the first run and then took and failed the second."""
    sw = sweep(tmp_path, hosts=("a", "b"), configs=("one", "two"))
    sw.hosts[1] = sw.hosts[1].model_copy(update={"venv": str(tmp_path / "no-venv")})
    sw.runs = [dataclasses.replace(r, hosts=tuple(sw.hosts), nodes=2) for r in sw.runs]
    executor = Executor(sw, tmp_path / "results", jobs=1, connect=Faults().connect)
    outcome = executor.run()
    assert [(m.run_id, m.status, m.error and m.error.kind) for m in outcome.manifests] == [
        ("one-1", "failed", "preflight"), ("two-1", "failed", "preflight")]
    assert all("does not exist on b" in (m.error.message if m.error else "") for m in outcome.manifests)
    assert executor.pool["b"].dead and not executor.pool["a"].dead
    assert [s for r, s, _ in journal(outcome) if r == "two-1"] == ["failed"]   # b was set aside by then


def test_a_local_disk_without_room_stops_the_sweep_and_is_no_bug_of_ours(tmp_path):
    """The local disk refuses the run's files mid-pull (ENOSPC, as the pull passes it on): the sweep
    stops, naming the disk, and the run stays in flight for `--resume`. Before, it was recorded as the
    harness's own bug (`internal`, a traceback to report) and the next run started on the full disk."""
    import errno

    def no_room(host: str, what: str) -> Exception:
        return OSError(errno.ENOSPC, "No space left on device", what)

    faults = Faults()
    faults.on("a", "pull", error=no_room)
    outcome = Executor(sweep(tmp_path, configs=("one", "two")), tmp_path / "results", jobs=1,
                       connect=faults.connect).run()
    assert outcome.fatal is not None and "No space left on device" in outcome.fatal
    assert [(m.run_id, m.status) for m in outcome.manifests] == [("two-1", "skipped")]   # never started
    assert not list((tmp_path / "results").rglob("harness-error.log"))
    states = [(r, s) for r, s, _ in journal(outcome)]
    assert states == [("one-1", "running"), ("two-1", "skipped")]


def test_a_run_in_its_preflight_at_ctrl_c_launches_no_server_after_it(tmp_path):
    """The interrupt stops the servers of the runs in flight once; a run still in its preflight then
    must not launch one after it (it outlived the exit until its lease lapsed)."""
    import socket

    from harness.transport.local import LocalTransport

    executor: Executor

    class InterruptedInPreflight(Faulty):
        def run(self, command, **kw):
            if " probe " in command:   # Ctrl-C while the host probes: what the main thread does then
                executor._interrupt()
            return super().run(command, **kw)

    sw = sweep(tmp_path)
    executor = Executor(sw, tmp_path / "results", jobs=1, lease_s=30,
                        connect=lambda spec: InterruptedInPreflight(LocalTransport(spec), Faults()))
    outcome = executor.run()
    assert outcome.interrupted
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", sw.playbook.server.port)) != 0, "a server started after the interrupt"
    # before: ["running", "interrupted", "ok"], the whole run (its server launched) after the interrupt
    assert [s for r, s, _ in journal(outcome) if r == "one-1"] == ["running", "interrupted"]


def test_a_profiled_run_is_told_and_its_host_shown_free_once_the_host_is_free(tmp_path, monkeypatch):
    """A profiled run's traces are analysed after its host is free, while the host runs the next run.
    The run's result (read from its benchmark, which is in) is told to the source that decides the
    runs (a search) before the source is asked for the next one, and the live display, told the run is
    done once its analysis is, keeps showing the host on the run it is on now. (The first run's
    analysis waits for the next run's first phase, which waits for the first run to be done.)"""
    import harness.executor
    from harness.report.live import Display

    sw = sweep(tmp_path, flavor="sglang", profile={"mode": "engine", "num_steps": 2}, configs=("one", "two"))
    later = sw.runs.pop()
    second_started = threading.Event()
    real_finish = harness.executor.finish

    def finish(layout, manifest):   # the analysis waits until the host is on its next run
        assert second_started.wait(120), "the next run never started"
        return real_finish(layout, manifest)
    monkeypatch.setattr(harness.executor, "finish", finish)

    class Source:
        total = 2

        def __init__(self):
            self.told: list[str] = []
            self.asked_with: list[list[str]] = []
            self.given = [later]

        def next(self):
            self.asked_with.append(list(self.told))
            return self.given.pop() if self.given else None

        def ended(self, manifest):
            self.told.append(manifest.run_id)

        def close(self, *, interrupted):
            pass

    first_done = threading.Event()

    class Watched(Display):
        shown_at_done: list[tuple[str, str]] = []

        def phase(self, host, run_id, phase):
            super().phase(host, run_id, phase)
            if run_id == later.run_id and not second_started.is_set():
                second_started.set()
                assert first_done.wait(120), "the first run was never done"   # the next run waits in its phase

        def done(self, manifest):
            super().done(manifest)
            self.shown_at_done.append((manifest.run_id, self.hosts["a"][0]))
            first_done.set()

    source, display = Source(), Watched(None)
    outcome = Executor(sw, tmp_path / "results", jobs=1, events=display, source=source,
                       connect=Faults().connect).run()
    assert [(m.run_id, m.status) for m in outcome.manifests] == [("one-1", "ok"), ("two-1", "ok")]
    assert all(m.profile is not None and m.profile.analysis is not None for m in outcome.manifests)
    assert source.asked_with[0] == ["one-1"]     # told before the next was asked
    assert source.told == ["one-1", "two-1"]     # each once
    assert display.shown_at_done == [("one-1", "two-1"), ("two-1", "")]
