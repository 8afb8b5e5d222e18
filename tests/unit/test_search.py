"""`search.optuna`: the space as written (choices and ranges), every mistake named with its key and line
before any host, a trial's values -> its configuration and run, Optuna's distributions, the objective
read from a run folder, and the plan that shows a search without running it."""

from __future__ import annotations

import json

import pytest

from harness.config import space
from harness.errors import InputError
from harness.plan import load_sweep, search_run
from harness.results import SweepLayout, write_json, write_model
from harness.results.models import RunManifest
from tests.conftest import harness

INVENTORY = "all:\n  hosts:\n    localhost: {transport: local, venv: /opt/venv}\n"

PLAYBOOK = """\
name: tpe
hosts: localhost
engine: vllm
model: {path: /models/m}
benchmark: {concurrency: [1, 8], max_tokens: 32}
configs:
  - {name: base, args: {max-model-len: 4096}, env: {VLLM_X: "1"}}
search:
  optuna:
    space:
      args.tensor-parallel-size: [1, 2, 4]
      args.enforce-eager: [true, false]
      args.max-num-seqs: {low: 16, high: 256, step: 16}
      args.gpu-memory-utilization: {low: 0.7, high: 0.95}
      env.NCCL_ALGO: [Ring, Tree]
      benchmark.concurrency: [8, 64]
    budget: 20
    patience: 5
    random_state: 3
"""


def write(tmp_path, playbook: str = PLAYBOOK):
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    (tmp_path / "pb.yaml").write_text(playbook)
    return tmp_path / "pb.yaml", tmp_path / "inventory.yaml"


def load(tmp_path, playbook: str = PLAYBOOK):
    return load_sweep(*write(tmp_path, playbook))


def test_the_space_parses_choices_and_ranges_of_integers_and_floats(tmp_path):
    settings = load(tmp_path).playbook.optuna
    assert settings is not None
    entries = settings.space
    assert entries["args.tensor-parallel-size"] == [1, 2, 4]
    seqs, mem = entries["args.max-num-seqs"], entries["args.gpu-memory-utilization"]
    assert isinstance(seqs, space.Range) and seqs.integers and seqs.size == 16
    assert isinstance(mem, space.Range) and not mem.integers and mem.size is None
    assert space.size(entries) is None   # a float range without a step: no grid
    assert settings.maximize and settings.objective == "output_tok_s"
    assert space.size({"args.a": [1, 2, 3], "args.b": space.entry({"low": 0.5, "high": 1.0, "step": 0.25})}) == 9


def test_a_range_value_is_what_the_run_uses_and_its_name_says():
    stepped = space.entry({"low": 0.5, "high": 1.0, "step": 0.1})
    assert isinstance(stepped, space.Range)
    assert stepped.value(0.7000000001) == 0.7
    free = space.entry({"low": 0.5, "high": 1.0})
    assert isinstance(free, space.Range) and free.value(0.83119472) == 0.8312
    ints = space.entry({"low": 1, "high": 64, "log": True})
    assert isinstance(ints, space.Range) and ints.integers and ints.value(17) == 17


def test_a_trial_becomes_a_configuration_named_by_its_values_over_the_playbooks_one(tmp_path):
    sweep = load(tmp_path)
    point = {"args.tensor-parallel-size": 2, "args.enforce-eager": False, "args.max-num-seqs": 64,
             "args.gpu-memory-utilization": 0.85, "env.NCCL_ALGO": "Tree", "benchmark.concurrency": 64}
    run = search_run(sweep, point)
    assert run.run_id == ("base_tensor-parallel-size-2_no-enforce-eager_max-num-seqs-64_"
                          "gpu-memory-utilization-0.85_NCCL_ALGO-Tree_concurrency-64-1")
    assert run.config.args == {"max-model-len": 4096, "tensor-parallel-size": 2, "enforce-eager": False,
                               "max-num-seqs": 64, "gpu-memory-utilization": 0.85}
    assert run.config.env == {"VLLM_X": "1", "NCCL_ALGO": "Tree"}
    assert run.benchmark.concurrency == [64] and run.benchmark.max_tokens == 32
    assert run.repeat == 1 and [h.name for h in run.hosts] == ["localhost"]
    script = sweep.render(run, run.hosts[0]).script
    assert "--tensor-parallel-size 2" in script and "--gpu-memory-utilization 0.85" in script
    assert "--enforce-eager" not in script and "NCCL_ALGO=Tree" in script


