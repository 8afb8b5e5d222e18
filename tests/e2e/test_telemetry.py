"""Telemetry in whole sweeps: the sampler beside the benchmark on a real SSH host (sshd on loopback), the
simulator's /metrics with the imitated engine's family names, the file pulled back, summarized per
level by `harness compare` and drawn by `harness report`."""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import pytest

from tests.conftest import harness
from tests.e2e.test_sweep import manifests, playbook, sweep_dir

STAND_IN_NVIDIA_SMI = """#!/bin/sh
# answers the sampler's query as nvidia-smi 580.159.04 did on an H200 (tests/fixtures/metrics), for two
# busy GPUs; any other query (the preflight's, the facts') gets nothing
case "$*" in *clocks.sm*) ;; *) exit 0 ;; esac
echo "index, clocks.current.sm [MHz], memory.used [MiB], power.draw [W], utilization.gpu [%]"
echo "0, 1980 MHz, 120000 MiB, 450.50 W, 97 %"
echo "1, 1965 MHz, 119000 MiB, [N/A], 95 %"
"""
HUNG_NVIDIA_SMI = """#!/bin/sh
# hangs on the sampler's query (a driver in trouble), answers nothing to any other
case "$*" in *clocks.sm*) echo called >> "$(dirname "$0")/calls"; exec sleep 60 ;; esac
"""


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_sweep_samples_metrics_around_every_level_and_compare_summarizes_them(tmp_path, ssh_inventory, engine):
    results = tmp_path / "results"
    extra = {"args": {"enable-metrics": True}} if engine == "sglang" else {}
    # levels of about a second (400 tokens at some 2 ms a step) and twenty samples a second: many inside each
    pb = playbook(tmp_path, engine=engine, profile="none", configs=[{"name": "one", **extra}],
                  telemetry={"interval_s": 0.05}, benchmark={"prompt": "hello there", "max_tokens": 100,
                                                             "concurrency": [1, 4], "requests": 4, "timeout_s": 60})
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    run_dir = sweep_dir(results) / "runs" / m["run_id"]
    assert m["status"] == "ok" and "telemetry.jsonl" in m["collected"]["sha256"], m
    got = lines(run_dir / "telemetry.jsonl")
    assert got[0]["source"] == "start" and got[0]["values"]["schema"] == "harness.telemetry/1"
    assert got[-1]["source"] == "stop" and got[-1]["values"]["why"] == "signal SIGTERM"
    samples = [x for x in got if x["source"] == "metrics"]
    family = {"vllm": "vllm:generation_tokens_total", "sglang": "sglang:generation_tokens_total"}[engine]
    running = {"vllm": "vllm:num_requests_running", "sglang": "sglang:num_running_reqs"}[engine]
    assert all(any(k.startswith(family + "{") for k in s["values"]) for s in samples)
    assert all(any(k.startswith(running + "{") for k in s["values"]) for s in samples)
    # nothing but the families the engine's record lists
    kept = {k.partition("{")[0] for s in samples for k in s["values"]}
    assert all(k.startswith(f"{engine}:") and not k.endswith("_created") for k in kept), kept
    bench = json.loads((run_dir / "bench.json").read_text())
    for level in bench["levels"]:
        before = [s for s in samples if s["t_end_ns"] <= level["started_ns"]]
        after = [s for s in samples if s["t_ns"] >= level["ended_ns"]]
        assert before and after, level["concurrency"]
        # the server counted every token of the level between the two brackets
        grew = sum(v for k, v in after[0]["values"].items() if k.startswith(family + "{")) - \
            sum(v for k, v in before[-1]["values"].items() if k.startswith(family + "{"))
        assert grew >= level["output_tokens"] > 0

    compare = harness("compare", results, "--format", "json")
    assert compare.returncode == 0, compare.stderr
    rows = json.loads(compare.stdout)
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row in rows:
        tm = row["telemetry"]
        assert tm["bracketed"] is True and tm["runs"] == 1
        assert 0 < tm["running_max"] <= 4 and tm["kv_cache_usage_max"] > 0
        assert tm["prefix_cache_hit_rate"] == 0          # the simulator has no prefix cache: every query misses
        assert "gpus" not in tm and "no GPU samples" in " ".join(row["telemetry_notes"])
    markdown = harness("compare", results, "--format", "markdown").stdout
    assert "Telemetry per level" in markdown and "| config | conc | running |" in markdown, markdown
    sheet = list(csv.DictReader(io.StringIO(harness("compare", results, "--format", "csv").stdout)))
    assert sheet and all(float(r["telemetry_running_mean"]) > 0 and r["telemetry_gpu_power_w"] == "" for r in sheet)
    table = harness("compare", results)
    assert "telemetry per level" in table.stdout and "nvidia-smi" in table.stdout, table.stdout
    report = harness("report", results, "-o", tmp_path / "report.html")
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "report.html").read_text()
    assert 'id="telemetry"' in html and "KV-cache use" in html


