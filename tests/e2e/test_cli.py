"""The smaller commands, run as a user would: check, bench, analyze."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from tests.conftest import harness
from tests.e2e.test_sweep import _free_port
from tests.remote_venv import make_remote_venv


@pytest.fixture
def sim_server(tmp_path):
    """A simulated SGLang server on a free port, healthy before the test starts."""
    yield from _sim("sglang", "--model-path", "/m")


@pytest.fixture
def sim_vllm(tmp_path):
    """A simulated vLLM server, which (like vLLM) refuses a model name it does not serve with a 404."""
    yield from _sim("vllm", "/m")


def _sim(engine: str, *model: str):
    port = _free_port()
    env = {"HARNESS_SIM_TIME_SCALE": "0.02", "HARNESS_SIM_STARTUP_S": "0.2", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.sim", engine, *model,
                             "--served-model-name", "tiny", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def test_bench_measures_any_openai_server_and_writes_both_files(tmp_path, sim_server):
    out = tmp_path / "b" / "bench.json"
    run = harness("bench", "--url", sim_server, "--model", "tiny", "--concurrency", "1,3", "--requests", "3",
                  "--max-tokens", "8", "-o", out)
    assert run.returncode == 0, run.stderr
    bench = json.loads(out.read_text())
    assert bench["schema"] == "harness.bench/1"
    assert [(lv["concurrency"], lv["completed"]) for lv in bench["levels"]] == [(1, 3), (3, 3)]
    assert all(lv["output_tokens"] == 24 for lv in bench["levels"])
    assert len((out.parent / "requests.jsonl").read_text().splitlines()) == 6
    assert "tiny" in run.stdout
    assert "concurrency 1: 3/3 done" in run.stderr and "concurrency 3: 3/3 done" in run.stderr  # never silent


@pytest.mark.parametrize("url, model, why", [
    (None, "no-such-model", "HTTP 404"),
    ("http://127.0.0.1:1", "tiny", "refused"),
], ids=["wrong-model-name", "nothing-listening"])
def test_bench_exits_1_and_says_why_when_requests_failed(tmp_path, sim_vllm, url, model, why):
    run = harness("bench", "--url", url or sim_vllm, "--model", model, "--requests", "2", "--warmup", "0",
                  "--max-tokens", "4", "-o", tmp_path / "bench.json")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "requests failed" in run.stderr and "2 of 2 requests failed" in run.stderr
    assert why in run.stderr.replace("\n", " ") and "Traceback" not in run.stderr


def test_bench_with_bad_levels_is_an_input_error(tmp_path):
    run = harness("bench", "--url", "http://127.0.0.1:1", "--model", "m", "--concurrency", "1,x")
    assert run.returncode == 2 and "--concurrency" in run.stderr and "Traceback" not in run.stderr


def test_check_reports_each_host_and_what_is_wrong_with_it(tmp_path, ssh_inventory):
    run = harness("check", "-i", ssh_inventory(), "--limit", "node1", "--engine", "sglang", "--port",
                  str(_free_port()))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "node1" in run.stdout and "ok" in run.stdout
    venv = make_remote_venv(tmp_path / "sglang-only", engines=("sglang",))
    run = harness("check", "-i", ssh_inventory(venv=str(venv)), "--limit", "node1", "--engine", "vllm")
    assert run.returncode == 1
    assert "cannot import vllm" in " ".join(run.stdout.split())


def test_check_with_no_engine_named_takes_any_engine_the_venv_imports(tmp_path, ssh_inventory):
    """No playbook, no --engine: a vLLM-only venv passes (and says vLLM is what it found), a venv with
    no engine fails naming every engine it tried, rather than failing a vLLM host for lacking SGLang."""
    venv = make_remote_venv(tmp_path / "one-engine", engines=("vllm",))
    run = harness("check", "-i", ssh_inventory(venv=str(venv)), "--limit", "node1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "vllm" in run.stdout and "cannot import" not in run.stdout
    bare = make_remote_venv(tmp_path / "no-engine", engines=())
    run = harness("check", "-i", ssh_inventory(venv=str(bare)), "--limit", "node1")
    said = " ".join(run.stdout.split())
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stdout + run.stderr
    assert "cannot import any engine (sglang, vllm): sglang: ModuleNotFoundError" in said, said
    assert "vllm: ModuleNotFoundError" in said, said


STAND_IN_NVIDIA_SMI = """#!/bin/sh
# prints what nvidia-smi 580 prints for these queries on a host with four H100s and nothing running
case "$1" in
  --query-gpu=*) for i in 0 1 2 3; do echo "$i, NVIDIA H100 80GB HBM3, 0, 81559"; done ;;