def test_a_search_has_no_runs_before_it_starts_and_renders_its_first_point(tmp_path):
    sweep = load(tmp_path)
    assert sweep.runs == []
    first = search_run(sweep, space.first_point(sweep.playbook.optuna.space))
    assert first.config.args["tensor-parallel-size"] == 1 and first.config.args["max-num-seqs"] == 16


@pytest.mark.parametrize("entry, key, message", [
    ("args.max-num-seqs: {low: 256, high: 16}", "search.optuna.space.args.max-num-seqs", "must be below high"),
    ("args.max-num-seqs: {low: 16, high: 250, step: 16}", "search.optuna.space.args.max-num-seqs",
     "not a multiple of step"),
    ("args.max-num-seqs: {low: 0, high: 16, log: true}", "search.optuna.space.args.max-num-seqs",
     "log range needs low above 0"),
    ("args.max-num-seqs: {low: 1, high: 16, log: true, step: 2}", "search.optuna.space.args.max-num-seqs",
     "step or log, not both"),
    ("args.max-num-seqs: {low: 1, hi: 16}", "search.optuna.space.args.max-num-seqs", "hi: unknown key"),
    ("args.max-num-seqs: {low: yes, high: 16}", "search.optuna.space.args.max-num-seqs", "low is a number"),
    ("args.max-num-seqs: []", "search.optuna.space.args.max-num-seqs", "needs at least one"),
    ("args.max-num-seqs: [1, 1]", "search.optuna.space.args.max-num-seqs", "appears twice"),
    ("args.max-num-seqs: [[1, 2]]", "search.optuna.space.args.max-num-seqs", "a choice is a number"),
    ("args.max-num-seqs: 16", "search.optuna.space.args.max-num-seqs", "list of choices or a range"),
    ("flags.max-num-seqs: [1]", "search.optuna.space.flags.max-num-seqs", "args.FLAG, env.NAME"),
    ("benchmark.warmup: [-1, 8]", "search.optuna.space", "benchmark.warmup: -1: Input should be greater than"),
    ("benchmark.colour: [1]", "search.optuna.space.benchmark.colour", "no field 'colour'"),
])
def test_a_bad_space_entry_names_its_key_and_line(tmp_path, entry, key, message):
    bad = PLAYBOOK.replace("      args.max-num-seqs: {low: 16, high: 256, step: 16}\n", "").replace(
        "      env.NCCL_ALGO: [Ring, Tree]\n", f"      {entry}\n")   # in place of the good one: no key twice
    with pytest.raises(InputError) as e:
        load(tmp_path, bad)
    assert e.value.key is not None and e.value.key.startswith(key), e.value
    assert message in str(e.value)
    assert e.value.line == bad.splitlines().index(f"      {entry}") + 1 or key == "search.optuna.space"


def test_a_secret_is_not_searched(tmp_path):
    bad = PLAYBOOK.replace("      env.NCCL_ALGO: [Ring, Tree]\n", "      env.HF_TOKEN: [a, b]\n")
    with pytest.raises(InputError) as e:
        load(tmp_path, bad)
    assert e.value.key == "search.optuna.space.env.HF_TOKEN" and "secret" in str(e.value)
    assert e.value.line == bad.splitlines().index("      env.HF_TOKEN: [a, b]") + 1


