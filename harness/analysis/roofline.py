"""The memory-bandwidth roofline of decode: how fast could this configuration possibly produce tokens?

A decode step reads every active weight once (shared by the whole batch) and, for each sequence in the
batch, that sequence's KV cache. Nothing can make the step faster than moving those bytes at the
memory bandwidth of the GPUs the configuration spans, so

    weights_bytes   = active_params_b * 1e9 * bytes_per_weight
    kv_bytes        = concurrency * kv_bytes_per_token * context_tokens
    context_tokens  = prompt_tokens + output_tokens / 2     (the mean over the decode steps of a request:
                                                             the step emitting token k reads prompt + k-1)
    theoretical_ms  = (weights_bytes + kv_bytes) / (bandwidth_gbs * 1e9 * gpus) * 1e3

`theoretical_ms` is the shortest possible decode step, which is the shortest inter-token latency every
user sees at that concurrency; the batch as a whole then makes at most
`theoretical_tok_s = concurrency * 1000 / theoretical_ms` tokens per second.
`efficiency = theoretical_ms / measured ITL p50` (ITL p50 rather than TPOT: the median gap is a decode
step, whereas TPOT and the ITL mean also carry the prefill steps of other requests). For an MoE model
the bound uses the experts one token activates; a batch touches more of them, so at concurrency > 1 the
bound is optimistic, which is what a lower bound may be.

The GLM-5 campaign's numbers: GLM-5-NVFP4 (about 40 B of 744 B parameters active) on 8 RTX PRO 6000 Blackwell at
1,792 GB/s each. NVFP4 packs the routed experts at 0.5 B a weight plus an FP8 scale per 16 weights
(0.5625 B), but attention, the shared experts, the dense layers and the embeddings stay BF16 (2 B);
with about 40 % of the active weights in BF16 the effective figure is 1.16 B a weight, so 46.4 GB are
read a token and the step takes at least 46.4e9 / (8 * 1792e9) = 3.24 ms. They measured 97 ms: 3.3 %.

The GPU's bandwidth comes from, in order: the inventory's `gpu_bandwidth_gbs` (recorded in the run's
manifest under `host`), the name nvidia-smi reported (`facts.gpus[0].name`), the inventory's `gpu`.
"""

from __future__ import annotations

import re

from harness.results.models import BenchLevel, RunManifest

KNOWN_GPUS: list[tuple[str, float, tuple[str, ...]]] = [
    # (name, memory bandwidth per GPU in GB/s, other ways nvidia-smi spells it); first match wins
    ("GB200", 8000, ()),
    ("B200", 8000, ()),
    ("H200", 4800, ()),
    ("H100 SXM", 3350, ("H100 80GB HBM3",)),
    ("A100 80GB", 2039, ()),
    ("A100 40GB", 1555, ()),
    ("L40S", 864, ()),
    ("RTX PRO 6000 Blackwell", 1792, ()),
    ("RTX 4090", 1008, ()),
    ("MI300X", 5300, ()),
]


def _words(name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", name.lower()))


def gpu_bandwidth(name: str | None) -> tuple[str, float] | None:
    """(known name, GB/s) for a GPU name as nvidia-smi or the inventory writes it, e.g. "NVIDIA
    A100-SXM4-80GB" is the A100 80GB: every word of a known spelling must appear in the name."""
    if not name:
        return None
    words = _words(name)
    for known, gbs, spellings in KNOWN_GPUS:
        if any(_words(s) <= words for s in (known, *spellings)):
            return known, gbs
    return None


def _bandwidth(manifest: RunManifest) -> tuple[str | None, float, str] | None:
    """(GPU name, GB/s, where the figure came from) or None when the GPU is unknown."""
    host = manifest.host
    gpus = manifest.host_facts.gpus   # a fact of another shape is none: the inventory's GPU stands
    reported = gpus[0].name if gpus else None
    if host.gpu_bandwidth_gbs:
        return reported or host.gpu, float(host.gpu_bandwidth_gbs), "inventory gpu_bandwidth_gbs"
    for name, source in ((reported, "nvidia-smi"), (host.gpu, "inventory gpu")):
        known = gpu_bandwidth(name)
        if known:
            return name, known[1], f"{source}: {known[0]}"
    return None


def context_tokens(manifest: RunManifest, level: BenchLevel | None, prompt_tokens: int | None = None) -> float:
    """Mean tokens in a sequence's context over its decode steps: prompt + half the output."""
    if level is None:
        return 0.0
    bench = manifest.benchmark or {}
    asked = level.workload.input_tokens if level.workload else None   # a scenario's prompts
    prompt = asked or prompt_tokens or bench.get("prompt_tokens") or 0
    output = level.output_tokens / level.completed if level.completed and level.output_tokens \
        else bench.get("max_tokens") or 0
    return float(prompt) + float(output) / 2


def roofline_for(manifest: RunManifest, level: BenchLevel | None, prompt_tokens: int | None = None) -> dict | None:
    """The theoretical step time of one run at one benchmark level (None: batch 1, empty context) and,
    when the level was measured, the efficiency against it. None when the model or GPU facts are
    missing (the playbook's model section and the inventory say how to give them).

    `prompt_tokens` is bench.json's (it keeps the prompt length once, beside the levels); without it
    the playbook's benchmark.prompt_tokens is used."""
    model = manifest.model
    if model is None or not (model.active_params_b and model.bytes_per_weight):
        return None
    bw = _bandwidth(manifest)
    if bw is None:
        return None
    gpu, gbs, source = bw
    gpus = manifest.gpus_used or getattr(manifest.host, "gpus", None) or 1
    concurrency = level.concurrency if level else 1
    if concurrency is None:   # an open loop's level: its batch is whatever the arrivals made it
        return None
    context = context_tokens(manifest, level, prompt_tokens)
    weight_bytes = model.active_params_b * 1e9 * model.bytes_per_weight
    kv_bytes = concurrency * (model.kv_bytes_per_token or 0) * context
    theoretical_ms = (weight_bytes + kv_bytes) / (gbs * 1e9 * gpus) * 1e3
    measured = level.stat("itl_ms", "p50") if level else None
    return {"gpu": gpu, "bandwidth_gbs": gbs, "bandwidth_source": source, "gpus": gpus,
            "concurrency": concurrency, "context_tokens": context, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes, "theoretical_ms": theoretical_ms,
            "theoretical_tok_s": concurrency * 1e3 / theoretical_ms,
            "measured_itl_ms": measured, "efficiency": theoretical_ms / measured if measured else None}


def format_efficiency(efficiency: float | None) -> str:
    """3.24 / 97 reads "3.3%": one decimal below 10 %, two below 0.1 %, none from 10 % up."""
    if efficiency is None:
        return "-"
    pct = efficiency * 100
    return f"{pct:.2f}%" if pct < 0.1 else f"{pct:.1f}%" if pct < 10 else f"{pct:.0f}%"
