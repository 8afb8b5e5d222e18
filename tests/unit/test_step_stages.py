"""Stages from the engines' own step spans, against a count made plainly here from the same traces.

Every expected figure below is computed in this file from the trace itself: json.load of the gzip,
the step spans classified by regular expressions written here (from each engine's own code, version
cited), each kernel given to the GPU step span whose interval holds its start, sums. Nothing of
harness.analysis or harness.engines goes into an expectation.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from rich.console import Console

import harness.analysis as analysis
from harness.analysis import analyze_path, summary
from harness.engines import StepSpans
from harness.report import compare
from harness.report.analysis_view import render_analysis
from harness.results import RunLayout, RunManifest, RunResult

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
MS = 6e-5
"""analysis.json rounds milliseconds to 4 places."""

VLLM_STEP = re.compile(r"execute_context_(\d+)\(\d+\)_generation_(\d+)\(\d+\)")
"""vLLM 0.26.0 and 0.32.0 (v1 gpu_model_runner): `execute_context_{n}({tokens})_generation_{m}({tokens})`
around each engine step, n requests in prefill and m in decode."""


def vllm_stage(name: str) -> str | None:
    """Any request in prefill makes a prefill step (mixed ones too); decode alone a decode step;
    neither an idle step, which is no step to count."""
    m = VLLM_STEP.fullmatch(name)
    if not m:
        return None
    prefill, decode = int(m[1]), int(m[2])
    return "prefill" if prefill else "decode" if decode else None


def count_plainly(path: Path) -> dict:
    """Steps, their wall time and the kernel time inside their GPU spans, per stage, the slow way."""
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    steps, wall_us, spans = Counter(), Counter(), []
    for e in events:
        stage = vllm_stage(e.get("name", "")) if e.get("cat") in ("user_annotation", "gpu_user_annotation") else None
        if stage and e["cat"] == "user_annotation":
            steps[stage] += 1
            wall_us[stage] += e["dur"]
        elif stage:
            spans.append((e["pid"], e["ts"], e["ts"] + e["dur"], stage))
    kernel_us, by_name, launches, total_us = Counter(), defaultdict(Counter), defaultdict(Counter), 0.0
    for e in events:
        if e.get("cat") in GPU_CATS:
            total_us += e["dur"]
            stage = next((s for pid, start, end, s in spans if pid == e["pid"] and start <= e["ts"] <= end), None)
            if stage:
                kernel_us[stage] += e["dur"]
                by_name[stage][e["name"]] += e["dur"]
                launches[stage][e["name"]] += 1
    last_kernel = max((i for i, e in enumerate(events) if e.get("cat") in GPU_CATS), default=None)
    first_span = min((i for i, e in enumerate(events) if e.get("cat") == "gpu_user_annotation"), default=None)
    return {"steps": dict(steps), "wall_us": wall_us, "kernel_us": kernel_us, "by_name": by_name,
            "launches": launches, "total_us": total_us, "gpu_spans": len(spans),
            "spans_after_kernels": first_span is not None and first_span > last_kernel}


VLLM_TRACES = [
    # (path under tests/fixtures, the trace file in it, its steps by stage as its README records them)
    pytest.param("vllm_h200/graphs", "rank0.1796125788551951697.pt.trace.json.gz",
                 {"prefill": 1, "decode": 9}, id="vllm-0.26.0-h200-cuda-graphs"),
    pytest.param("vllm_h200/eager-kv-fp8", "rank0.1796125880841321122.pt.trace.json.gz",
                 {"prefill": 2, "decode": 8}, id="vllm-0.26.0-h200-eager-fp8-kv"),
    pytest.param("vllm_cpu", "rank0.1796123775377792795.pt.trace.json.gz",
                 {"prefill": 1, "decode": 5}, id="vllm-0.32.0-cpu-no-kernels"),
]


@pytest.fixture(scope="module")
def analyzed() -> dict:
    """path -> (analysis, plain count), each made once."""
    cache: dict = {}

    def get(path: str, trace: str) -> tuple[dict, dict]:
        if path not in cache:
            file = FIXTURES / path if path.endswith(".gz") else FIXTURES / path / trace
            cache[path] = analyze_path(FIXTURES / path, top=10_000), count_plainly(file)
        return cache[path]
    return get


@pytest.mark.parametrize("path, trace, steps", VLLM_TRACES)
def test_each_stage_counts_the_traces_own_cpu_step_spans(analyzed, path, trace, steps):
    result, plain = analyzed(path, trace)
    assert plain["steps"] == steps
    assert {stage: s["steps"] for stage, s in result["stages"].items()} == steps
    assert list(result["stages"])[0] == "decode"
    for stage, s in result["stages"].items():
        assert s["step_ms"] == pytest.approx(plain["wall_us"][stage] / steps[stage] / 1000, abs=MS)


@pytest.mark.parametrize("path, trace, steps", VLLM_TRACES)
def test_each_stage_holds_the_kernels_that_started_inside_its_gpu_spans(analyzed, path, trace, steps):
    result, plain = analyzed(path, trace)
    has_kernels = plain["total_us"] > 0
    assert plain["spans_after_kernels"] == has_kernels  # Kineto writes the GPU spans after every kernel
    for stage, s in result["stages"].items():
        assert s["total_gpu_ms"] == pytest.approx(plain["kernel_us"][stage] / 1000, abs=MS)
        assert {k["name"]: k["count"] for k in s["top"]} == dict(plain["launches"][stage])
        for k in s["top"]:
            assert k["total_ms"] == pytest.approx(plain["by_name"][stage][k["name"]] / 1000, abs=MS), k["name"]
        if has_kernels:
            assert s["per_step_ms"] == pytest.approx(plain["kernel_us"][stage] / steps[stage] / 1000, abs=MS)
            assert sum(s["category_ms"].values()) == pytest.approx(s["per_step_ms"], abs=MS * 8)
        else:
            assert (s["per_step_ms"], s["category_ms"], s["top"]) == (None, None, [])
    outside_us = plain["total_us"] - sum(plain["kernel_us"].values())
    assert result["outside_steps_ms"] == (pytest.approx(outside_us / 1000, abs=MS) if has_kernels else None)


@pytest.mark.parametrize("path, trace, steps", VLLM_TRACES)
def test_the_headline_figures_are_the_decode_stages(analyzed, path, trace, steps):
    result, _ = analyzed(path, trace)
    decode = result["stages"]["decode"]
    assert (result["steps"], result["steps_source"]) == (steps["decode"], "trace")
    assert (result["per_step_ms"], result["category_ms"]) == (decode["per_step_ms"], decode["category_ms"])


def test_most_kernel_time_of_a_real_h200_trace_lies_inside_step_spans(analyzed):
    """vLLM 0.26.0 with CUDA graphs, a capture of max_iterations 10: nearly all kernel time is inside steps."""
    result, _ = analyzed(*VLLM_TRACES[0].values[:2])
    assert result["outside_steps_ms"] < 0.1 * result["total_gpu_ms"]


def test_vllms_api_front_end_trace_is_no_rank(analyzed):
    """vLLM 0.32.0 on CPU writes `{host}_{pid}.async_llm.{ns}.pt.trace.json.gz` beside the worker's:
    no kernels, no steps; counted as a rank it would halve every mean."""
    assert any(".async_llm." in p.name for p in (FIXTURES / "vllm_cpu").iterdir())
    result, _ = analyzed(*VLLM_TRACES[2].values[:2])
    assert [(f["name"], f["rank"]) for f in result["files"]] == [("rank0.1796123775377792795.pt.trace.json.gz", 0)]
    assert (result["steps"], result["stages"]["prefill"]["steps"]) == (5, 1)


def test_byte_ranges_read_by_worker_processes_join_into_the_same_stages(tmp_path, monkeypatch, analyzed):
    """Kernels in one range, their GPU spans in another: the kernels' names must join by name."""
    plain = tmp_path / "graphs.rank0.pt.trace.json"
    fixture = FIXTURES / "vllm_h200/graphs/rank0.1796125788551951697.pt.trace.json.gz"
    with gzip.open(fixture) as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    monkeypatch.setattr(analysis, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(analysis, "RANGE_MIN_BYTES", 0)
    monkeypatch.setattr(analysis.os, "cpu_count", lambda: 3)
    assert len(analysis._ranges(plain, 3)) == 3
    split = analyze_path(plain, top=10_000)
    serial, _ = analyzed(*VLLM_TRACES[0].values[:2])
    assert without_names(split) == without_names(serial)


def without_names(result: dict) -> dict:
    """The figures alone, not the file's name (plain here, gzip'd in the fixture)."""
    return {k: v for k, v in result.items() if k != "files"} | {
        "ranks": [{k: v for k, v in r.items() if k != "file"} for r in result["ranks"]]}


def test_the_views_show_the_decode_steps_and_say_so(tmp_path, analyzed):
    result, _ = analyzed(*VLLM_TRACES[0].values[:2])
    console = Console(record=True, width=160)
    console.print(render_analysis(result, top=5))
    out = console.export_text()
    for expected in ("9 decode steps in the trace", "0.882 GPU ms/step", "GPU kernels in decode steps",
                     "GPU time in decode steps", "prefill", "outside every step"):
        assert expected in out
    run = tmp_path / "runs" / "graphs-0001"
    run.mkdir(parents=True)
    (run / "analysis.json").write_text(json.dumps(result))
    manifest = RunManifest(run_id="graphs-0001", sweep_id="s", config={"name": "graphs"}, status="ok")
    row = compare._analysis([compare.Sample(RunResult(RunLayout(run), manifest, None), None)])
    decode = result["stages"]["decode"]
    assert row == {"stage": "decode", "categories": decode["categories"], "category_ms": decode["category_ms"],
                   "top": decode["top"][:3], "shares": {k["name"]: k["share"] for k in decode["top"]},
                   "per_step_ms": decode["per_step_ms"],
                   "idle_ms": pytest.approx(decode["step_ms"] - decode["per_step_ms"])}
    console.print(compare._kernel_table([{"config": "graphs", "analysis": row}], None))
    assert "decode" in console.export_text().split("GPU time by category")[-1]


# ---------------------------------------------------------------- SGLang-shaped spans

GEMM = "nvjet_tst_128x64_64x8_1x1_v_bz_TNT"
MEMCPY = "Memcpy DtoD (Device -> Device)"
SGLANG_STEPS = [
    # (span name as SGLang 0.5.23 names a forward step, utils/profile_utils.py build_step_span_name:
    #  `step[EXTEND bs={bs} toks={n}]`, else `step[{mode} bs={bs}]`; its stage; kernel us inside on rank 0)
    ("step[EXTEND bs=1 toks=16]", "prefill", 70.0),
    ("step[DECODE bs=8]", "decode", 30.0),
    ("step[DECODE bs=8]", "decode", 31.0),
    ("step[MIXED bs=4]", "prefill", 52.0),
    ("step[DECODE bs=8]", "decode", 29.0),
    ("step[IDLE bs=0]", None, 5.0),            # a DP rank with nothing to run: no step
    ("sglang_sample", None, 11.0),             # another record_function: no step at all
]
BETWEEN_STEPS_US = 17.0                       # a copy outside every span


def sglang_rank(directory: Path, tp: int, scale: float) -> None:
    """One rank's trace, SGLang 0.5.23's name for it; its kernels take `scale` times rank 0's time."""
    events = []
    for i, (name, _, us) in enumerate(SGLANG_STEPS):
        base = 1000.0 * i
        events += [{"ph": "X", "cat": "user_annotation", "name": name, "pid": 9, "tid": 9, "ts": base, "dur": 200.0},
                   {"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": 7, "ts": base + 50,
                    "dur": us * scale},
                   {"ph": "X", "cat": "kernel", "name": GEMM, "pid": 0, "tid": 7, "ts": base + 50, "dur": us * scale}]
    events.append({"ph": "X", "cat": "gpu_memcpy", "name": MEMCPY, "pid": 0, "tid": 7, "ts": 900.0,
                   "dur": BETWEEN_STEPS_US * scale})
    with gzip.open(directory / f"1700000000.1-TP-{tp}.trace.json.gz", "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)


def test_sglang_step_spans_split_into_decode_and_prefill_with_per_rank_means(tmp_path):
    scales = (1.0, 2.0)                        # rank 1's kernels take twice as long
    for tp, scale in enumerate(scales):
        sglang_rank(tmp_path, tp, scale)
    result = analyze_path(tmp_path)
    ranks = len(scales)
    for stage in ("decode", "prefill"):
        rows = [us for _, s, us in SGLANG_STEPS if s == stage]
        kernel_us = sum(rows) * sum(scales)    # over both ranks
        got = result["stages"][stage]
        assert (got["steps"], got["step_ms"]) == (len(rows), 0.2)
        assert got["total_gpu_ms"] == pytest.approx(kernel_us / ranks / 1000, abs=MS)
        assert got["per_step_ms"] == pytest.approx(kernel_us / (len(rows) * ranks) / 1000, abs=MS)
        assert [(k["name"], k["count"]) for k in got["top"]] == [(GEMM, len(rows))]
    assert list(result["stages"]) == ["decode", "prefill"]
    outside_us = (sum(us for _, s, us in SGLANG_STEPS if s is None) + BETWEEN_STEPS_US) * sum(scales)
    assert result["outside_steps_ms"] == pytest.approx(outside_us / ranks / 1000, abs=MS)
    assert (result["steps"], result["steps_source"]) == (3, "trace")
    assert result["per_step_ms"] == result["stages"]["decode"]["per_step_ms"]


def test_a_stage_is_whatever_the_engines_rules_call_it(tmp_path, monkeypatch):
    """The analysis has no stage names of its own: a rule's "verify" comes out as a stage."""
    rules = [StepSpans(prefix="step[", stages=((r"^step\[TARGET_VERIFY ", "verify"),))]
    monkeypatch.setattr(summary, "step_span_rules", lambda: rules)
    events = [{"ph": "X", "cat": "user_annotation", "name": "step[TARGET_VERIFY bs=8]", "pid": 9, "tid": 9,
               "ts": 0.0, "dur": 100.0},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "step[TARGET_VERIFY bs=8]", "pid": 0, "tid": 7,
               "ts": 10.0, "dur": 40.0},
              {"ph": "X", "cat": "kernel", "name": GEMM, "pid": 0, "tid": 7, "ts": 10.0, "dur": 40.0}]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    result = analyze_path(path, requested_steps=4)
    assert list(result["stages"]) == ["verify"]
    assert (result["stages"]["verify"]["steps"], result["stages"]["verify"]["per_step_ms"]) == (1, 0.04)
    assert (result["steps"], result["steps_source"], result["per_step_ms"]) == (4, "request", 0.01)


# ---------------------------------------------------------------- no step spans


def test_a_trace_without_engine_step_spans_falls_back_to_the_count_asked_for():
    """benchmarks/gpu_trace_capture.py's decode loop (torch 2.11, H200) marks `decode_step_{i}`:
    no engine's step spans, so the 8 steps asked for divide all kernel time."""
    trace = FIXTURES / "real_trace/decode.pt.trace.json.gz"
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    total_us = sum(e["dur"] for e in events if e.get("cat") in GPU_CATS)
    asked = analyze_path(trace, requested_steps=8)
    assert (asked["steps"], asked["steps_source"], asked["stages"]) == (8, "request", None)
    assert asked["per_step_ms"] == pytest.approx(total_us / 8 / 1000, abs=MS)
    assert sum(asked["category_ms"].values()) == pytest.approx(asked["per_step_ms"], abs=MS * 8)
    unasked = analyze_path(trace)
    assert (unasked["steps"], unasked["steps_source"], unasked["per_step_ms"]) == (None, None, None)