@pytest.mark.parametrize("change, key, message", [
    (("    budget: 20\n", "    budget: 0\n"), "search.optuna.budget", "greater than or equal to 1"),
    (("    patience: 5\n", "    objective: tokens\n"), "search.optuna.objective", "unknown objective 'tokens'"),
    (("    patience: 5\n", "    direction: up\n"), "search.optuna.direction", "'maximize' or 'minimize'"),
    (("    patience: 5\n", "    sampler: grid\n"), "search.optuna.sampler", "unknown key"),
])
def test_bad_search_settings_name_their_key_and_line(tmp_path, change, key, message):
    bad = PLAYBOOK.replace(*change)
    with pytest.raises(InputError) as e:
        load(tmp_path, bad)
    assert e.value.key == key and message in str(e.value), e.value
    assert e.value.line == bad.splitlines().index(change[1].rstrip("\n")) + 1


@pytest.mark.parametrize("extra, message", [
    ("repeat: 3\n", "leave repeat at 1"),
    ("matrix: {axes: {args.x: [1, 2]}}\n", "instead of a matrix"),
    ("placement: each\n", "placement at pool"),
])
def test_what_a_search_cannot_combine_with_is_refused(tmp_path, extra, message):
    with pytest.raises(InputError, match=message) as e:
        load(tmp_path, extra + PLAYBOOK)
    assert e.value.key == "search" and e.value.line == (extra + PLAYBOOK).splitlines().index("search:") + 1


def test_a_latency_objective_is_minimized_unless_told_otherwise(tmp_path):
    pb = load(tmp_path, PLAYBOOK.replace("    patience: 5\n", "    objective: itl_ms_p50\n")).playbook
    assert pb.optuna is not None and not pb.optuna.maximize
    pb = load(tmp_path, PLAYBOOK.replace("    patience: 5\n", "    objective: itl_ms_p50\n    direction: maximize\n"))
    assert pb.playbook.optuna is not None and pb.playbook.optuna.maximize


def test_a_search_needs_no_configs(tmp_path):
    bare = PLAYBOOK.replace('configs:\n  - {name: base, args: {max-model-len: 4096}, env: {VLLM_X: "1"}}\n', "")
    sweep = load(tmp_path, bare)
    run = search_run(sweep, {"args.tensor-parallel-size": 4})
    assert run.run_id == "tensor-parallel-size-4-1" and run.config.args == {"tensor-parallel-size": 4}


def test_the_grid_of_a_finite_space_is_every_point():
    entries = {"args.a": space.entry([1, 2]), "args.b": space.entry({"low": 0.5, "high": 1.0, "step": 0.25})}
    assert space.grid(entries) == [{"args.a": a, "args.b": b} for a in (1, 2) for b in (0.5, 0.75, 1.0)]


def test_each_entry_is_the_optuna_distribution_it_says():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    from harness.search import distribution
    assert distribution([1, "auto", None]) == CategoricalDistribution([1, "auto", None])
    assert distribution(space.entry({"low": 16, "high": 256, "step": 16})) == IntDistribution(16, 256, step=16)
    assert distribution(space.entry({"low": 1, "high": 64, "log": True})) == IntDistribution(1, 64, log=True)
    assert distribution(space.entry({"low": 0.5, "high": 1.0})) == FloatDistribution(0.5, 1.0)
    assert distribution(space.entry({"low": 0.5, "high": 1.0, "step": 0.1})) == FloatDistribution(0.5, 1.0, step=0.1)


def _run_folder(tmp_path, run_id: str, *, status="ok", levels=()):
    layout = SweepLayout(tmp_path / "sweep")
    manifest = RunManifest.model_validate({"run_id": run_id, "config": {"name": run_id[:-2]}, "status": status,
                                           **({"error": {"kind": "oom", "message": "out of memory"}}
                                              if status == "failed" else {})})
    write_model(layout.run(run_id).manifest, manifest)
    if levels:
        write_json(layout.run(run_id).bench, {"schema": "harness.bench/1", "levels": list(levels)})
    return layout, manifest