esac
"""


def test_check_fails_when_the_inventory_declares_other_gpus_than_the_host_has(tmp_path, remote_venv):
    """nvidia-smi cannot run here (no GPU): a stand-in prints its real output format for four H100s,
    while the inventory says eight H200s. The check must fail naming both differences."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(STAND_IN_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"gpu-box": {
        "transport": "local", "venv": str(remote_venv), "workdir": str(tmp_path / "work"), "gpus": 8,
        "gpu": "H200"}}}}))
    run = harness("check", "-i", inventory, "--engine", "sglang", "--port", str(_free_port()),
                  env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    said = " ".join(run.stdout.split())
    assert run.returncode == 1, run.stdout + run.stderr
    assert "declares gpus: 8, nvidia-smi shows 4" in said and "declares gpu: H200, nvidia-smi shows NVIDIA H100" in said


def test_check_names_the_process_holding_the_port(tmp_path, ssh_inventory, sim_server):
    port = sim_server.rsplit(":", 1)[1]
    run = harness("check", "-i", ssh_inventory(), "--limit", "node1", "--port", port)
    assert run.returncode == 1
    flat = " ".join(run.stdout.split())
    assert f"port {port} in use" in flat and "harness.sim" in flat


def test_analyze_reads_a_trace_and_bad_files_exit_2(tmp_path):
    from harness.sim.model import LatencyModel, SimConfig
    from harness.sim.trace import write_trace
    trace = tmp_path / "1-TP-0.trace.json.gz"
    write_trace(trace, model=LatencyModel(SimConfig()), steps=3)
    run = harness("analyze", trace, "--format", "json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["schema"] == "harness.analysis/1" and result["categories"]["copy"] > 0.5
    broken = tmp_path / "broken.trace.json.gz"
    broken.write_bytes(trace.read_bytes()[:200])
    run = harness("analyze", broken)
    assert run.returncode == 2 and "broken.trace.json.gz" in run.stderr and "Traceback" not in run.stderr


def test_every_command_answers_h_and_the_version_is_one_flag_away():
    assert harness("--version").stdout.strip().startswith("harness ")
    for command in ("sweep", "plan", "check", "bench", "analyze", "compare", "report", "status", "reproduce"):
        run = harness(command, "-h")
        assert run.returncode == 0 and "Usage:" in run.stdout, command
    sim = subprocess.run([sys.executable, "-m", "harness.sim", "--help"], capture_output=True, text=True)
    assert sim.returncode == 0 and "HARNESS_SIM_TIME_SCALE" in sim.stdout


def test_an_unknown_format_is_refused_not_ignored(tmp_path):
    run = harness("analyze", str(tmp_path), "--format", "yaml")
    assert run.returncode == 2 and "yaml" in run.stderr


def test_check_takes_a_playbook_and_checks_its_hosts_for_its_engine():
    """Right after `make demo`, `harness check playbooks/demo.yaml` checks localhost for the simulator
    (it used to look for SGLang and fail)."""
    run = harness("check", "playbooks/demo.yaml")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "localhost" in run.stdout and "ok" in run.stdout


def test_an_unknown_host_key_in_check_prints_the_command_that_pins_it_whole_at_80_columns(tmp_path, ssh_inventory):
    """In a table cell the fingerprint and the known_hosts path were cut with an ellipsis and the
    command broken over lines; under the table each problem is one line the terminal wraps."""
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    run = harness("check", "-i", ssh_inventory(known_hosts=str(empty)), "--limit", "node1", "--engine", "sim",
                  env={"COLUMNS": "80"})
    assert run.returncode == 1
    (line,) = [line for line in run.stdout.splitlines() if "ssh-keyscan" in line]
    assert line.startswith("node1: host_key: ") and "unknown host key" in line and line.endswith(f">> {empty}")
    assert re.search(r"SHA256:[A-Za-z0-9+/]{43}\b", line) and "…" not in run.stdout
