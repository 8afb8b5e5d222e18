"""The simulated profilers in process: file names, session states, step bounds and the spans written.

Each case drives the profiler the way the scheduler and the HTTP routes do (start, one `on_step` per
forward step, stop) with a two-layer model, so a trace is a few kilobytes and a case takes
milliseconds. The shapes are those of vLLM 0.26.0 / 0.32.0 and SGLang 0.5.23 (harness/sim/profiler.py).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from harness.sim.model import LatencyModel, SimConfig
from harness.sim.profiler import VLLM_ACTIVE, SglangProfiler, VllmProfiler, sglang_rank_names, vllm_worker_names
from harness.sim.trace import Step, step_span_name

PREFILL, DECODE, IDLE = Step(prefill=1, prefill_tokens=4), Step(decode=1), Step()
TRAFFIC = [PREFILL] + [DECODE] * 9
"""One request of ten tokens: a prefill step, then nine decode steps."""


def model(engine: str) -> LatencyModel:
    return LatencyModel(SimConfig(engine=engine, tp=2, kv_cache_dtype="auto", layers=2))


def vllm(out: Path, *, tp: int = 2, dp: int = 1, ep: bool = False, **config: Any) -> VllmProfiler:
    config = {"profiler": "torch", "torch_profiler_dir": str(out), "ignore_frontend": True, **config}
    return VllmProfiler(config=config, model=model("vllm"), world_size=tp * dp, trace_mb=None, fail=False,
                        log=lambda m: None, workers=vllm_worker_names(tp=tp, dp=dp, pp=1, expert_parallel=ep))


def sglang(tp: int = 1) -> SglangProfiler:
    return SglangProfiler(model=model("sglang"), ranks=sglang_rank_names(tp=tp, dp=1, pp=1, ep=1), world_size=tp,
                          trace_mb=None, fail=False, log=lambda m: None)


def drive(make, calls: Sequence[Any]) -> list[Any]:
    """Run `calls` against a profiler built inside the loop: ("start", body), ("stop",) or a Step."""
    async def go() -> list[Any]:
        p, replies = make(), []
        for call in calls:
            if isinstance(call, Step):
                await p.on_step(call)
            elif call[0] == "start":
                replies.append(await p.start(call[1]))
            else:
                replies.append(await p.stop())
        return replies
    return asyncio.run(go())


def shapes(directory: Path) -> list[str]:
    """The directory's file names with the nanosecond stamps and the front end's host_pid abstracted."""
    names = []
    for p in sorted(directory.iterdir()):
        name = re.sub(r"\.\d{16,}\.", ".NS.", p.name)
        names.append(re.sub(r"^.*_\d+\.async_llm\.", "HOST_PID.async_llm.", name))
    return sorted(names)


def spans(path: Path) -> dict[str, list[str]]:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return {cat: [e["name"] for e in events if e.get("cat") == cat] for cat in ("user_annotation",
                                                                               "gpu_user_annotation")}


def only(directory: Path, pattern: str) -> Path:
    (path,) = [p for p in directory.iterdir() if re.search(pattern, p.name)]
    return path


# ---- vLLM: file names -----------------------------------------------------------------------

@pytest.mark.parametrize("case,profiler,body,expected", [
    ("dense", dict(tp=2), {}, [
        "rank0.NS.pt.trace.json.gz", "rank0.profiler_out.txt", "rank1.NS.pt.trace.json.gz",
        "rank1.profiler_out.txt"]),
    ("expert parallel", dict(tp=2, ep=True), {}, [
        "dp0_pp0_tp0_dcp0_ep0_rank0.NS.pt.trace.json.gz", "dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt",
        "dp0_pp0_tp1_dcp0_ep1_rank1.NS.pt.trace.json.gz", "dp0_pp0_tp1_dcp0_ep1_rank1.profiler_out.txt"]),
    ("expert parallel over dp", dict(tp=1, dp=2, ep=True), {}, [
        "dp0_pp0_tp0_dcp0_ep0_rank0.NS.pt.trace.json.gz", "dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt",
        "dp1_pp0_tp0_dcp0_ep1_rank1.NS.pt.trace.json.gz", "dp1_pp0_tp0_dcp0_ep1_rank1.profiler_out.txt"]),
    ("prefix, dense", dict(tp=1), {"profile_prefix": "warm"}, [
        "warm_rank0.NS.pt.trace.json.gz", "warm_rank0.profiler_out.txt"]),
    ("prefix, expert parallel", dict(tp=1, ep=True), {"profile_prefix": "warm"}, [
        "warm_dp0_pp0_tp0_dcp0_ep0_rank0.NS.pt.trace.json.gz", "warm_dp0_pp0_tp0_dcp0_ep0_rank0.profiler_out.txt"]),
    ("front end on", dict(tp=1, ignore_frontend=False), {}, [
        "HOST_PID.async_llm.NS.pt.trace.json.gz", "HOST_PID.async_llm.profiler_out.txt",
        "rank0.NS.pt.trace.json.gz", "rank0.profiler_out.txt"]),
    ("front end on, no gzip", dict(tp=1, ignore_frontend=False, torch_profiler_use_gzip=False), {}, [
        "HOST_PID.async_llm.NS.pt.trace.json", "HOST_PID.async_llm.profiler_out.txt",
        "rank0.NS.pt.trace.json", "rank0.profiler_out.txt"]),
])
def test_vllm_file_names(tmp_path, case, profiler, body, expected):
    drive(lambda: vllm(tmp_path, **profiler), [("start", body), *TRAFFIC[:3], ("stop",)])
    assert shapes(tmp_path) == expected, case


def test_the_front_end_writes_at_stop_only_and_holds_cpu_ops_and_no_rank(tmp_path):
    async def go() -> list[str]:
        p = vllm(tmp_path, tp=1, ignore_frontend=False, max_iterations=2)
        await p.start({})
        for step in TRAFFIC[:4]:
            await p.on_step(step)
        before = shapes(tmp_path)
        await p.stop()
        return before
    before = asyncio.run(go())
    assert before == ["rank0.NS.pt.trace.json.gz", "rank0.profiler_out.txt"]
    with gzip.open(only(tmp_path, r"\.async_llm\..*\.gz$")) as f:
        trace = json.load(f)
    cats = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
    assert cats == {"cpu_op"} and "distributedInfo" not in trace


# ---- vLLM: the session -------------------------------------------------------------------------

CONFLICT = (409, {"error": {"message": VLLM_ACTIVE, "type": "Conflict", "param": None, "code": 409}})


@pytest.mark.parametrize("case,calls,statuses", [
    ("a second start while recording", [("start", {}), ("start", {}), ("stop",), ("start", {}), ("stop",)],
     [200, CONFLICT, 200, 200, 200]),
    ("a second start after the workers stopped themselves",
     [("start", {"max_iterations": 2}), *TRAFFIC[:4], ("start", {}), ("stop",), ("start", {}), ("stop",)],
     [200, CONFLICT, 200, 200, 200]),
    ("stop with nothing active", [("stop",), ("start", {}), ("stop",), ("stop",)], [200, 200, 200, 200]),
])
def test_vllm_allows_one_session_until_stop(tmp_path, case, calls, statuses):
    replies = drive(lambda: vllm(tmp_path), calls)
    assert [r if r[0] == 409 else r[0] for r in replies] == statuses, case


def test_a_session_whose_workers_stopped_themselves_writes_nothing_more_at_stop(tmp_path):
    drive(lambda: vllm(tmp_path, tp=2), [("start", {"max_iterations": 2}), *TRAFFIC, ("stop",)])
    assert len(list(tmp_path.glob("*.pt.trace.json.gz"))) == 2


# ---- vLLM: step bounds and spans ---------------------------------------------------------------

def vllm_span(step: Step) -> str:
    return f"execute_context_{step.prefill}({step.prefill_tokens})_generation_{step.decode}({step.decode})"


STEPS = [PREFILL, DECODE, DECODE, IDLE, PREFILL, Step(decode=2), Step(decode=2), Step(decode=1), IDLE, IDLE]
"""Two requests, the second arriving while the first decodes; vLLM's idle steps between them."""