def test_the_objective_is_read_at_its_level_and_a_run_without_it_has_none_and_says_why(tmp_path):
    from harness.search import objective_of
    sweep = load(tmp_path)
    settings = sweep.playbook.optuna
    assert settings is not None
    levels = [{"concurrency": 1, "output_tok_s": 50.0, "itl_ms": {"p50": 9.0}},
              {"concurrency": 8, "output_tok_s": 300.0, "itl_ms": {"p50": 12.5}}]
    layout, manifest = _run_folder(tmp_path, "a-1", levels=levels)
    assert objective_of(manifest, layout, settings) == (300.0, None)   # the highest level
    at1 = settings.model_copy(update={"level": 1, "objective": "itl_ms_p50"})
    assert objective_of(manifest, layout, at1) == (9.0, None)
    at4 = settings.model_copy(update={"level": 4})
    value, why = objective_of(manifest, layout, at4)
    assert value is None and why is not None and "no concurrency 4 (levels: 1, 8)" in why
    layout, failed = _run_folder(tmp_path, "b-1", status="failed")
    value, why = objective_of(failed, layout, settings)
    assert value is None and why == "oom: out of memory"


def test_plan_shows_the_space_budget_and_first_script_without_touching_a_host(tmp_path):
    pb, inv = write(tmp_path)
    shown = harness("plan", pb, "-i", inv)
    assert shown.returncode == 0, shown.stderr
    assert "20 runs at most" in shown.stdout and "5 runs in a row" in shown.stdout
    assert "args.max-num-seqs: integers 16 to 256, step 16" in shown.stdout
    assert "random_state 3" in shown.stdout and "--tensor-parallel-size 1" in shown.stdout
    (entry,) = json.loads(harness("plan", pb, "-i", inv, "--format", "json").stdout)   # a plan: a list of runs
    search = entry["search"]
    assert search["budget"] == 20 and search["grid_size"] is None and search["direction"] == "maximize"
    assert entry["run_id"].startswith("base_tensor-parallel-size-1_enforce-eager_") and entry["script"]
    assert not (tmp_path / "results").exists()


# --- the trial loop, in-process: the real study in SQLite, run folders written as a run leaves them ----

LOOP = """\
name: loop
hosts: localhost
engine: sim
model: {path: /m}
benchmark: {concurrency: [8]}
search:
  optuna:
    space:
      args.tp-size: [1, 2, 4, 8]
      args.ep-size: [1, 2, 4, 8]
    budget: 12
    random_state: 0
    startup_trials: 2
"""


def _end(search, spec, value: float | None):
    """What the executor does once a run ended: its folder written, then the source told."""
    layout = search.layout.run(spec.run_id)
    manifest = RunManifest.model_validate({
        "run_id": spec.run_id, "config": {"name": spec.config.name}, "status": "ok" if value else "failed",
        **({} if value else {"error": {"kind": "oom", "message": "out of memory"}})})
    write_model(layout.manifest, manifest)
    if value:
        write_json(layout.bench, {"schema": "harness.bench/1", "levels": [{"concurrency": 8, "output_tok_s": value}]})
    search.ended(manifest)


def _search(tmp_path, playbook=LOOP, *, resume=False, sweep_id=None):
    from harness.search import Search
    sweep = load(tmp_path, playbook)
    if sweep_id:
        sweep.sweep_id = sweep_id
    return Search(sweep, tmp_path / "results", resume=resume)


def _read(search) -> dict:
    return json.loads(search.layout.search.read_text())


def test_the_same_random_state_proposes_the_same_runs_and_another_different_ones(tmp_path):
    def proposed(folder, random_state: int) -> list[str]:
        folder.mkdir()
        search = _search(folder, LOOP.replace("random_state: 0", f"random_state: {random_state}"))
        ran = []
        while (spec := search.next()) is not None:
            ran.append(spec.run_id.rsplit("-", 1)[0])   # the configuration, without the run's number
            _end(search, spec, 100.0 + len(ran))
        return ran
    first, again = proposed(tmp_path / "a", 0), proposed(tmp_path / "b", 0)
    assert len(first) == 12 and first == again
    assert proposed(tmp_path / "c", 1) != first


