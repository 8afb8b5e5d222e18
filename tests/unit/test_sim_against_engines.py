"""The simulator's launch flags against the real engines' own `--help`: it must refuse what they refuse
and take what they take, or a playbook passes the simulated preflight and launch and fails on the real
engine (or the other way round). Each line below is copied from the real help of the release named."""

from __future__ import annotations

import re

import pytest

from harness.sim import flags

# `python -m sglang.launch_server --help`, SGLang 0.5.23 (ServerArgs.add_cli_args)
SGLANG_0_5_23_HELP = "\n".join([
    '  --quantization {awq,fp8,mxfp8,gptq,gptq_marlin,awq_marlin,bitsandbytes,gguf,modelopt,modelopt_fp8,'
    'modelopt_fp4,nvfp4_online,modelopt_mixed,petit_nvfp4,w8a8_int8,w8a8_fp8,moe_wna16,w4afp8,mxfp4,'
    'auto-round,auto-round-int8,compressed-tensors,modelslim,mxfp_w4a8,quark,quark_int4fp8_moe,'
    'quark_mxfp4,mlx_q4,mlx_q8,unquant,humming}',
    '  --kv-cache-dtype {auto,fp8_e5m2,fp8_e4m3,mxfp8,bf16,bfloat16,nvfp4,fp4_mx_block16}',
    '  --attention-backend {triton,torch_native,flex_attention,dsa,nsa,qsa,dsv4,compressed,fa3,fa4,'
    'flashinfer,llada2_cfg_flashinfer,flashmla,trtllm_mla,cutedsl_mla,tokenspeed_mla,trtllm_mha,hpc_ops,'
    'minicpm_flashattn,minicpm_flashinfer,aiter,wave,intel_amx,ascend,intel_xpu}',
    '  --moe-a2a-backend {none,deepep,mooncake,nixl,mori,ascend_fuseep,flashinfer,megamoe,deepep_v2,pplx,'
    'ascend_tp,flashinfer_megamoe}',
])
# `vllm serve --help=all`, vLLM 0.32.0 (the CPU build)
VLLM_0_32_0_HELP = "\n".join([
    '  --kv-cache-dtype {auto,bfloat16,float16,fp8,fp8_ds_mla,fp8_e4m3,fp8_e5m2,fp8_inc,'
    'fp8_per_token_head,int4_per_token_head,int8_per_token_head,nvfp4,nvfp4_4over6,nvfp4_ds_mla,'
    'turboquant_3bit_nc,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_k8v4,ultraquant_4bit}',
])


def choices(help_text: str) -> list[tuple[str, str]]:
    return [(flag, value) for flag, values in re.findall(r"^  (--[\w-]+) \{([^}]*)\}", help_text, re.M)
            for value in values.split(",")]


def refused(engine: str, *argv: str) -> bool:
    base = ["--model-path", "m"] if engine == "sglang" else ["serve", "m"]
    try:
        flags.parse(engine, [*base, *argv])
    except SystemExit as e:
        return e.code == 2
    return False


@pytest.mark.parametrize("flag, value", choices(SGLANG_0_5_23_HELP))
def test_the_sim_takes_every_choice_sglang_0_5_23_lists(flag, value):
    assert not refused("sglang", flag, value)
    for other in ("--prefill-attention-backend", "--decode-attention-backend"):
        if flag == "--attention-backend":
            assert not refused("sglang", other, value)


@pytest.mark.parametrize("flag, value", choices(VLLM_0_32_0_HELP))
def test_the_sim_takes_every_choice_vllm_0_32_0_lists(flag, value):
    assert not refused("vllm", flag, value)


@pytest.mark.parametrize("argv, why", [
    (["--stream-output"], "not in SGLang 0.5.23's help"),
    (["--kv-cache-dtype", "fp4_e2m1"], "not among 0.5.23's --kv-cache-dtype choices"),
    (["--quantization", "qoq"], "not among 0.5.23's --quantization choices"),
    (["--attention-backend", "dual_chunk_flash_attn"], "not among 0.5.23's backends"),
    (["--tp-size", "8", "--dp-size", "2", "--attn-dp-size", "4"],
     "0.5.23 parallel_hook.py: replicas combined with attention DP are not supported"),
])
def test_the_sim_refuses_what_sglang_0_5_23_refuses(argv, why):
    assert refused("sglang", *argv), why


