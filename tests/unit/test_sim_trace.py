"""The Kineto trace writer: valid gzip'd JSON with the kernels, launches and flows a real trace has."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest

from harness.sim.model import IDLE_STEP_MS, LatencyModel, SimConfig
from harness.sim.trace import Step, write_frontend_trace, write_key_averages, write_trace


def load(path: Path) -> dict:
    with gzip.open(path) as f:
        return json.load(f)


def kernels(trace: dict) -> list:
    return [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]


def gpu_idle_share(trace: dict) -> float:
    ks = sorted(kernels(trace), key=lambda e: e["ts"])
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    return 1 - sum(e["dur"] for e in ks) / span


def test_a_trace_has_kinetos_top_level_and_rank_info(tmp_path):
    path = tmp_path / "r.trace.json.gz"
    write_trace(path, model=LatencyModel(), steps=2, rank=3, world_size=8)
    trace = load(path)
    assert trace["schemaVersion"] == 1 and trace["baseTimeNanoseconds"] > 0
    assert trace["distributedInfo"]["rank"] == 3 and trace["distributedInfo"]["world_size"] == 8
    assert len(trace["deviceProperties"]) == 8
    ks = kernels(trace)
    assert ks and all(e["pid"] == 3 and {"correlation", "grid", "block", "stream"} <= e["args"].keys() for e in ks)
    assert any(e["ph"] == "M" for e in trace["traceEvents"])


def test_an_fp8_kv_cache_makes_the_cast_copy_kernel_dominate(tmp_path):
    path = tmp_path / "fp8.trace.json.gz"
    write_trace(path, model=LatencyModel(SimConfig(kv_cache_dtype="fp8_e4m3")), steps=2)
    time_by_name = Counter()
    for e in kernels(load(path)):
        time_by_name[e["name"]] += e["dur"]
    top, top_us = time_by_name.most_common(1)[0]
    assert "direct_copy_kernel_cuda" in top and "Float8_e4m3fn" in top
    assert top_us / sum(time_by_name.values()) > 0.6


def test_a_bf16_kv_cache_has_no_cast_and_mscclpp_replaces_nccl(tmp_path):
    path = tmp_path / "bf16.trace.json.gz"
    write_trace(path, model=LatencyModel(SimConfig(kv_cache_dtype="auto", mscclpp=True)), steps=1)
    names = {e["name"] for e in kernels(load(path))}
    assert not any("direct_copy_kernel_cuda" in n for n in names)
    assert any(n.startswith("void mscclpp::") for n in names) and not any(n.startswith("nccl") for n in names)


def test_cuda_graphs_launch_once_a_step_and_eager_mode_leaves_more_gpu_idle(tmp_path):
    graphs, eager = tmp_path / "g.trace.json.gz", tmp_path / "e.trace.json.gz"
    write_trace(graphs, model=LatencyModel(SimConfig(cuda_graphs=True)), steps=3)
    write_trace(eager, model=LatencyModel(SimConfig(cuda_graphs=False)), steps=3)
    g, e = load(graphs), load(eager)
    launches = Counter(ev["name"] for ev in g["traceEvents"] if ev.get("cat") == "cuda_runtime")
    assert launches["cudaGraphLaunch"] == 3 and launches["cudaLaunchKernel"] == 0
    eager_launches = [ev for ev in e["traceEvents"] if ev.get("name") == "cudaLaunchKernel"]
    assert len(eager_launches) == len(kernels(e))
    flows = [ev for ev in e["traceEvents"] if ev.get("cat") == "ac2g"]
    assert len(flows) == 2 * len(eager_launches)
    assert gpu_idle_share(e) > gpu_idle_share(g)


def test_vllm_traces_annotate_each_step(tmp_path):
    path = tmp_path / "v.trace.json.gz"
    write_trace(path, model=LatencyModel(SimConfig(engine="vllm")), steps=4, batch=8)
    names = [e["name"] for e in load(path)["traceEvents"] if e.get("cat") == "user_annotation"]
    assert names == ["execute_context_0(0)_generation_8(8)"] * 4


def test_key_averages_count_every_kind_of_step(tmp_path):
    m = LatencyModel(SimConfig(layers=2))
    mixed, decodes = tmp_path / "mixed.profiler_out.txt", tmp_path / "decodes.profiler_out.txt"
    write_key_averages(mixed, model=m, steps=[Step(prefill=1, prefill_tokens=8), Step(decode=1), Step()])
    write_key_averages(decodes, model=m, steps=2)

    def calls(path: Path) -> list:
        return sorted(line.split()[-1] for line in path.read_text().splitlines()[3:-2])
    assert calls(mixed) == calls(decodes)  # the idle step launches nothing; the prefill as many as a decode


def spans(trace: dict, cat: str) -> list:
    return [e for e in trace["traceEvents"] if e.get("cat") == cat]


@pytest.mark.parametrize("engine,steps,cpu,gpu", [
    ("vllm", [Step(prefill=1, prefill_tokens=16), Step(decode=1), Step()],
     ["execute_context_1(16)_generation_0(0)", "execute_context_0(0)_generation_1(1)",
      "execute_context_0(0)_generation_0(0)"],
     ["execute_context_1(16)_generation_0(0)", "execute_context_0(0)_generation_1(1)"]),
    ("sglang", [Step(prefill=2, prefill_tokens=1024), Step(decode=2), Step(decode=8)],
     ["step[EXTEND bs=2 toks=1024]", "step[DECODE bs=2]", "step[DECODE bs=8]"],
     ["step[EXTEND bs=2 toks=1024]", "step[DECODE bs=2]", "step[DECODE bs=8]"]),
])
@pytest.mark.parametrize("graphs", [True, False])
def test_every_step_sits_in_its_span_and_holds_its_kernels(tmp_path, engine, steps, cpu, gpu, graphs):
    path = tmp_path / "s.trace.json.gz"
    m = LatencyModel(SimConfig(engine=engine, layers=4, cuda_graphs=graphs))
    write_trace(path, model=m, steps=steps)
    trace = load(path)
    cpu_spans, gpu_spans = spans(trace, "user_annotation"), spans(trace, "gpu_user_annotation")
    assert [e["name"] for e in cpu_spans] == cpu and [e["name"] for e in gpu_spans] == gpu
    assert all(e["pid"] == 41000 and e["tid"] == 41000 for e in cpu_spans)
    assert all(e["pid"] == 0 and e["tid"] == 7 for e in gpu_spans)
    ks = kernels(trace)
    assert len(ks) == sum(len(m.step_kernels(1)) for s in steps if not s.idle)
    for k in ks:  # each kernel inside exactly one step's GPU span
        inside = [g for g in gpu_spans if g["ts"] - 1e-3 <= k["ts"] and k["ts"] + k["dur"] <= g["ts"] + g["dur"] + 1e-3]
        assert len(inside) == 1, k["name"]
    assert cpu_spans[0]["dur"] == pytest.approx(m.prefill_ms(steps[0].prefill_tokens) * 1000)
    if engine == "vllm":
        assert cpu_spans[-1]["dur"] == pytest.approx(IDLE_STEP_MS * 1000)


def test_a_prefill_step_keeps_the_decode_mix_of_kernels_stretched_to_its_length(tmp_path):
    m = LatencyModel(SimConfig(layers=4))
    busy = sum(k.us for k in m.prefill_kernels(1, 1000)) / 1000
    assert busy == pytest.approx(m.prefill_ms(1000) - m.step_ms(1)["idle"], rel=1e-6)
    assert [k.name for k in m.prefill_kernels(1, 1000)] == [k.name for k in m.step_kernels(1)]


def test_the_front_end_trace_holds_cpu_ops_only(tmp_path):
    path = tmp_path / "host_1.async_llm.1.pt.trace.json.gz"
    write_frontend_trace(path, pid=1, start_ns=1_700_000_000_000_000_000, end_ns=1_700_000_001_000_000_000,
                         requests=3)
    trace = load(path)
    assert {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"} == {"cpu_op"}
    assert "distributedInfo" not in trace and trace["baseTimeNanoseconds"] > 0


def test_pad_to_mb_grows_the_file_without_adding_gpu_work(tmp_path):
    small, big = tmp_path / "s.trace.json.gz", tmp_path / "b.trace.json.gz"
    write_trace(small, model=LatencyModel(), steps=1)
    size = write_trace(big, model=LatencyModel(), steps=1, pad_to_mb=0.5)
    assert size >= 0.5 * 1024 * 1024 and size == big.stat().st_size
    assert len(kernels(load(big))) == len(kernels(load(small)))


def test_a_path_without_gz_is_written_plain(tmp_path):
    path = tmp_path / "plain.pt.trace.json"
    write_trace(path, model=LatencyModel(), steps=1)
    assert json.loads(path.read_text())["traceEvents"]


def test_key_averages_table_ranks_kernels_by_self_cuda_time(tmp_path):
    path = tmp_path / "w.profiler_out.txt"
    write_key_averages(path, model=LatencyModel(), steps=10)
    lines = path.read_text().splitlines()
    assert "Self CUDA" in lines[1]
    assert lines[3].startswith("void at::native::unrolled_elementwise_kernel")