def test_patience_stops_the_search_after_that_many_runs_that_did_not_beat_the_best(tmp_path):
    search = _search(tmp_path, LOOP.replace("    budget: 12\n", "    budget: 12\n    patience: 3\n"))
    values = iter([500.0, 400.0, None, 450.0, 900.0])
    ran = []
    while (spec := search.next()) is not None:
        ran.append(spec.run_id)
        _end(search, spec, next(values))
    assert len(ran) == 4   # the best came first; a worse one, a failed one and a worse one make 3
    found = _read(search)
    assert found["stopped"] == "3 runs in a row did not beat the best (patience 3)"
    assert [t["state"] for t in found["trials"] if t["state"] != "duplicate"] == [
        "complete", "complete", "failed", "complete"]
    assert found["best"]["run_id"] == ran[0] and found["best"]["value"] == 500.0


def test_a_failed_run_is_a_failed_trial_and_a_point_proposed_again_is_not_run_again(tmp_path):
    import optuna
    search = _search(tmp_path, LOOP.replace("[1, 2, 4, 8]\n    budget: 12", "[1, 2]\n    budget: 12"))
    ran = []
    while (spec := search.next()) is not None:
        ran.append(spec.run_id)
        _end(search, spec, None if "tp-size-2" in spec.run_id else 100.0 * len(ran))
    assert len(ran) == len(set(ran)) == 8   # every point of the 4 x 2 space once, then it stops
    found = _read(search)
    assert found["stopped"] == "every point of the space (8) has run" and found["runs"] == 8
    study = optuna.load_study(study_name=search.sweep.sweep_id, storage=f"sqlite:///{search.layout.study}")
    by_number = {t.number: t for t in study.trials}
    for trial in study.trials:
        run_id = trial.user_attrs["run_id"]
        if "duplicate_of" in trial.user_attrs:   # told the earlier run's result, or failed with it
            earlier = by_number[trial.user_attrs["duplicate_of"]]
            assert earlier.user_attrs["run_id"] == run_id and trial.value == earlier.value
        else:
            assert trial.state.name == ("FAIL" if "tp-size-2" in run_id else "COMPLETE")
    failed = [t for t in found["trials"] if t["state"] == "failed"]
    assert failed and all(t["reason"] == "oom: out of memory" and t["value"] is None for t in failed)


def test_a_resumed_search_has_the_runs_so_far_and_asks_on_from_there(tmp_path):
    first = _search(tmp_path)
    done = first.next()
    running = first.next()
    assert done is not None and running is not None
    _end(first, done, 300.0)                     # `running` was in flight when the orchestrator died
    again = _search(tmp_path, resume=True, sweep_id=first.sweep.sweep_id)
    assert [r.run_id for r in again.sweep.runs] == [done.run_id, running.run_id]
    assert again.trial_of == {done.run_id: 0, running.run_id: 1}
    _end(again, running, 200.0)                  # the executor ran it again: told under its own number
    fresh = again.next()
    assert fresh is not None and fresh.run_id not in (done.run_id, running.run_id)
    trials = _read(again)["trials"]
    assert [(t["number"], t["value"]) for t in trials[:2]] == [(0, 300.0), (1, 200.0)]
    assert (trials[-1]["run_id"], trials[-1]["state"]) == (fresh.run_id, "running")


def test_an_interrupted_search_says_its_trial_in_flight_was_interrupted_and_a_resume_runs_it(tmp_path):
    """Ctrl-C stops the run in flight without telling its trial: search.json and the table say it was
    interrupted (not that it still runs), the study keeps it running, and the resume tells it."""
    from rich.console import Console

    from harness.report.search_view import render_search
    from harness.results import SearchFile
    first = _search(tmp_path)
    done, stopped = first.next(), first.next()
    assert done is not None and stopped is not None
    _end(first, done, 300.0)
    assert [t["state"] for t in _read(first)["trials"]] == ["complete", "running"]
    first.close(interrupted=True)
    assert [t["state"] for t in _read(first)["trials"]] == ["complete", "interrupted"]
    console = Console(width=200, record=True)
    console.print(render_search(SearchFile.model_validate(_read(first))))
    assert "interrupted: --resume runs it again" in console.export_text()
    again = _search(tmp_path, resume=True, sweep_id=first.sweep.sweep_id)
    _end(again, stopped, 200.0)
    assert [(t["state"], t["value"]) for t in _read(again)["trials"]] == [("complete", 300.0), ("complete", 200.0)]