@pytest.mark.parametrize("argv, why", [
    (["--swap-space", "4"], "no such flag in vLLM 0.26.0 or 0.32.0 (engine/arg_utils.py)"),
    (["--no-headless"], "0.32.0 launchers/cli_args.py: --headless is a plain store_true"),
    (["-q", "w8a8_int8"], "not in 0.32.0's QuantizationMethods"),
])
def test_the_sim_refuses_what_vllm_0_32_0_refuses(argv, why):
    assert refused("vllm", *argv), why


@pytest.mark.parametrize("field", ["detailed_trace_annotation", "warmup_iterations", "active_iterations",
                                   "wait_iterations", "capture_torch_profiler"])
def test_the_sim_takes_every_profiler_config_field_of_vllm_0_32_0(field):
    """vLLM 0.32.0 config/profiler.py ProfilerConfig (0.26.0 has these too)."""
    value = "true" if field in ("detailed_trace_annotation", "capture_torch_profiler") else "2"
    assert not refused("vllm", "--profiler-config.profiler", "torch", f"--profiler-config.{field}", value)
    assert refused("vllm", "--profiler-config.no_such_field", "1")


@pytest.mark.parametrize("args", [
    {"tp-size": 2, "dp-size": 2},                                   # two replicas, each a TP group
    {"tp-size": 1, "dp-size": 4},
    {"tp-size": 4, "dp-size": 4, "enable-dp-attention": True},      # the deprecated spelling
    {"tp-size": 4, "attn-dp-size": 4},                              # 0.5.22's spelling
    {"tp-size": 2, "pp-size": 2},
])
def test_the_simulated_sglang_writes_one_file_per_rank_the_adapter_counts(args):
    """SGLang 0.5.23: without attention DP, `--dp-size` counts replicas (data_parallel_controller launches a
    TP group per replica) and each rank's file gets `-DP-{replica}` (profiler_manager.py `_stop_profile`);
    the adapter waits for tp x pp x dp files, so the simulator must write as many, each a rank of its own."""
    from harness.engines import get_engine
    from harness.sim.profiler import sglang_rank_names

    argv = [x for k, v in args.items() for x in ([f"--{k}"] if v is True else [f"--{k}", str(v)])]
    ns = flags.parse("sglang", ["--model-path", "m", *argv])
    attn_dp, replicas = flags.sglang_dp(ns)
    names = sglang_rank_names(tp=ns.tp_size, dp=attn_dp, pp=ns.pp_size, ep=ns.ep_size, replicas=replicas)
    naming = get_engine("sglang").traces
    files = [f"1764500000.123-{name}.trace.json.gz" for _, name in names]
    assert len(files) == get_engine("sglang").ranks(args)
    assert len({naming.rank_key(f) for f in files}) == len(files)


@pytest.mark.parametrize("engine, line, seen_in", [
    ("vllm", "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
             "when initializing the engine", "vLLM 0.26.0 and 0.32.0 v1/core/kv_cache_utils.py"),
    ("vllm", "ValueError: To serve at least one request with the model's max seq len (131072), (16.00 GiB KV "
             "cache is needed, which is larger than the available KV cache memory (2.10 GiB).",
     "vLLM 0.26.0 and 0.32.0 v1/core/kv_cache_utils.py"),
    ("sglang", "ValueError: Loaded weights leave no GPU memory for the KV cache under "
               "--mem-fraction-static=0.88. Raise --mem-fraction-static above 0.912",
     "SGLang 0.5.23 mem_cache/kv_cache_configurator.py"),
])
def test_each_engines_own_out_of_memory_message_is_known(engine, line, seen_in):
    """Neither says "out of memory": the engine's record names its own messages (`oom_log`)."""
    from harness.engines import get_engine

    assert re.search(get_engine(engine).oom_log, line), seen_in
    assert not re.search(get_engine(engine).oom_log, "INFO: Started server process [1234]")