def test_gpu_samples_come_from_nvidia_smi_and_a_hung_one_is_cut_off(tmp_path, ssh_inventory):
    """nvidia-smi cannot run here: a stand-in on the PATH of a host reached without SSH (so the PATH is
    the test's) prints the real H200 format. A second
    sweep's stand-in hangs: the sampler's timeout cuts it off, notes it, and the run stays ok."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(STAND_IN_NVIDIA_SMI)
    smi.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    results = tmp_path / "results"
    pb = playbook(tmp_path, engine="vllm", profile="none", configs=[{"name": "one"}], hosts="localhost",
                  telemetry={"interval_s": 0.05})
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", results, env={"PATH": path})
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    gpu = [x for x in lines(sweep_dir(results) / "runs" / m["run_id"] / "telemetry.jsonl") if x["source"] == "gpu"]
    assert {x["values"]["gpu"] for x in gpu} == {0, 1}
    assert gpu[0]["values"] == {"gpu": 0, "sm_clock_mhz": 1980.0, "memory_used_mib": 120000.0, "power_w": 450.5,
                                "utilization_pct": 97.0}
    rows = json.loads(harness("compare", results, "--format", "json").stdout)
    assert rows[0]["telemetry"]["gpu_power_w"] == 450.5        # the second GPU's power is [N/A]
    assert rows[0]["telemetry"]["gpu_memory_used_mib"] == 120000.0
    assert [g["gpu"] for g in rows[0]["telemetry"]["gpus"]] == [0, 1]

    smi.write_text(HUNG_NVIDIA_SMI)
    hung = tmp_path / "hung"
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", hung, env={"PATH": path})
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(hung).values()
    got = lines(sweep_dir(hung) / "runs" / m["run_id"] / "telemetry.jsonl")
    assert m["status"] == "ok" and not [x for x in got if x["source"] == "gpu"]
    notes = [x["values"]["message"] for x in got if x["source"] == "note"]
    assert [n for n in notes if "nvidia-smi" in n] == [
        f"nvidia-smi: {smi} gave no answer within 10 s: no more GPU samples this run"]      # asked once only
    assert any(w.startswith("telemetry: nvidia-smi") for w in m["warnings"]), m["warnings"]
    assert len([x for x in got if x["source"] == "metrics"]) >= 2
    assert (bin_dir / "calls").read_text().split() == ["called"]      # never asked again


def test_a_server_without_metrics_keeps_its_run_and_the_warning_says_how_to_get_them(tmp_path, ssh_inventory):
    """SGLang serves /metrics only with --enable-metrics (the simulator as the real one): a 404 every
    round, noted once, and the manifest says which flag brings them."""
    results = tmp_path / "results"
    pb = playbook(tmp_path, engine="sglang", profile="none", configs=[{"name": "plain"}],
                  telemetry={"interval_s": 0.05})
    run = harness("sweep", pb, "-i", ssh_inventory(), "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    (m,) = manifests(results).values()
    got = lines(sweep_dir(results) / "runs" / m["run_id"] / "telemetry.jsonl")
    assert m["status"] == "ok" and not [x for x in got if x["source"] == "metrics"]
    refused = [x["values"]["message"] for x in got if x["source"] == "note" and x["values"]["error"]]
    assert len(refused) == 1 and refused[0].endswith("GET /metrics answered HTTP 404")
    assert got[-1]["values"]["errors"] >= 2          # every round failed, noted once
    (warning,) = [w for w in m["warnings"] if w.startswith("telemetry:")]
    assert warning.endswith("add `enable-metrics: true` to server.args")
