"""A host whose benchmark client's bench.json lies, over a real sshd: the sweep's own bench phase (timed
by the orchestrator) and the levels' own arithmetic give it away, and compare and the report say so,
naming the run and the field, with no winner made of it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import harness
from tests.e2e.test_sweep import playbook, sweep_dir
from tests.remote_venv import make_remote_venv

pytestmark = pytest.mark.e2e

FORGE = r'''
import json, sys
path = sys.argv[1]
with open(path) as f:
    bench = json.load(f)
first, second = bench["levels"][0], bench["levels"][1]
first["output_tok_s"] = 1e308                                   # finite, absurd, and not its own division
k = 10_000                                                       # every rate of the second level consistent,
second["duration_s"] *= k                                        # but the level lasts longer than the whole
second["ended_ns"] = second["started_ns"] + round(second["duration_s"] * 1e9)   # benchmark the orchestrator
for key in ("output_tok_s", "requests_per_s"):                   # timed
    second[key] /= k
with open(path, "w") as f:
    json.dump(bench, f)
'''

WRAPPER = """#!/bin/bash
# the venv's python, but a bench.json it writes is forged before the orchestrator fetches it
real="$(dirname "$0")/python-real"
case " $* " in *" bench "*) ;; *) exec "$real" "$@" ;; esac
"$real" "$@"; code=$?
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out="$a"; prev="$a"; done
[ -n "$out" ] && [ -f "$out" ] && "$real" {forge} "$out"
exit $code
"""


@pytest.fixture
def lying_venv(tmp_path) -> Path:
    venv = make_remote_venv(tmp_path / "lying-venv")
    python = venv / "bin" / "python"
    (venv / "bin" / "python-real").symlink_to(os.path.realpath(python))
    forge = tmp_path / "forge.py"
    forge.write_text(FORGE)
    python.unlink()
    python.write_text(WRAPPER.replace("{forge}", str(forge)))
    python.chmod(0o755)
    return venv


def test_a_hosts_bench_json_that_cannot_be_true_is_not_measured_and_wins_nothing(tmp_path, ssh_inventory,
                                                                                  lying_venv):
    results = tmp_path / "r"
    run = harness("sweep", playbook(tmp_path, profile="none", configs=[{"name": "one"}]),
                  "-i", ssh_inventory(venv=str(lying_venv)), "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    root = sweep_dir(results)
    bench = json.loads(next(root.glob("runs/*/bench.json")).read_text())
    assert bench["levels"][0]["output_tok_s"] == 1e308            # the host's file, as it came back
    rows = json.loads(harness("compare", root, "--format", "json").stdout)
    by_load = {r["concurrency"]: r for r in rows}
    assert by_load[1]["output_tok_s"] is None and by_load[1]["ok"] == 1
    assert "one-1: bench.json concurrency 1: output_tok_s 1e+308 disagrees with output_tokens" in by_load[1]["error"]
    assert by_load[4]["ok"] == 0 and by_load[4]["output_tok_s"] is None and by_load[4]["itl_ms_p50"] is None
    assert "longer than the whole benchmark phase" in by_load[4]["error"]
    table = harness("compare", root)
    said = " ".join((table.stdout + table.stderr).split())
    assert "winner" not in said and "one: one-1: bench.json concurrency 1: output_tok_s 1e+308 disagrees" in said
    assert "warning: one-1: bench.json concurrency 4: duration_s" in said   # and on stderr
    page = harness("report", root, "-o", tmp_path / "report.html")
    assert page.returncode == 0, page.stderr
    html = (tmp_path / "report.html").read_text()
    assert "output_tok_s 1e+308 disagrees" in html and "longer than the whole benchmark phase" in html
