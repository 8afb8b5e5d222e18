"""The Kineto trace writer: valid gzip'd JSON with the kernels, launches and flows a real trace has."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

from harness.sim.model import LatencyModel, SimConfig
from harness.sim.trace import write_key_averages, write_trace


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
