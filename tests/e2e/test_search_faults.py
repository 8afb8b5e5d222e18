"""`search.optuna` end to end, where a night goes wrong: the real `harness` command, sshd on loopback,
the simulated engine in the remote venv. A search none of whose trials can have a value is refused
before any host (exit 2), and one that ends with no value fails (exit 1) saying so; neither ends as
if it had found something."""

from __future__ import annotations

import json

import pytest

from tests.conftest import harness
from tests.e2e.test_search import playbook
from tests.e2e.test_sweep import manifests, sweep_dir

pytestmark = pytest.mark.e2e


def test_a_search_at_a_level_no_trial_measures_is_refused_before_any_host(tmp_path, ssh_inventory):
    """The benchmark measures concurrency 1 and 4, the objective is read at 64: every trial would run
    a server and be told failed. It ran, and the sweep exited 0 with no best."""
    pb = playbook(tmp_path, {"space": {"args.tp-size": [1, 2]}, "budget": 2, "level": 64})
    inv = ssh_inventory()
    for command in (["sweep", pb, "-i", inv, "-o", tmp_path / "r"], ["sweep", pb, "-i", inv, "-o", tmp_path / "r",
                                                                    "--dry-run"], ["plan", pb, "-i", inv]):
        run = harness(*command)
        assert run.returncode == 2, run.stdout + run.stderr
        said = " ".join(run.stderr.split())
        assert f"{pb}:" in said and "search.optuna.level: concurrency 64: no trial measures it" in said, said
        assert "Traceback" not in run.stderr
    assert not (tmp_path / "remote-work").exists() and not (tmp_path / "r").exists()


def test_a_search_whose_runs_went_well_but_measured_no_objective_fails_saying_so(tmp_path, ssh_inventory):
    """One output token a request: every run is ok, none has an ITL, so no trial has a value. The
    sweep said nothing of it and exited 0; the search found nothing."""
    pb = playbook(tmp_path, {"space": {"args.tp-size": [1, 2]}, "budget": 2, "objective": "itl_ms_p50",
                             "random_state": 1})
    data = pb.read_text().replace("max_tokens: 12", "max_tokens: 1")
    pb.write_text(data)
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", tmp_path / "r")
    assert run.returncode == 1, run.stdout + run.stderr
    assert all(m["status"] == "ok" for m in manifests(tmp_path / "r").values())   # the runs stand, as measured
    found = json.loads((sweep_dir(tmp_path / "r") / "search.json").read_text())
    assert found["best"] is None and found["stopped"] is not None
    assert {t["state"] for t in found["trials"]} <= {"failed", "duplicate"}
    assert "itl_ms_p50 was not measured" in found["trials"][0]["reason"]
    said = " ".join(run.stderr.split())
    assert "error: the search found no value of itl_ms_p50: every trial failed" in said, said
    assert "no best" in run.stdout and "no trial has a value yet" not in run.stdout


def test_resume_dry_run_of_a_search_that_is_done_says_no_trial_comes(tmp_path, ssh_inventory):
    """`--resume --dry-run` of a search whose budget is spent said "then new trials until the budget of
    2 runs (2 asked so far)": none would come."""
    pb = playbook(tmp_path, {"space": {"args.tp-size": [1, 2, 4]}, "budget": 2, "random_state": 1})
    inv = ssh_inventory()
    assert harness("sweep", pb, "-i", inv, "-o", tmp_path / "r").returncode == 0
    before = (sweep_dir(tmp_path / "r") / "search.json").read_text()
    shown = harness("sweep", pb, "-i", inv, "-o", tmp_path / "r", "--resume", "--dry-run")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    said = " ".join(shown.stdout.split())
    assert "would run 0 of 2 runs: none" in said and "and no new trial: the budget of 2 runs is spent" in said
    assert "then new trials" not in said
    assert (sweep_dir(tmp_path / "r") / "search.json").read_text() == before   # a dry run writes nothing
