"""The command lines of the real launchers: SGLang 0.5.23's `launch_server` and vLLM 0.32.0's `vllm serve`.

Both real parsers are plain argparse with abbreviations allowed (the default), and the simulated ones
are too, so they fail the same way: an unknown flag is "unrecognized arguments" (exit 2), and a flag
that was split in two is an ambiguous prefix (sglang 0.5.20 removed `--cuda-graph-max-bs`, which now
"could match --cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill"). Also gone from 0.5.23 and
therefore rejected: `--enable-piecewise-cuda-graph` (0.5.14), `--enable-ep-moe` and
`--enable-deepep-moe` (0.5.5), `--nsa-*-backend` (0.5.20), `--stream-output`. Every choice list is the
one the real `--help` prints (SGLang 0.5.23; vLLM 0.32.0 `vllm serve --help=all`, and its
QuantizationMethods for `--quantization`, which it checks after parsing), so the simulator refuses no
value the real engine takes and takes none it refuses.

vLLM's FlexibleArgumentParser also accepts underscores for dashes and dotted config fields
(`--profiler-config.profiler=torch`, `-cc.cudagraph_mode=NONE`): `_vllm_argv` folds those into the
JSON value of the base flag, as upstream does.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from harness.sim.model import SimConfig

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.32.0"

SGLANG_KV_DTYPES = ["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"]
VLLM_KV_DTYPES = ["auto", "bfloat16", "float16", "fp8", "fp8_ds_mla", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                  "fp8_per_token_head", "int4_per_token_head", "int8_per_token_head", "nvfp4", "nvfp4_4over6",
                  "nvfp4_ds_mla", "turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                  "turboquant_k8v4", "ultraquant_4bit"]
SGLANG_QUANTIZATIONS = ["awq", "fp8", "mxfp8", "gptq", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf",
                        "modelopt", "modelopt_fp8", "modelopt_fp4", "nvfp4_online", "modelopt_mixed",
                        "petit_nvfp4", "w8a8_int8", "w8a8_fp8", "moe_wna16", "w4afp8", "mxfp4", "auto-round",
                        "auto-round-int8", "compressed-tensors", "modelslim", "mxfp_w4a8", "quark",
                        "quark_int4fp8_moe", "quark_mxfp4", "mlx_q4", "mlx_q8", "unquant", "humming"]
VLLM_QUANTIZATIONS = ["awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4",
                      "modelopt_mxfp8", "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin",
                      "humming", "compressed-tensors", "experts_int8", "quark", "moe_wna16", "torchao", "inc",
                      "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor", "fp8_per_block",
                      "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8"]
ATTENTION_BACKENDS = ["triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed", "fa3",
                      "fa4", "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla",
                      "tokenspeed_mla", "trtllm_mha", "hpc_ops", "minicpm_flashattn", "minicpm_flashinfer",
                      "aiter", "wave", "intel_amx", "ascend", "intel_xpu"]
MOE_A2A_BACKENDS = ["none", "deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "megamoe",
                    "deepep_v2", "pplx", "ascend_tp", "flashinfer_megamoe"]
ALL2ALL_BACKENDS = ["naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
                    "allgather_reducescatter", "flashinfer_all2allv", "flashinfer_nvlink_one_sided",
                    "flashinfer_nvlink_two_sided", "moonep", "mori_high_throughput", "mori_low_latency", "nixl_ep"]
PROFILER_FIELDS = {   # vLLM 0.32.0 config/profiler.py ProfilerConfig
    "profiler", "torch_profiler_dir", "torch_profiler_activities", "proton_profiler_dir", "proton_context",
    "proton_data", "proton_backend", "proton_mode", "proton_hook", "proton_output_format",
    "proton_graph_attribution", "torch_profiler_with_stack", "torch_profiler_with_flops",
    "torch_profiler_use_gzip", "torch_profiler_dump_cuda_time_total", "torch_profiler_record_shapes",
    "torch_profiler_with_memory", "capture_torch_profiler", "detailed_trace_annotation", "ignore_frontend",
    "delay_iterations", "max_iterations", "warmup_iterations", "active_iterations", "wait_iterations"}


def sglang_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch_server.py")
    add = p.add_argument

    def flag(*names: str) -> None:
        add(*names, action="store_true")

    # Model and tokenizer
    add("--model-path", "--model", required=True)
    add("--tokenizer-path")
    add("--tokenizer-mode", default="auto", choices=["auto", "slow"])
    flag("--skip-tokenizer-init")
    add("--load-format", default="auto")
    flag("--trust-remote-code")
    add("--dtype", default="auto")
    add("--context-length", type=int)
    add("--revision")
    add("--served-model-name")
    add("--chat-template")
    add("--reasoning-parser")
    add("--tool-call-parser")
    flag("--is-embedding")
    # HTTP server
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--api-key")
    flag("--skip-server-warmup")
    # Quantization and memory
    add("--quantization", choices=SGLANG_QUANTIZATIONS)
    add("--kv-cache-dtype", default="auto", choices=SGLANG_KV_DTYPES)
    add("--mem-fraction-static", type=float)
    add("--max-running-requests", type=int)
    add("--max-total-tokens", type=int)
    add("--chunked-prefill-size", type=int)
    add("--max-prefill-tokens", type=int, default=16384)
    add("--schedule-policy", default="fcfs")
    add("--schedule-conservativeness", type=float, default=1.0)
    add("--page-size", type=int)
    flag("--disable-radix-cache")
    flag("--disable-overlap-schedule")
    add("--stream-interval", type=int, default=1)
    add("--watchdog-timeout", type=float, default=300)
    add("--device", default="cuda")
    add("--base-gpu-id", type=int, default=0)
    # Parallelism
    add("--tp-size", "--tensor-parallel-size", type=int, default=1)
    add("--dp-size", "--data-parallel-size", type=int, default=1)
    add("--pp-size", "--pipeline-parallel-size", type=int, default=1)
    add("--ep-size", "--ep", "--expert-parallel-size", type=int, default=1)
    add("--attn-dp-size", type=int, default=1)
    flag("--enable-dp-attention")  # deprecated in 0.5.22 for --attn-dp-size, still accepted
    flag("--enable-dp-lm-head")
    add("--moe-a2a-backend", default="none", choices=MOE_A2A_BACKENDS)
    add("--moe-runner-backend", default="auto")
    add("--deepep-mode", default="auto", choices=["normal", "low_latency", "auto"])
    flag("--enable-eplb")
    add("--ep-num-redundant-experts", type=int, default=0)
    flag("--disable-shared-experts-fusion")
    # Multi-node
    add("--nnodes", type=int, default=1)
    add("--node-rank", type=int, default=0)
    add("--dist-init-addr")
    add("--dist-timeout", type=int)
    # Kernels
    add("--attention-backend", choices=ATTENTION_BACKENDS)
    add("--prefill-attention-backend", choices=ATTENTION_BACKENDS)
    add("--decode-attention-backend", choices=ATTENTION_BACKENDS)
    add("--dsa-prefill-backend")
    add("--dsa-decode-backend")
    add("--sampling-backend", choices=["flashinfer", "intel_xpu", "pytorch", "ascend"])
    add("--grammar-backend")
    flag("--enable-deterministic-inference")
    # Communication and overlap
    flag("--enable-mscclpp")
    flag("--enable-nccl-nvls")
    flag("--enable-symm-mem")
    flag("--disable-custom-all-reduce")
    flag("--enable-single-batch-overlap")
    flag("--enable-two-batch-overlap")
    # CUDA graphs (0.5.14+) and torch.compile
    flag("--disable-cuda-graph")  # deprecated alias: disables both phases
    flag("--disable-cuda-graph-padding")
    for phase in ("decode", "prefill"):
        add(f"--cuda-graph-backend-{phase}", choices=["full", "breakable", "disabled"])
        add(f"--cuda-graph-max-bs-{phase}", type=int)
        add(f"--cuda-graph-bs-{phase}", type=int, nargs="+")
    add("--cuda-graph-config")
    flag("--enable-torch-compile")
    add("--torch-compile-max-bs", type=int, default=32)
    # Speculative decoding
    add("--speculative-algorithm")
    add("--speculative-draft-model-path")
    add("--speculative-num-steps", type=int)
    add("--speculative-eagle-topk", type=int)
    add("--speculative-num-draft-tokens", type=int)
    # Logging and observability
    add("--log-level", default="info")
    add("--log-level-http")
    flag("--log-requests")
    add("--log-requests-level", type=int, default=2)
    flag("--enable-metrics")
    add("--decode-log-interval", type=int, default=40)
    flag("--show-time-cost")
    return p


def vllm_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm serve")
    add = p.add_argument
    boolean = argparse.BooleanOptionalAction

    add("model_tag", nargs="?")
    add("--model")
    add("--host")
    add("--port", type=int, default=8000)
    add("--uvicorn-log-level", default="info")
    add("--api-key", nargs="+")  # a list field upstream: any of several keys is accepted
    add("--served-model-name", nargs="+")
    add("--tokenizer")
    add("--trust-remote-code", action=boolean, default=False)
    add("--dtype", default="auto")
    add("--max-model-len", type=int)
    add("--load-format", default="auto")
    add("--download-dir")
    add("--revision")
    add("--generation-config", default="auto")
    add("--reasoning-parser")
    add("--tool-call-parser")
    add("--enable-auto-tool-choice", action=boolean, default=False)
    # Parallelism and multi-node
    add("--tensor-parallel-size", "-tp", type=int, default=1)
    add("--pipeline-parallel-size", "-pp", type=int, default=1)
    add("--data-parallel-size", "-dp", type=int, default=1)
    add("--data-parallel-size-local", "-dpl", type=int)
    add("--data-parallel-address", "-dpa")
    add("--data-parallel-rpc-port", "-dpp", type=int)
    add("--data-parallel-start-rank", "-dpr", type=int)
    add("--headless", action="store_true")
    add("--enable-expert-parallel", "-ep", action=boolean, default=False)
    add("--all2all-backend", choices=ALL2ALL_BACKENDS)
    add("--nnodes", "-n", type=int, default=1)
    add("--node-rank", "-r", type=int, default=0)
    add("--master-addr", default="127.0.0.1")
    add("--master-port", type=int, default=29501)
    add("--distributed-executor-backend")
    # Compilation and CUDA graphs
    add("--enforce-eager", action=boolean, default=False)
    add("--optimization-level", "-O", type=int, choices=[0, 1, 2, 3], default=2)
    add("--compilation-config", "-cc", type=_json_object, default={})
    # Memory, cache and scheduling
    add("--kv-cache-dtype", default="auto", choices=VLLM_KV_DTYPES)
    add("--quantization", "-q", choices=VLLM_QUANTIZATIONS)
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--block-size", type=int)
    add("--max-num-seqs", type=int)
    add("--max-num-batched-tokens", type=int)
    add("--enable-chunked-prefill", action=boolean)
    add("--enable-prefix-caching", action=boolean)
    add("--async-scheduling", action=boolean, default=False)
    add("--stream-interval", type=int, default=1)
    add("--attention-backend")
    add("--speculative-config", type=_json_object)
    add("--kv-transfer-config", type=_json_object)
    # Observability
    add("--profiler-config", type=_json_object, default={})
    add("--enable-log-requests", action=boolean, default=False)
    add("--disable-log-stats", action="store_true")
    add("--max-logprobs", type=int, default=20)
    return p


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _loose_value(text: str) -> Any:
    """`torch` stays a string, `true` and `3` become JSON values, as FlexibleArgumentParser reads them."""
    try:
        return json.loads(text)
    except ValueError:
        return text


_DOTTED = re.compile(r"^(--[a-z0-9_-]+|-cc)\.([A-Za-z0-9_.]+)(?:=(.*))?$", re.S)


def _vllm_argv(argv: Sequence[str]) -> list[str]:
    """Underscores to dashes in flag names, and dotted fields folded into one JSON flag each."""
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        m = _DOTTED.match(arg)
        if m:
            base, key, value = m.group(1).replace("_", "-"), m.group(2), m.group(3)
            if value is None:
                i += 1
                value = args[i] if i < len(args) else ""
            if base == "-cc":
                base = "--compilation-config"
            node = dotted.setdefault(base, {})
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = _loose_value(value)
        elif arg.startswith("--"):
            name, eq, value = arg.partition("=")
            out.append(name.replace("_", "-") + eq + value)
        else:
            out.append(arg)
        i += 1
    for base, value in dotted.items():
        out += [base, json.dumps(value)]
    return out


def parse(engine: str, argv: Sequence[str]) -> argparse.Namespace:
    """Parse a launcher command line; argparse exits 2 with the real message on a bad flag."""
    if engine == "sglang":
        parser = sglang_parser()
        ns = parser.parse_args(list(argv))
        if ns.attn_dp_size > 1 and ns.dp_size > 1:   # 0.5.23 arg_groups/parallel_hook.py handle_data_parallelism
            parser.error("--dp-size %d with --attn-dp-size %d: data-parallel replicas combined with attention "
                         "data parallelism are not supported." % (ns.dp_size, ns.attn_dp_size))
        return ns
    argv = list(argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = vllm_parser()
    ns = parser.parse_args(_vllm_argv(argv))
    unknown = set(ns.profiler_config) - PROFILER_FIELDS
    if unknown:
        parser.error("--profiler-config: unknown field(s): %s" % ", ".join(sorted(unknown)))
    ns.model = ns.model_tag or ns.model or "Qwen/Qwen3-0.6B"
    return ns


def sglang_dp(ns: argparse.Namespace) -> tuple[int, int]:
    """(attention-DP groups, data-parallel replicas) as SGLang 0.5.23 resolves them
    (`arg_groups/parallel_hook.py` _handle_deprecated_dp_attention): `--dp-size N --enable-dp-attention`
    is `--attn-dp-size N`; otherwise `--dp-size` counts replicas, each a TP group on GPUs of its own."""
    if ns.enable_dp_attention and ns.attn_dp_size == 1:
        return ns.dp_size, 1
    return ns.attn_dp_size, ns.dp_size


def sim_config(engine: str, ns: argparse.Namespace) -> SimConfig:
    """What the latency model needs from a parsed command line."""
    if engine == "sglang":
        attn_dp, replicas = sglang_dp(ns)
        return SimConfig(
            engine="sglang", tp=ns.tp_size, dp=attn_dp * replicas, pp=ns.pp_size, ep=ns.ep_size,
            mscclpp=ns.enable_mscclpp,
            cuda_graphs=not (ns.disable_cuda_graph or ns.cuda_graph_backend_decode == "disabled"),
            torch_compile=ns.enable_torch_compile,
            overlap=ns.enable_single_batch_overlap or ns.enable_two_batch_overlap,
            kv_cache_dtype=ns.kv_cache_dtype)
    cc = ns.compilation_config
    mode = str(cc.get("cudagraph_mode", "")).upper()
    eager = ns.enforce_eager or ns.optimization_level == 0
    return SimConfig(
        engine="vllm", tp=ns.tensor_parallel_size, dp=ns.data_parallel_size, pp=ns.pipeline_parallel_size,
        ep=ns.tensor_parallel_size * ns.data_parallel_size if ns.enable_expert_parallel else 1,
        cuda_graphs=not eager and mode != "NONE",
        torch_compile=not eager and cc.get("mode", cc.get("level", 3)) != 0,
        kv_cache_dtype=ns.kv_cache_dtype)


def served_names(engine: str, ns: argparse.Namespace) -> tuple[str, ...]:
    if engine == "sglang":
        return (ns.served_model_name or ns.model_path,)
    return tuple(ns.served_model_name or [ns.model])


def api_keys(engine: str, ns: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, ...]:
    """The keys a client may send as `Authorization: Bearer KEY`: SGLang's one `--api-key`; vLLM's
    `--api-key` (one or more), else its VLLM_API_KEY environment variable. Empty: no key asked."""
    if engine == "sglang":
        return (ns.api_key,) if ns.api_key else ()
    return tuple(k for k in (ns.api_key or [env.get("VLLM_API_KEY", "")]) if k)


def model_path(engine: str, ns: argparse.Namespace) -> str:
    return ns.model_path if engine == "sglang" else ns.model
