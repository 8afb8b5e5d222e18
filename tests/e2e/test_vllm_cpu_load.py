"""A scenario against the real vLLM (the CPU build of vLLM 0.32.0 serving a tiny random Llama): every
prompt the harness builds through vLLM's own /tokenize is exactly `input_tokens` long as vLLM's usage
reports it, each request its own. Kept short: one level, few requests (the CPU engine is slow)."""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from tests.conftest import harness
from tests.e2e.test_vllm_cpu import VENV, vllm_inventory

pytestmark = pytest.mark.e2e

INPUT_TOKENS = 100


def test_every_prompt_is_exactly_input_tokens_as_vllm_counts_it(tmp_path, sshd):
    if not (VENV / ".ready").exists():
        pytest.skip(f"no real vLLM venv at {VENV}: run `make vllm-cpu`")
    inventory = vllm_inventory(tmp_path, sshd)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    playbook = tmp_path / "load.yaml"
    playbook.write_text(yaml.safe_dump({
        "name": "vllm-cpu-load", "hosts": "node1", "engine": "vllm",
        "model": {"path": str(VENV / "tiny-llama"), "served_name": "tiny"},
        # help_command "": the flag listing (a minute of vLLM imports) is test_vllm_cpu.py's to check
        "server": {"port": port, "startup_timeout_s": 600, "env": {"HF_HUB_OFFLINE": "1"}, "help_command": "",
                   "args": {"kv-cache-memory-bytes": "64M", "max-model-len": 512, "enforce-eager": True}},
        "configs": [{"name": "eager"}],
        "benchmark": {"warmup": 1, "scenarios": [{"name": "exact", "input_tokens": INPUT_TOKENS,
                                                  "output_tokens": 4, "concurrency": [2], "requests": 4}]},
        "slo": {"ttft_ms_p99": 600000},
        "profile": {"mode": "none"},
    }))
    results = tmp_path / "results"
    run = harness("sweep", playbook, "-i", inventory, "-o", results, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr
    (run_dir,) = results.glob("*/runs/eager-1")
    bench = json.loads((run_dir / "bench.json").read_text())
    (level,) = bench["levels"]
    assert level["prompt_source"] == "tokenize"
    assert level["completed"] == 4 and level["failed"] == 0
    assert level["prompt_tokens_reported"] == {str(INPUT_TOKENS): 4} and level["prompt_tokens_mismatches"] == 0
    requests = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in requests] == [INPUT_TOKENS] * 4
    assert all(r["output_tokens"] == 4 for r in requests)
    assert level["goodput_req_s"] > 0 and level["slo_met_requests"] == 4