def test_a_resumed_search_whose_run_ended_before_it_was_told_is_told_from_its_folder(tmp_path):
    from harness.journal import Journal
    first = _search(tmp_path)
    spec = first.next()
    assert spec is not None
    layout = first.layout.run(spec.run_id)
    manifest = RunManifest.model_validate({"run_id": spec.run_id, "config": {"name": "x"}, "status": "ok",
                                           "started": 1000.0})
    write_model(layout.manifest, manifest)
    write_json(layout.bench, {"schema": "harness.bench/1", "levels": [{"concurrency": 8, "output_tok_s": 77.0}]})
    Journal(first.layout.journal).append(spec.run_id, "ok", host="localhost")   # killed before the tell
    again = _search(tmp_path, resume=True, sweep_id=first.sweep.sweep_id)
    again.ended(manifest)   # the same run told again (a race with the executor): one trial still
    assert again.next() is not None
    trials = _read(again)["trials"]
    assert trials[0] | {"state": "complete", "value": 77.0} == trials[0]
    assert [t["run_id"] for t in trials if t["state"] != "duplicate"].count(spec.run_id) == 1


def test_a_resumed_search_refuses_a_changed_objective_naming_the_key(tmp_path):
    first = _search(tmp_path)
    assert first.next() is not None
    with pytest.raises(InputError) as e:
        _search(tmp_path, LOOP.replace("    budget: 12\n", "    budget: 12\n    objective: itl_ms_p50\n"),
                resume=True, sweep_id=first.sweep.sweep_id)
    assert e.value.key == "search.optuna.objective" and "start a new sweep" in str(e.value)


def test_the_commands_that_do_not_search_never_import_optuna():
    import subprocess
    import sys
    code = ("import sys, harness.cli, harness.plan, harness.executor, harness.resume, harness.report.compare, "
            "harness.report.html, harness.report.search_view; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'optuna', 'sqlalchemy', 'numpy'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    shown = subprocess.run([sys.executable, "-X", "importtime", "-m", "harness", "--help"], capture_output=True,
                           text=True)
    assert shown.returncode == 0 and "sweep" in shown.stdout
    assert "optuna" not in shown.stderr and "harness.search" not in shown.stderr


def test_a_study_that_cannot_be_opened_asks_no_trial_and_says_why(tmp_path):
    search = _search(tmp_path)
    search.layout.study.mkdir(parents=True)   # a folder where the SQLite file would be
    assert search.next() is None
    assert search.failure is not None and search.failure.startswith(f"the study in {search.layout.study} failed")


def test_a_larger_budget_or_patience_leaves_every_runs_inputs_as_they_were(tmp_path):
    """What --resume compares: a search's settings choose runs and are no run's input, so the budget
    of a resumed search may grow; a run's own values are (they are in its configuration)."""
    from harness.resume import fingerprint, run_inputs
    point = {"args.tensor-parallel-size": 2}
    before = load(tmp_path)
    grown = load(tmp_path, PLAYBOOK.replace("budget: 20", "budget: 40").replace("patience: 5", "patience: 9"))
    assert fingerprint(run_inputs(before, search_run(before, point))) == \
        fingerprint(run_inputs(grown, search_run(grown, point)))
    assert fingerprint(run_inputs(before, search_run(before, point))) != \
        fingerprint(run_inputs(before, search_run(before, {"args.tensor-parallel-size": 4})))


def test_the_shipped_search_playbook_plans():
    from tests.remote_venv import REPO
    sweep = load_sweep(REPO / "playbooks" / "search.yaml", REPO / "inventory.yaml")
    assert sweep.playbook.optuna is not None and space.size(sweep.playbook.optuna.space) == 96
