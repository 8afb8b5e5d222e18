"""`search.optuna` faults a night brings: trials that could never have a value refused before any host,
a search that ends with no value said to fail, names too long for a folder, a float range narrower
than its digits, choices the sampler cannot tell apart, and the plan's json of one shape."""

from __future__ import annotations

import json

import pytest

from harness.config import space
from harness.errors import InputError
from harness.plan import search_run
from tests.conftest import harness
from tests.unit.test_search import LOOP, _end, _read, _search, load, write

SCENARIOS = LOOP.replace("benchmark: {concurrency: [8]}\n", """\
benchmark:
  scenarios:
    - {name: chat, input_tokens: 64, output_tokens: 8, concurrency: [4, 16]}
""")


def _line(playbook: str, key: str) -> int:
    """The line of `key`'s last part, or of `optuna:` where the playbook leaves it to its default."""
    lines = playbook.splitlines()
    for text in (key.rsplit(".", 1)[-1] + ":", "optuna:"):
        if found := [i for i, line in enumerate(lines, 1) if line.strip().startswith(text)]:
            return found[0]
    raise AssertionError(key)


@pytest.mark.parametrize("playbook, key, words", [
    # no trial measures concurrency 64: each would run, take the GPUs for a server's life, and fail
    (LOOP.replace("    budget: 12\n", "    budget: 12\n    level: 64\n"), "search.optuna.level",
     "concurrency 64: no trial measures it (the benchmark's concurrency: 8)"),
    (LOOP.replace("      args.ep-size: [1, 2, 4, 8]\n", "      benchmark.concurrency: [8, 64]\n")
     .replace("    budget: 12\n", "    budget: 12\n    level: 64\n"), "search.optuna.level",
     "the points with benchmark.concurrency 8 do not measure it"),
    (SCENARIOS.replace("    budget: 12\n", "    budget: 12\n    level: 8\n"), "search.optuna.level",
     "concurrency 8: no trial measures it (the benchmark's concurrency: 4, 16)"),
    (SCENARIOS.replace("concurrency: [4, 16]", "request_rate: [1, 2]"), "search.optuna.objective",
     "output_tok_s is read at a concurrency, and no trial measures one"),
    # a float range over whole numbers: the first point (its low end) passed, the trials' fractions did not
    (LOOP.replace("      args.ep-size: [1, 2, 4, 8]\n", "      benchmark.max_tokens: {low: 8.0, high: 64.0}\n"),
     "search.optuna.space", "benchmark.max_tokens: Input should be a valid integer"),
])
def test_a_search_whose_trials_could_never_have_a_value_is_refused_before_the_study(tmp_path, playbook, key, words):
    with pytest.raises(InputError) as e:
        _search(tmp_path, playbook)
    assert e.value.key == key and words in str(e.value), e.value
    assert e.value.line == _line(playbook, key)
    assert not (tmp_path / "results").exists()   # no study made
    pb, inv = write(tmp_path, playbook)
    planned = harness("plan", pb, "-i", inv)      # the plan refuses what the sweep would
    assert planned.returncode == 2 and words in " ".join(planned.stderr.split()), planned.stdout + planned.stderr


def test_a_level_every_trial_measures_is_accepted(tmp_path):
    fine = SCENARIOS.replace("    budget: 12\n", "    budget: 12\n    level: 16\n")
    assert _search(tmp_path, fine).next() is not None


def test_a_search_that_ends_with_no_trial_valued_fails_saying_so(tmp_path):
    """Every run failed, or measured no objective: the search found nothing, and the sweep must not
    end as if it had (a search of runs that went well but measured nothing exited 0)."""
    search = _search(tmp_path, LOOP.replace("[1, 2, 4, 8]\n    budget: 12", "[1, 2]\n    budget: 12"))
    while (spec := search.next()) is not None:
        assert search.failure is None   # not while it may still find one
        _end(search, spec, None)
    assert search.stopped and search.failure is not None
    assert "found no value of output_tok_s: every trial failed" in search.failure
    assert _read(search)["best"] is None

    (tmp_path / "b").mkdir()
    valued = _search(tmp_path / "b", LOOP.replace("[1, 2, 4, 8]\n    budget: 12", "[1, 2]\n    budget: 12"))
    while (spec := valued.next()) is not None:
        _end(valued, spec, 10.0 if "tp-size-2_ep-size-2" in spec.run_id else None)
    assert valued.stopped and valued.failure is None and _read(valued)["best"]["value"] == 10.0


def test_the_end_of_a_search_with_no_value_says_there_is_no_best_not_yet():
    from rich.console import Console

    from harness.report.search_view import render_search
    from harness.results import SearchFile
    found = SearchFile.model_validate({
        "objective": "output_tok_s", "direction": "maximize", "budget": 2, "runs": 1,
        "stopped": "every point of the space (1) has run",
        "trials": [{"number": 0, "run_id": "a-1", "config": "a", "state": "failed", "reason": "oom: out of memory"}]})
    console = Console(width=120, record=True)
    console.print(render_search(found))
    shown = console.export_text()
    assert "no best" in shown and "yet" not in shown
    console = Console(width=120, record=True)
    console.print(render_search(found.model_copy(update={"stopped": None})))
    assert "no trial has a value yet" in console.export_text()