@pytest.mark.parametrize("case,flags,body,recorded", [
    ("max_iterations from the launch flag", {"max_iterations": 3}, {}, STEPS[:3]),
    ("max_iterations from the body", {}, {"max_iterations": 4}, STEPS[:4]),
    ("the body over the flag", {"max_iterations": 3}, {"max_iterations": 6}, STEPS[:6]),
    ("delay_iterations from the flags", {"max_iterations": 2, "delay_iterations": 4}, {}, STEPS[4:6]),
    ("delay_iterations from the body", {}, {"max_iterations": 3, "delay_iterations": 1}, STEPS[1:4]),
    ("no bound: every step until stop", {}, {}, STEPS),
])
def test_vllm_records_the_steps_it_was_asked_for_each_in_its_span(tmp_path, case, flags, body, recorded):
    drive(lambda: vllm(tmp_path, tp=1, **flags), [("start", body), *STEPS, ("stop",)])
    found = spans(only(tmp_path, r"\.pt\.trace\.json\.gz$"))
    assert found["user_annotation"] == [vllm_span(s) for s in recorded], case
    assert found["gpu_user_annotation"] == [vllm_span(s) for s in recorded if not s.idle], case


@pytest.mark.parametrize("body", [{"max_iterations": "3"}, {"max_iterations": -1}, {"delay_iterations": 1.5}])
def test_vllm_refuses_a_bound_that_is_no_count(tmp_path, body):
    ((status, answer),) = drive(lambda: vllm(tmp_path), [("start", body)])
    assert status == 400 and answer["error"]["code"] == 400


