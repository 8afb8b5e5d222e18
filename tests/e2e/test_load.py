"""Workloads end to end: a sweep through the loopback sshd into the simulator (as vLLM and as SGLang,
its tokenizer endpoint answering as each engine's does) with scenarios of exact prompt lengths, closed and open loop, an
SLO's goodput and the max_load search, then compare and the report reading what it wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import harness
from tests.e2e.test_sweep import FAST, _free_port, sweep_dir

SCENARIOS = [
    {"name": "chat", "input_tokens": 40, "output_tokens": 8, "concurrency": [1, 3], "requests": 6},
    {"name": "burst", "input_tokens": 64, "output_tokens": 4, "request_rate": [20.0], "arrival": "gamma",
     "burstiness": 0.5, "requests": 12},
]


def playbook(tmp_path: Path, slo: dict, search: dict, engine: str) -> Path:
    pb = {"name": "load", "hosts": "node1", "engine": engine,
          "model": {"path": "/models/tiny", "served_name": "tiny"},
          "server": {"port": _free_port(), "env": dict(FAST), "startup_timeout_s": 60},
          "configs": [{"name": "one"}],
          "benchmark": {"warmup": 1, "timeout_s": 60, "random_state": 11, "scenarios": SCENARIOS},
          "slo": slo, "search": {"max_load": search}, "profile": {"mode": "none"}}
    path = tmp_path / "playbook.yaml"
    path.write_text(yaml.safe_dump(pb, sort_keys=False))
    return path


def sweep(tmp_path: Path, ssh_inventory, slo: dict, search: dict,
          engine: str = "vllm") -> tuple[Path, dict, list[dict]]:
    results = tmp_path / "results"
    run = harness("sweep", playbook(tmp_path, slo, search, engine), "-i", ssh_inventory(), "-o", results)
    assert run.returncode == 0, run.stdout + run.stderr
    d = sweep_dir(results) / "runs" / "one-1"
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["status"] == "ok", manifest.get("error")
    requests = [json.loads(line) for line in (d / "requests.jsonl").read_text().splitlines()]
    return sweep_dir(results), json.loads((d / "bench.json").read_text()), requests


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_scenarios_closed_and_open_loop_with_goodput_and_the_max_load_search(tmp_path, ssh_inventory, engine):
    root, bench, requests = sweep(tmp_path, ssh_inventory, {"ttft_ms_p99": 60000, "itl_ms_p99": 60000},
                                  {"scenario": "chat", "low": 1, "high": 4, "steps": 3}, engine)
    levels = bench["levels"]
    assert [(lv["scenario"], lv["concurrency"], lv["request_rate"], lv["probe"]) for lv in levels] == [
        ("chat", 1, None, False), ("chat", 3, None, False), ("burst", None, 20.0, False),
        ("chat", 1, None, True), ("chat", 4, None, True)]
    for lv in levels:
        w = lv["workload"]
        assert (w["scenario"], w["kind"]) == (lv["scenario"], "concurrency" if lv["concurrency"] else "request_rate")
        assert lv["completed"] == lv["requests"] and lv["failed"] == 0
        # every prompt exactly as long as asked, as the server's own usage counted it
        assert lv["prompt_source"] == "tokenize"
        assert lv["prompt_tokens_reported"] == {str(w["input_tokens"]): lv["completed"]}
        assert lv["prompt_tokens_mismatches"] == 0
        assert lv["output_tokens"] == w["output_tokens"] * lv["completed"]
        assert lv["slo_met_requests"] == lv["completed"] and lv["goodput_req_s"] > 0 and lv["slo_met"] is True
        assert lv["random_state"] == 11 + levels.index(lv)
    burst = levels[2]
    assert burst["latency_origin"] == "scheduled" and (burst["arrival"], burst["burstiness"]) == ("gamma", 0.5)
    assert burst["achieved_rate_req_s"] > 0 and burst["schedule_lag_ms"]["p50"] is not None
    opened = [r for r in requests if r["scenario"] == "burst"]
    assert len(opened) == 12 and all(r["start_ns"] >= r["scheduled_ns"] for r in opened)
    # the schedule as the random state draws it: offsets from the first scheduled send
    from harness.remote.workload import arrival_offsets
    first = opened[0]["scheduled_ns"]
    assert [r["scheduled_ns"] - first for r in opened] == arrival_offsets(20.0, 12, "gamma", 0.5, 13)
    assert all(r["scheduled_ns"] is None for r in requests if r["scenario"] == "chat")
    assert bench["max_load"] == {"scenario": "chat", "kind": "concurrency", "low": 1, "high": 4, "steps": 3,
                                 "slo": {"ttft_ms_p99": 60000, "itl_ms_p99": 60000}, "value": 4, "met": True,
                                 "probes": [{"load": 1, "met": True, "level": 3}, {"load": 4, "met": True, "level": 4}]}

    rows = json.loads(harness("compare", root, "--format", "json").stdout)
    assert {(r["scenario"], r["concurrency"], r["request_rate"], r["probe"]) for r in rows} == {
        ("chat", 1, None, False), ("chat", 3, None, False), ("burst", None, 20.0, False), ("chat", 1, None, True),
        ("chat", 4, None, True)}
    assert all(r["goodput_req_s"] > 0 for r in rows)
    assert all(r["max_load"]["value"] == 4 and r["max_load"]["probes"] == 2 for r in rows)
    table = harness("compare", root)
    assert table.returncode == 0, table.stderr
    assert "good" in table.stdout and "max load one (chat, ttft_ms_p99 60000, itl_ms_p99 60000): 4 streams" \
        in table.stdout and "burst 20/s" in table.stdout
    report = tmp_path / "report.html"
    assert harness("report", root, "-o", report).returncode == 0
    page = report.read_text()
    assert "Max load within the SLO" in page and "goodput" in page


def test_a_low_probe_that_misses_the_slo_is_a_finding_not_a_failed_run(tmp_path, ssh_inventory):
    root, bench, _ = sweep(tmp_path, ssh_inventory, {"ttft_ms_p99": 0.001},
                           {"scenario": "burst", "low": 5, "high": 40, "steps": 4})
    assert bench["max_load"]["met"] is False and bench["max_load"]["value"] is None
    assert [p["load"] for p in bench["max_load"]["probes"]] == [5]
    assert all(lv["slo_met"] is False and lv["slo_met_requests"] == 0 and lv["goodput_req_s"] == 0
               for lv in bench["levels"])
    table = harness("compare", root)
    assert "none met the SLO (even 5)" in table.stdout, table.stdout
