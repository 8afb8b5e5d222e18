"""The analyzer against torch's own numbers, on real traces captured on an NVIDIA H200.

tests/fixtures/real_trace/ was made by benchmarks/gpu_trace_capture.py (PyTorch 2.11): a decode loop
whose FP8 -> BF16 KV-cache cast dominates, as in the GLM-5 campaign, with torch's `key_averages()`
table saved beside the trace.
"""

import json
from pathlib import Path

import pytest

from harness.analysis import analyze_path

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "real_trace"
SERVER = Path(__file__).resolve().parent.parent / "fixtures" / "transformers_trace"


@pytest.fixture(scope="module")
def analysis():
    return analyze_path(FIXTURE / "decode.pt.trace.json.gz", top=50)


@pytest.fixture(scope="module")
def torch_table():
    meta = json.loads((FIXTURE / "key_averages.json").read_text())
    return {row["name"]: row for row in meta["key_averages"]}


def test_every_top_kernel_matches_torchs_own_totals_within_one_percent(analysis, torch_table):
    for kernel in analysis["top"][:10]:
        row = torch_table[kernel["name"]]
        expected_ms = row["self_device_time_total_us"] / 1000
        assert kernel["total_ms"] == pytest.approx(expected_ms, rel=0.01), kernel["name"]
        assert kernel["count"] == row["count"]


def test_total_kernel_time_matches_torchs_self_cuda_total(analysis, torch_table):
    kernels = [r for r in torch_table.values() if r["self_device_time_total_us"] > 0
               and r["cpu_time_total_us"] == 0 and r["name"] != "Activity Buffer Request"
               and not r["name"].startswith("decode_step_")]
    assert analysis["total_gpu_ms"] == pytest.approx(sum(r["self_device_time_total_us"] for r in kernels) / 1000,
                                                     rel=0.01)


def test_the_fp8_to_bf16_cast_is_found_as_the_copy_that_dominates(analysis):
    top = analysis["top"][0]
    assert "direct_copy_kernel_cuda" in top["name"] and top["category"] == "copy"
    assert top["share"] > 0.9 and analysis["categories"]["copy"] > 0.9


def test_a_real_servers_capture_matches_torchs_table_on_its_top_kernels():
    """`transformers serve` (bf16, --compile) on an H200, profiled by profile.mode torch for 32 steps.
    transformers marks no steps of its own, so the 32 asked for are the steps."""
    analysis = analyze_path(SERVER / "serve.pt.trace.json.gz", top=10, requested_steps=32)
    assert (analysis["steps"], analysis["steps_source"], analysis["stages"]) == (32, "request", None)
    assert analysis["per_step_ms"] == pytest.approx(analysis["total_gpu_ms"] / 32, abs=1e-4)
    table = {row["name"]: row for row in json.loads((SERVER / "key_averages.json").read_text())["key_averages"]}
    assert analysis["top"] and analysis["top"][0]["category"] == "gemm"
    for kernel in analysis["top"][:5]:
        row = table[kernel["name"]]
        assert kernel["total_ms"] == pytest.approx(row["self_device_time_total_us"] / 1000, rel=0.01), kernel["name"]
        assert kernel["count"] == row["count"]