def test_the_cuda_profiler_opens_sessions_and_writes_nothing(tmp_path):
    def make() -> VllmProfiler:
        return VllmProfiler(config={"profiler": "cuda", "max_iterations": 2}, model=model("vllm"), world_size=1,
                            trace_mb=None, fail=False, log=lambda m: None,
                            workers=vllm_worker_names(tp=1, dp=1, pp=1, expert_parallel=False))
    replies = drive(make, [("start", {}), *TRAFFIC, ("start", {}), ("stop",)])
    assert [r[0] for r in replies] == [200, 409, 200] and list(tmp_path.iterdir()) == []


# ---- SGLang: spans -----------------------------------------------------------------------------

@pytest.mark.parametrize("case,body,steps,files", [
    ("num_steps with the prefill in the window", {"num_steps": 3}, TRAFFIC,
     {"": ["step[EXTEND bs=1 toks=4]", "step[DECODE bs=1]", "step[DECODE bs=1]"]}),
    ("decode steps of a larger batch", {"num_steps": 2}, [Step(decode=8)] * 5, {"": ["step[DECODE bs=8]"] * 2}),
    ("prefill of several requests", {"num_steps": 1}, [Step(prefill=2, prefill_tokens=1024)],
     {"": ["step[EXTEND bs=2 toks=1024]"]}),
    ("by stage", {"num_steps": 4, "profile_by_stage": True}, TRAFFIC,
     {"-EXTEND": ["step[EXTEND bs=1 toks=4]"], "-DECODE": ["step[DECODE bs=1]"] * 3}),
])
def test_sglang_records_num_steps_each_in_its_span(tmp_path, case, body, steps, files):
    drive(sglang, [("start", {"output_dir": str(tmp_path), "activities": ["CPU", "GPU"], **body}), *steps])
    for stage, names in files.items():
        found = spans(only(tmp_path, rf"-TP-0{stage}\.trace\.json\.gz$"))
        assert found == {"user_annotation": names, "gpu_user_annotation": names}, case


@pytest.mark.parametrize("step,name", [
    (Step(prefill=1, prefill_tokens=1024), "step[EXTEND bs=1 toks=1024]"),
    (Step(decode=8), "step[DECODE bs=8]"),
    (Step(prefill=1, prefill_tokens=512, decode=8), "step[MIXED bs=9]"),
    (Step(), "step[IDLE bs=0]"),
])
def test_sglang_span_names(step, name):
    assert step_span_name("sglang", step) == name


def test_sglang_names_files_per_rank_as_before(tmp_path):
    drive(lambda: sglang(tp=2), [("start", {"output_dir": str(tmp_path), "num_steps": 1}), DECODE])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [re.sub(r"^\d+\.\d+", "ID", n) for n in names] == ["ID-TP-0.trace.json.gz", "ID-TP-1.trace.json.gz"]
