"""`search.optuna` end to end: the real `harness` command, sshd on loopback (and hosts in network
namespaces for trials in parallel), the simulated engine in the remote venv, the study in SQLite.

A search is a sweep whose runs Optuna's TPE chooses one by one; these check what a user relies on:
every trial is an ordinary run, a failed run is told to the study as failed, a finite space ends
once every point has run, the best trial and its launch command are shown at the end, in compare and
in the report, and a sweep killed midway continues the same study on `--resume`.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import optuna
import pytest
import yaml

from tests.conftest import harness
from tests.e2e.test_faults import journal, start_sweep, wait_until
from tests.e2e.test_sweep import FAST, _free_port, manifests, sweep_dir
from tests.netns import netns_hosts

pytestmark = pytest.mark.e2e


def playbook(tmp_path: Path, search: dict, *, hosts="node1", env=None, port=None) -> Path:
    pb = {
        "name": "e2e-search", "hosts": hosts, "engine": "sim", "flavor": "sglang",
        "model": {"path": "/models/tiny", "served_name": "tiny"},
        "server": {"port": port or _free_port(), "env": {**FAST, **(env or {})}, "startup_timeout_s": 60},
        "benchmark": {"prompt": "hello there", "max_tokens": 12, "concurrency": [1, 4], "requests": 4,
                      "warmup": 1, "timeout_s": 60},
        "search": {"optuna": search},
    }
    path = tmp_path / "playbook.yaml"
    path.write_text(yaml.safe_dump(pb, sort_keys=False))
    return path


def study(root: Path) -> optuna.Study:
    return optuna.load_study(study_name=root.name, storage=f"sqlite:///{root / 'study.db'}")


def bench_tok_s(root: Path, run_id: str) -> float:
    levels = json.loads((root / "runs" / run_id / "bench.json").read_text())["levels"]
    return max(levels, key=lambda lv: lv["concurrency"])["output_tok_s"]


def test_a_search_runs_each_trial_as_a_run_tells_failures_as_failed_and_ends_with_the_space(tmp_path, ssh_inventory):
    """tp-size x a fault that stops the server at start: 4 points, a budget of 6. All 4 run (a point
    proposed again is not run again), the two that fail are failed trials, never values."""
    pb = playbook(tmp_path, {"space": {"args.tp-size": [1, 8], "env.HARNESS_SIM_FAULT": ["", "oom_at_start"]},
                             "budget": 6, "random_state": 7, "startup_trials": 2})
    results = tmp_path / "results"
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", results)
    assert run.returncode == 1, run.stdout + run.stderr     # two runs failed: the sweep says so
    root = sweep_dir(results)
    runs = manifests(results)
    assert set(runs) == {"tp-size-1_HARNESS_SIM_FAULT-1", "tp-size-8_HARNESS_SIM_FAULT-1",
                         "tp-size-1_HARNESS_SIM_FAULT-oom_at_start-1", "tp-size-8_HARNESS_SIM_FAULT-oom_at_start-1"}
    assert {r: m["status"] for r, m in runs.items() if "oom" in r} == {
        "tp-size-1_HARNESS_SIM_FAULT-oom_at_start-1": "failed", "tp-size-8_HARNESS_SIM_FAULT-oom_at_start-1": "failed"}
    assert runs["tp-size-8_HARNESS_SIM_FAULT-1"]["config"]["args"]["tp-size"] == 8

    found = json.loads((root / "search.json").read_text())
    assert found["schema"] == "harness.search/1" and found["runs"] == 4
    assert found["stopped"] == "every point of the space (4) has run"
    ran = {t["run_id"]: t for t in found["trials"] if t["state"] != "duplicate"}
    assert set(ran) == set(runs)
    for run_id, trial in ran.items():
        if "oom" in run_id:
            assert trial["state"] == "failed" and trial["value"] is None and "oom" in trial["reason"]
        else:
            assert trial["state"] == "complete" and trial["value"] == bench_tok_s(root, run_id)
    best = max((t for t in ran.values() if t["value"] is not None), key=lambda t: t["value"])
    assert found["best"]["run_id"] == best["run_id"]

    told = {t.user_attrs["run_id"]: t for t in study(root).trials if "duplicate_of" not in t.user_attrs}
    assert {r: t.state.name for r, t in told.items()} == {
        r: "FAIL" if "oom" in r else "COMPLETE" for r in runs}
    assert all(t.value == ran[r]["value"] for r, t in told.items() if t.state.name == "COMPLETE")

    assert f"best: trial {best['number']}, {best['config']}" in " ".join(run.stdout.split())
    launch = next(line for line in run.stdout.splitlines() if line.startswith("launch: ")
                  and "--tp-size" in line and line == run.stdout.splitlines()[-2])
    assert f"--tp-size {best['params']['args.tp-size']}" in launch

    compared = harness("compare", root)
    assert f"best: trial {best['number']}" in " ".join(compared.stdout.split()), compared.stdout
    rows = json.loads(harness("compare", root, "--format", "json").stdout)
    assert {r["config"]: r.get("objective") for r in rows if r["concurrency"] == 4} == {
        t["config"]: t["value"] for t in ran.values() if t["value"] is not None}
    page = tmp_path / "report.html"
    assert harness("report", root, "-o", page).returncode == 0
    html = page.read_text()
    assert "Search" in html and best["config"] in html and "every point of the space (4) has run" in html


def test_a_trial_reproduces_as_its_one_run(tmp_path, ssh_inventory):
    """A trial's run folder holds a playbook of that one point: reproducing it runs the trial's config
    once, and starts no search of its own."""
    inv = ssh_inventory()
    pb = playbook(tmp_path, {"space": {"args.tp-size": [2, 4]}, "budget": 1, "random_state": 3})
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    ((run_id, original),) = manifests(tmp_path / "r").items()
    assert original["playbook"].get("search") is None

    run = harness("reproduce", sweep_dir(tmp_path / "r") / "runs" / run_id, "-i", inv, "-o", tmp_path / "r2")
    assert run.returncode == 0, run.stdout + run.stderr
    (again,) = manifests(tmp_path / "r2").values()
    assert again["status"] == "ok" and again["config"]["args"] == original["config"]["args"]
    assert not (sweep_dir(tmp_path / "r2") / "search.json").exists()
    assert "ITL p50 ms" in run.stdout

    # an older harness recorded the trial's playbook with the search in it: still the one run
    recorded = sweep_dir(tmp_path / "r") / "runs" / run_id / "manifest.json"
    older = json.loads(recorded.read_text())
    older["playbook"]["search"] = yaml.safe_load(pb.read_text())["search"]
    recorded.write_text(json.dumps(older))
    run = harness("reproduce", recorded.parent, "-i", inv, "-o", tmp_path / "r3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert [m["config"]["args"] for m in manifests(tmp_path / "r3").values()] == [original["config"]["args"]]


def test_a_killed_search_resumes_the_same_study_and_runs_nothing_twice(tmp_path, ssh_inventory):
    """SIGKILL while the third trial runs: `--resume` keeps the told trials, runs the one in flight
    again under its own trial number, and asks new trials until the budget is spent."""
    pb = playbook(tmp_path, {"space": {"args.tp-size": [1, 2, 4, 8], "args.kv-cache-dtype": ["fp8_e4m3", "bf16"],
                                       "args.enable-mscclpp": [True, False]},
                             "budget": 5, "random_state": 11, "startup_trials": 3},
                  env={"HARNESS_SIM_TIME_SCALE": "0.1"})
    inv, out = ssh_inventory(), tmp_path / "r"
    proc = start_sweep(pb, inv, out)

    def third_running() -> bool:
        try:
            found = json.loads((sweep_dir(out) / "search.json").read_text())
        except (OSError, ValueError):
            return False
        return [t["state"] for t in found["trials"] if t["state"] != "duplicate"][:3] == [
            "complete", "complete", "running"]
    try:
        assert wait_until(third_running, timeout=240), proc.poll()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    root = sweep_dir(out)
    before = json.loads((root / "search.json").read_text())
    told = {t["number"]: t for t in before["trials"] if t["state"] == "complete"}
    in_flight = next(t for t in before["trials"] if t["state"] == "running")
    started = {t["run_id"]: json.loads((root / "runs" / t["run_id"] / "manifest.json").read_text())["started"]
               for t in told.values()}

    resumed = harness("sweep", pb, "-i", inv, "-o", out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    after = json.loads((root / "search.json").read_text())
    by_number = {t["number"]: t for t in after["trials"]}
    for number, trial in told.items():   # told before the kill: kept, not run again
        assert by_number[number]["value"] == trial["value"]
        run_id = trial["run_id"]
        assert json.loads((root / "runs" / run_id / "manifest.json").read_text())["started"] == started[run_id]
    assert by_number[in_flight["number"]]["run_id"] == in_flight["run_id"]
    assert by_number[in_flight["number"]]["state"] == "complete"
    assert after["runs"] == 5 and after["stopped"] == "the budget of 5 runs is spent"
    assert len(manifests(out)) == 5 and all(m["status"] == "ok" for m in manifests(out).values())
    assert len(study(root).trials) == len(after["trials"])   # one study, continued
    runs_started = [e["run_id"] for e in journal(out) if e["state"] == "running"]
    assert all(runs_started.count(t["run_id"]) == 1 for t in told.values())
    # the one in flight ran again, unless the kill came between its end and its tell: then it was told
    # from its run folder on resume (either way once in the study, under its own number)
    again = runs_started.count(in_flight["run_id"])
    assert again in (1, 2) and len(runs_started) == 4 + again


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with netns_hosts(2, tmp_path_factory.mktemp("search-hosts")) as made:
        yield made


def test_trials_run_in_parallel_one_per_free_host(tmp_path, two_hosts, remote_venv):
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"gpu": {"vars": {"venv": str(remote_venv)}, "hosts": {
        h.name: {"address": h.address, "port": h.sshd.port, "user": h.sshd.user,
                 "identity_file": str(h.sshd.client_key), "known_hosts": str(h.sshd.known_hosts),
                 "workdir": str(h.workdir)} for h in two_hosts}}}}}))
    pb = playbook(tmp_path, {"space": {"args.tp-size": [1, 2, 4, 8], "args.kv-cache-dtype": ["fp8_e4m3", "bf16"]},
                             "budget": 4, "random_state": 5, "startup_trials": 2}, hosts="gpu", port=30556)
    run = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r")
    assert run.returncode == 0, run.stdout + run.stderr
    events = journal(tmp_path / "r")
    assert {e["host"] for e in events if e["state"] == "running"} == {h.name for h in two_hosts}
    first_end = next(i for i, e in enumerate(events) if e["state"] == "ok")
    assert sum(e["state"] == "running" for e in events[:first_end]) == 2   # both asked before any was told
    assert len(manifests(tmp_path / "r")) == 4
