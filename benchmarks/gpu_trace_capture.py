"""Capture a real torch.profiler (Kineto) trace of a small decode loop on a CUDA GPU.

This is how tests/fixtures/real_trace/ was made (on an NVIDIA H200, PyTorch 2.11): each decode step
runs, per layer, the FP8 -> BF16 cast of a KV-cache slice (the GLM-5 campaign's 69% ghost, in miniature), a
decode attention, an RMSNorm and an MLP. It writes the trace (gzip'd) and torch's own
`key_averages()` table as JSON, so the analyzer can be checked against the profiler's own totals:

    python benchmarks/gpu_trace_capture.py OUT_DIR [--steps 8] [--layers 4]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=262144)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dev, hidden, heads, head_dim = "cuda", 2048, 16, 128
    torch.manual_seed(0)
    kv = torch.randn(a.layers, a.kv_tokens, heads * head_dim, device=dev).to(torch.float8_e4m3fn)
    w_qkv = torch.randn(hidden, heads * head_dim, device=dev, dtype=torch.bfloat16) / hidden ** 0.5
    w_up = torch.randn(hidden, 4 * hidden, device=dev, dtype=torch.bfloat16) / hidden ** 0.5
    w_down = torch.randn(4 * hidden, hidden, device=dev, dtype=torch.bfloat16) / (4 * hidden) ** 0.5
    norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    x = torch.randn(8, hidden, device=dev, dtype=torch.bfloat16)

    def step(h: torch.Tensor) -> torch.Tensor:
        for layer in range(a.layers):
            cache = kv[layer].to(torch.bfloat16)                     # the FP8 -> BF16 KV-cache cast
            q = (h @ w_qkv).view(-1, heads, head_dim)
            keys = cache[: 4096].view(-1, heads, head_dim)
            scores = torch.einsum("bhd,thd->bht", q, keys).softmax(-1)
            h = h + torch.einsum("bht,thd->bhd", scores, keys).reshape(h.shape[0], -1)[:, :hidden]
            h = torch.nn.functional.rms_norm(h, (hidden,), norm_w)
            h = h + torch.nn.functional.silu(h @ w_up) @ w_down
        return h

    for _ in range(3):
        step(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        h = x
        for i in range(a.steps):
            with record_function(f"decode_step_{i}"):
                h = step(h)
        torch.cuda.synchronize()
    trace = a.out / "decode.pt.trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    table = [{"name": e.key, "count": e.count, "device_time_total_us": e.device_time_total,
              "self_device_time_total_us": e.self_device_time_total, "cpu_time_total_us": e.cpu_time_total,
              "self_cpu_time_total_us": e.self_cpu_time_total}
             for e in prof.key_averages()]
    meta = {"steps": a.steps, "layers": a.layers, "kv_tokens": a.kv_tokens, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(), "key_averages": table}
    (a.out / "key_averages.json").write_text(json.dumps(meta, indent=1))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15))


if __name__ == "__main__":
    main()