def test_a_point_whose_name_is_too_long_for_a_folder_is_named_short_and_apart(tmp_path):
    """Flags of long names and values (paths, JSON) made a trial's configuration name longer than a
    folder's: the plan died with pydantic's traceback, a later trial stopped the search."""
    drafts = [f'\'{{"method": "eagle3", "model": "/models/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B-draft-model-of-a-long-'
              f'name", "num_speculative_tokens": {n}}}\'' for n in (3, 5)]
    long = LOOP.replace("      args.tp-size: [1, 2, 4, 8]\n      args.ep-size: [1, 2, 4, 8]\n",
                        f"      args.speculative-config: [{', '.join(drafts)}]\n"
                        "      args.max-num-batched-tokens-per-scheduler-step-in-prefill: [8192, 16384]\n"
                        "      args.enable-chunked-prefill-for-requests-of-long-context: [true, false]\n")
    sweep = load(tmp_path, long)
    settings = sweep.playbook.optuna
    assert settings is not None
    runs = [search_run(sweep, point) for point in space.grid(settings.space)]
    assert len({r.run_id for r in runs}) == 8 and all(len(r.config.name) <= 200 for r in runs)
    assert all(r.run_id.startswith("speculative-config-method-eagle3-model-models-yuhuili-EAGLE3") for r in runs)
    assert search_run(sweep, space.first_point(settings.space)).run_id == runs[0].run_id   # stable


def test_a_float_range_narrower_than_four_digits_keeps_its_values_apart_and_inside_it():
    narrow = space.entry({"low": 1000.1, "high": 1000.4})
    assert isinstance(narrow, space.Range)
    assert [narrow.value(x) for x in (1000.1, 1000.23, 1000.4)] == [1000.1, 1000.2, 1000.4]   # was 1000.0 each
    edge = space.entry({"low": 0.5, "high": 0.99999})
    assert isinstance(edge, space.Range) and edge.value(0.99996) <= 0.99999   # was 1.0, above high
    usual = space.entry({"low": 0.7, "high": 0.95})
    assert isinstance(usual, space.Range) and usual.value(0.83119472) == 0.8312   # as before: 4 digits


def test_choices_the_sampler_cannot_tell_apart_are_named_as_such():
    with pytest.raises(ValueError, match="cannot tell apart"):
        space.entry([1, True])
    with pytest.raises(ValueError, match="appears twice"):
        space.entry(["a", "a"])


def test_plan_json_of_a_search_is_a_list_of_runs_as_any_plans_is(tmp_path):
    """`harness plan --format json` is a list of {run_id, host, config, script} (what
    benchmarks/check_engine_flags.py reads): a search's gave a mapping, and its reader failed."""
    pb, inv = write(tmp_path)
    shown = harness("plan", pb, "-i", inv, "--format", "json")
    assert shown.returncode == 0, shown.stderr
    (entry,) = json.loads(shown.stdout)
    assert {"run_id", "host", "config", "script"} <= set(entry)
    assert entry["run_id"].startswith("base_tensor-parallel-size-1_") and "--tensor-parallel-size 1" in entry["script"]
    assert entry["search"]["budget"] == 20 and entry["search"]["grid_size"] is None


def test_a_resumed_search_whose_choices_changed_is_refused_naming_the_entry(tmp_path):
    """Optuna cannot go on with a study whose choices changed: the resumed sweep ran what was left, then
    failed at its first new trial as if the study's database had ("CategoricalDistribution does not
    support dynamic value space"), exit 1."""
    first = _search(tmp_path)
    spec = first.next()
    assert spec is not None
    _end(first, spec, 100.0)
    changed = LOOP.replace("      args.tp-size: [1, 2, 4, 8]\n", "      args.tp-size: [1, 2, 16]\n")
    with pytest.raises(InputError) as e:
        _search(tmp_path, changed, resume=True, sweep_id=first.sweep.sweep_id)
    assert e.value.key == "search.optuna.space.args.tp-size" and "was 1, 2, 4, 8" in str(e.value)
    assert e.value.line == changed.splitlines().index("      args.tp-size: [1, 2, 16]") + 1
    grown = LOOP.replace("      args.ep-size: [1, 2, 4, 8]\n", "      args.ep-size: [1, 2, 4, 8]\n      env.X: [a]\n")
    again = _search(tmp_path, grown, resume=True, sweep_id=first.sweep.sweep_id)   # a new entry: fine
    assert again.next() is not None and again.failure is None


def test_a_failed_trial_keeps_its_reason_once_its_run_is_run_again(tmp_path):
    """--resume --retry-failed runs a failed trial's run again, in the same folder, as a new trial: the
    failed trial lost its reason (search.json read it from the folder, which now holds the new run)."""
    from harness.results import write_json, write_model
    from harness.results.models import RunManifest
    first = _search(tmp_path)
    spec = first.next()
    assert spec is not None
    layout = first.layout.run(spec.run_id)

    def ended(search, value: float | None, started: float) -> None:
        manifest = RunManifest.model_validate({
            "run_id": spec.run_id, "config": {"name": spec.config.name}, "status": "ok" if value else "failed",
            "started": started, **({} if value else {"error": {"kind": "oom", "message": "out of memory"}})})
        write_model(layout.manifest, manifest)
        if value:
            level = {"concurrency": 8, "output_tok_s": value}
            write_json(layout.bench, {"schema": "harness.bench/1", "levels": [level]})
        search.ended(manifest)
    ended(first, None, 1000.0)
    again = _search(tmp_path, resume=True, sweep_id=first.sweep.sweep_id)
    ended(again, 250.0, 2000.0)   # the run again, ok this time
    trials = {t["number"]: t for t in _read(again)["trials"]}
    assert trials[0]["state"] == "failed" and trials[0]["reason"] == "oom: out of memory"
    (retried,) = [t for n, t in trials.items() if n != 0 and t["run_id"] == spec.run_id]
    assert retried["state"] == "complete" and retried["value"] == 250.0
