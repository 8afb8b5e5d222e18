"""References, ReFrame-style: how a playbook writes them, which results miss them, and that a results
directory alone (its sweep.json) carries them."""

from __future__ import annotations

import json

import pytest
import yaml

from harness.config.playbook import load_playbook
from harness.errors import InputError
from harness.report.references import Miss, check_references, parse_references, references_of


def playbook(tmp_path, references):
    pb = {"name": "p", "hosts": "localhost", "engine": "sim", "model": {"path": "/m"},
          "configs": [{"name": "tp8"}, {"name": "ep8"}], "references": references}
    path = tmp_path / "playbook.yaml"
    path.write_text(yaml.safe_dump(pb))
    return path


def row(config="tp8", concurrency=1, **metrics):
    return {"config": config, "concurrency": concurrency, **metrics}


def test_a_playbook_gives_references_long_short_and_per_concurrency(tmp_path):
    pb, _ = load_playbook(playbook(tmp_path, {
        "*": {"itl_ms_p50": {"value": 97, "lower": -0.1, "upper": 0.1}},
        "tp8": {"output_tok_s": [10.3, -0.05, None], "ttft_ms_p99": {1: [180, None, 0.2], 8: [400, None, 0.2]}}}))
    refs = pb.references
    assert refs["*"]["itl_ms_p50"].value == 97 and refs["*"]["itl_ms_p50"].upper == 0.1
    assert refs["tp8"]["output_tok_s"].upper is None
    assert refs["tp8"]["ttft_ms_p99"][8].value == 400


@pytest.mark.parametrize("references, key", [
    ({"tp8": {"itl_p50": [97, -0.1, 0.1]}}, "references"),
    ({"tp8": {"itl_ms_p50": [97, 0.1, 0.1]}}, "references.tp8.itl_ms_p50"),
    ({"tp8": {"itl_ms_p50": [97, -0.1]}}, "references.tp8.itl_ms_p50"),
])
def test_a_bad_reference_is_an_input_error_naming_the_file_and_key(tmp_path, references, key):
    with pytest.raises(InputError) as e:
        load_playbook(playbook(tmp_path, references))
    assert "playbook.yaml" in str(e.value) and key in str(e.value)


def test_a_result_inside_the_band_passes_and_one_outside_is_a_miss_that_says_why():
    refs = parse_references({"tp8": {"itl_ms_p50": [100, -0.1, 0.1]}})
    assert check_references([row(itl_ms_p50=109.9), row(itl_ms_p50=90.1)], refs) == []
    (miss,) = check_references([row(itl_ms_p50=111)], refs)
    assert miss == Miss("tp8", 1, "itl_ms_p50", 111, 100, 90, pytest.approx(110))
    assert str(miss) == "tp8 at concurrency 1: itl_ms_p50 = 111 is outside [90, 110] (reference 100)"


def test_an_open_side_never_misses():
    refs = parse_references({"*": {"output_tok_s": [10, -0.05, None]}})
    assert check_references([row(output_tok_s=1e6)], refs) == []
    assert [m.metric for m in check_references([row(output_tok_s=9)], refs)] == ["output_tok_s"]


def test_a_configurations_own_reference_wins_over_the_wildcard():
    refs = parse_references({"*": {"itl_ms_p50": [100, -0.1, 0.1]}, "ep8": {"itl_ms_p50": [50, -0.1, 0.1]}})
    misses = check_references([row("tp8", itl_ms_p50=100), row("ep8", itl_ms_p50=100)], refs)
    assert [(m.config, m.reference) for m in misses] == [("ep8", 50)]


def test_a_per_concurrency_reference_applies_at_its_level_only():
    refs = parse_references({"tp8": {"itl_ms_p50": {8: [100, -0.1, 0.1]}}})
    misses = check_references([row(concurrency=1, itl_ms_p50=5), row(concurrency=8, itl_ms_p50=5)], refs)
    assert [(m.concurrency, m.value) for m in misses] == [(8, 5)]


def test_a_run_that_failed_misses_its_references():
    refs = parse_references({"tp8": {"itl_ms_p50": [100, -0.1, 0.1]}})
    (miss,) = check_references([row(concurrency=None, itl_ms_p50=None)], refs)
    assert miss.value is None and str(miss) == "tp8: itl_ms_p50 has no value (reference 100)"


def test_the_results_directory_carries_the_references_its_sweep_recorded(tmp_path):
    pb, _ = load_playbook(playbook(tmp_path, {"tp8": {"itl_ms_p50": {8: [100, -0.1, 0.1]}}}))
    sweep = tmp_path / "results" / "p-1"
    (sweep / "runs").mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"schema": "harness.sweep/1", "sweep_id": "p-1",
                                                "playbook": pb.model_dump(mode="json")}))
    refs = references_of([tmp_path / "results"])
    assert refs["tp8"]["itl_ms_p50"][8].value == 100  # JSON keys are text; the level is a number again


def test_a_failed_run_misses_its_per_concurrency_references_too():
    refs = parse_references({"tp8": {"itl_ms_p50": {1: [100, -0.1, 0.1], 8: [120, -0.1, 0.1]}}})
    misses = check_references([row(concurrency=None, itl_ms_p50=None)], refs)
    assert [m.reference for m in misses] == [100, 120]


def test_a_reference_for_a_configuration_the_playbook_lacks_is_refused(tmp_path):
    """`tp-8` for `tp8`: the reference would never be checked, and the sweep would end ok."""
    from harness.plan import load_sweep
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("all:\n  hosts:\n    localhost: {transport: local}\n")
    with pytest.raises(InputError) as e:
        load_sweep(playbook(tmp_path, {"tp-8": {"output_tok_s": [1000, -0.1, None]}}), inventory)
    assert e.value.key == "references.tp-8" and "did you mean 'tp8'" in str(e.value) and e.value.line
    load_sweep(playbook(tmp_path, {"*": {"output_tok_s": [1000, -0.1, None]},
                                   "ep8": {"output_tok_s": [900, -0.1, None]}}), inventory)
