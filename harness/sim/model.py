"""The latency model of the simulated engine: one decode step, broken down the way a trace shows it.

The default scale is the GLM-5 campaign's measurement: GLM-5-NVFP4 (MoE, 78 layers) under SGLang TP8 on eight
PCIe Blackwell GPUs with an FP8 KV cache and CUDA graphs: ITL 97 ms at concurrency 1, TTFT 175 ms for a
16-token prompt. Their profiler trace and component benchmarks split the 97 ms step as

    copy 67.0         the FP8 -> BF16 cast of the whole KV pool, every layer, every step (69 %)
    communication 6.6 two NCCL all-reduces per layer
    moe 6.6           routing 2.4 + permute 1.6 + expert GEMMs 2.6
    norm 3.4          RMSNorm
    attention 3.0     paged decode attention
    elementwise 2.8   rotary, SiLU-and-mul, fills
    gemm 2.3          dense BF16 projections
    idle 5.3          CPU dispatch: the GPU waits for the host

and every configuration flag moves one of these terms, so latencies and trace kernel mixes tell one
story (`step_kernels` hands the same budget to the trace writer):

- KV cache dtype: any quantized dtype (fp8_*, fp4_*, mxfp8, nvfp4) pays the cast; auto/bf16 does not,
  which makes the step about 30 ms.
- TP size: per-GPU compute and the cast shrink as 8/tp (with a floor for fixed per-kernel cost); the
  all-reduce grows as (tp-1)/7 and vanishes at tp 1.
- --enable-mscclpp: all-reduce x 0.55. Single/two-batch overlap: communication x 0.85.
- EP (sglang --ep-size > 1, vllm -ep): MoE x 0.85 but an all-to-all costing 0.6 ms x (ep-1)/7: the
  the campaign saw EP8 give little, and so does the model. PP adds 0.3 ms of P2P per extra stage.
- CUDA graphs off (sglang --disable-cuda-graph or --cuda-graph-backend-decode disabled; vllm
  --enforce-eager, -O0 or cudagraph_mode NONE): every kernel is launched from Python, 20 us each, which
  lands as idle gaps between kernels (about +19 ms for 940 kernels).
- torch.compile (sglang --enable-torch-compile; vllm unless eager/-O0): norm and elementwise x 0.6.
- Concurrency (batch size b per DP replica): weight-bound terms grow as b^0.35, attention as b^0.6, the
  cast not at all (it covers the whole pool), communication and dispatch by 2 % and 1 % per request.
- Prompt length: a prefill step costs one decode step + 70 ms of fixed prefill work + 0.5 ms a prompt
  token (both scaled like compute), so 16 tokens at TP8/FP8 give 97 + 70 + 8 = 175 ms.

All numbers are milliseconds of simulated time; the server multiplies them by HARNESS_SIM_TIME_SCALE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

REFERENCE_MS: dict[str, float] = {
    "copy": 67.0, "communication": 6.6, "moe": 6.6, "norm": 3.4,
    "attention": 3.0, "elementwise": 2.8, "gemm": 2.3, "idle": 5.3,
}
"""The GLM-5 campaign's TP8 / FP8-KV / CUDA-graph step at batch 1 (sums to 97.0 ms)."""

UNQUANTIZED_KV = frozenset({"auto", "bf16", "bfloat16", "fp16", "float16", "half"})
LAUNCH_MS = 0.020
"""Host cost of one eager kernel launch (Python op dispatch + cudaLaunchKernel)."""
PREFILL_FIXED_MS = 70.0
PREFILL_TOKEN_MS = 0.5
IDLE_STEP_MS = 0.5
"""A vLLM step with no request scheduled (it frees finished requests): host work only, no kernel.
vLLM 0.26 on the H200 ran 48 such steps in 318; their cost is this simulator's choice."""


@dataclass(frozen=True)
class SimConfig:
    """The part of an engine's server arguments that moves latency."""

    engine: str = "sglang"
    tp: int = 8
    dp: int = 1
    pp: int = 1
    ep: int = 1
    mscclpp: bool = False
    cuda_graphs: bool = True
    torch_compile: bool = False
    overlap: bool = False
    kv_cache_dtype: str = "fp8_e4m3"
    layers: int = 78

    @property
    def kv_quantized(self) -> bool:
        return self.kv_cache_dtype not in UNQUANTIZED_KV


@dataclass(frozen=True)
class Kernel:
    """One GPU kernel of a decode step: what the trace writer emits and the analyzer ranks."""

    name: str
    category: str
    us: float
    op: str
    """The CPU op that launches it when CUDA graphs are off."""
    grid: tuple[int, int, int] = (132, 1, 1)
    block: tuple[int, int, int] = (128, 1, 1)
    stream: int = 7


@dataclass(frozen=True)
class _Slot:
    """One kernel of a layer: which budget it draws from and what share of it."""

    category: str
    share: float
    name: str
    op: str
    grid: tuple[int, int, int] = (132, 1, 1)
    block: tuple[int, int, int] = (128, 1, 1)
    stream: int = 7


def _cast_kernel(kv_dtype: str) -> str:
    """PyTorch's dtype-cast copy, as the GLM-5 campaign's trace showed it for the FP8 KV cache."""
    fp8 = "c10::Float8_e5m2" if "e5m2" in kv_dtype else "c10::Float8_e4m3fn"
    lam = ("at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const"
           f"::{{lambda()#7}}::operator()() const::{{lambda({fp8})#1}}")
    calc = "TrivialOffsetCalculator<1, unsigned int>"
    io = "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>"
    return (f"void at::native::unrolled_elementwise_kernel<{lam}, std::array<char*, 2ul>, 4, {calc}, {calc}, {io} >"
            f"(int, {lam}, std::array<char*, 2ul>, {calc}, {calc}, {io})")


def _allreduce_kernel(cfg: SimConfig) -> tuple[str, str]:
    if cfg.mscclpp:
        return ("void mscclpp::allreduceAllPairs<__nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, "
                "mscclpp::DeviceHandle<mscclpp::MemoryChannel>*, unsigned long, int, int, unsigned long)",
                "sgl_kernel::mscclpp_allreduce")
    return "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "c10d::allreduce_"


def _layer_slots(cfg: SimConfig) -> list[_Slot]:
    """The kernels of one decoder layer, in launch order."""
    ar, ar_op = _allreduce_kernel(cfg)
    vllm = cfg.engine == "vllm"
    attn = ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<576, 64, 64, 4, false, false, "
            "cutlass::bfloat16_t, Flash_kernel_traits<576, 64, 64, 4, cutlass::bfloat16_t> >, false, false, "
            "false, false, true, true, false, false>(flash::Flash_fwd_params)"
            if vllm else
            "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u, 8u, 16u, "
            "1u, 8u, (flashinfer::PageStorage)0, flashinfer::DefaultAttention<false, false, false, false>, "
            "flashinfer::paged_kv_t<__nv_bfloat16, int>, __nv_bfloat16, __nv_bfloat16, int>(...)")
    norm = ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, "
            "__nv_bfloat16*, unsigned int, unsigned int, unsigned int, float, float)")
    slots = [
        _Slot("norm", 0.5, norm, "sgl_kernel::fused_add_rmsnorm", (1, 1, 1), (256, 1, 1)),
        _Slot("gemm", 0.4, "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "aten::mm", (16, 1, 4)),
        _Slot("elementwise", 0.4, "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 64u, 8u, "
              "16u, __nv_bfloat16, long>(...)", "sgl_kernel::apply_rope_pos_ids_cos_sin_cache", (1, 1, 1)),
    ]
    if cfg.kv_quantized:
        slots.append(_Slot("copy", 1.0, _cast_kernel(cfg.kv_cache_dtype), "aten::copy_", (1056, 1, 1)))
    slots += [
        _Slot("attention", 1.0, attn, "flashinfer::batch_decode_with_paged_kv_cache", (1, 16, 1)),
        _Slot("gemm", 0.25, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_"
              "execute_segment_k_off_kernel__5x_cublas", "aten::mm", (24, 1, 1)),
        _Slot("communication", 0.5, ar, ar_op, (8, 1, 1), (640, 1, 1), 20),
        _Slot("norm", 0.5, norm, "sgl_kernel::fused_add_rmsnorm", (1, 1, 1), (256, 1, 1)),
        _Slot("moe", 0.2, "void moe_fused_gate_kernel<float, 256, 8, 32, 4>(void*, void*, float*, int*, long, "
              "long, long, long, double)", "sgl_kernel::moe_fused_gate", (1, 1, 1), (32, 4, 1)),
        _Slot("moe", 0.15, "moe_align_block_size_kernel", "sgl_kernel::moe_align_block_size", (1, 1, 1),
              (1024, 1, 1)),
        _Slot("moe", 0.25, "fused_moe_kernel", "sglang::fused_moe", (64, 1, 1)),
        _Slot("elementwise", 0.4, "void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, "
              "&silu<float> >(__nv_bfloat16*, __nv_bfloat16 const*, int)", "sgl_kernel::silu_and_mul", (8, 1, 1)),
        _Slot("moe", 0.25, "fused_moe_kernel", "sglang::fused_moe", (64, 1, 1)),
        _Slot("moe", 0.15, "void moe_sum_reduce_kernel<__nv_bfloat16, 8>(...)", "sgl_kernel::moe_sum_reduce"),
        _Slot("gemm", 0.35, "nvjet_tst_128x8_64x12_2x1_v_bz_TNN", "aten::mm", (48, 1, 1)),
        _Slot("elementwise", 0.2, "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<"
              "float>, std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
              "aten::fill_", (8, 1, 1)),
        _Slot("communication", 0.5, ar, ar_op, (8, 1, 1), (640, 1, 1), 20),
    ]
    return slots


def _op(op: str, engine: str) -> str:
    """vLLM registers the same custom kernels under its own op namespaces."""
    if engine != "vllm":
        return op
    return op.replace("sgl_kernel::", "_C::").replace("sglang::", "vllm::")


@dataclass(frozen=True)
class LatencyModel:
    """Step and prefill times (ms of simulated time) for one engine configuration."""

    config: SimConfig = field(default_factory=SimConfig)

    def _batch(self, batch: int) -> int:
        return max(1, math.ceil(batch / max(1, self.config.dp)))

    def step_ms(self, batch: int = 1) -> dict[str, float]:
        """One decode step for `batch` running requests, by category; "idle" is GPU time lost to the host."""
        c, b = self.config, self._batch(batch)
        compute = 0.25 + 0.75 * 8 / max(1, c.tp)
        grow = b ** 0.35
        fused = 0.6 if c.torch_compile else 1.0
        comm = REFERENCE_MS["communication"] * (c.tp - 1) / 7 * (1 + 0.02 * (b - 1))
        comm *= (0.55 if c.mscclpp else 1.0) * (0.85 if c.overlap else 1.0)
        comm += 0.6 * (c.ep - 1) / 7 + 0.3 * (c.pp - 1)
        idle = REFERENCE_MS["idle"] * (1 + 0.01 * (b - 1))
        if not c.cuda_graphs:
            idle += LAUNCH_MS * self.kernels_per_step()
        return {
            "copy": REFERENCE_MS["copy"] * 8 / max(1, c.tp) if c.kv_quantized else 0.0,
            "communication": comm,
            "moe": REFERENCE_MS["moe"] * compute * grow * (0.85 if c.ep > 1 else 1.0),
            "norm": REFERENCE_MS["norm"] * grow * fused,
            "attention": REFERENCE_MS["attention"] * compute * b ** 0.6,
            "elementwise": REFERENCE_MS["elementwise"] * compute * grow * fused,
            "gemm": REFERENCE_MS["gemm"] * compute * grow,
            "idle": idle,
        }

    def itl_ms(self, batch: int = 1) -> float:
        """Inter-token latency: the wall time of one decode step."""
        return sum(self.step_ms(batch).values())

    def prefill_ms(self, prompt_tokens: int) -> float:
        """One prefill step over `prompt_tokens` new tokens (all requests admitted together)."""
        compute = 0.25 + 0.75 * 8 / max(1, self.config.tp)
        return self.itl_ms(1) + (PREFILL_FIXED_MS + PREFILL_TOKEN_MS * prompt_tokens) * compute

    def ttft_ms(self, prompt_tokens: int) -> float:
        """Time to first token of a request that arrives at an idle server."""
        return self.prefill_ms(prompt_tokens)

    def prefill_kernels(self, requests: int, prompt_tokens: int) -> list[Kernel]:
        """The kernels of a prefill step: the decode mix of `requests`, stretched so that their busy time
        is `prefill_ms` less the step's host idle (the trace and the scheduler agree on its length)."""
        kernels = self.step_kernels(requests)
        busy_us = sum(k.us for k in kernels)
        target_us = (self.prefill_ms(prompt_tokens) - self.step_ms(requests)["idle"]) * 1000
        factor = max(target_us, busy_us) / busy_us if busy_us else 1.0
        return [replace(k, us=k.us * factor) for k in kernels]

    def kernels_per_step(self) -> int:
        return len(_layer_slots(self.config)) * self.config.layers

    def step_kernels(self, batch: int = 1) -> list[Kernel]:
        """The GPU kernels of one decode step on one rank, in launch order.

        Their durations add up to the step's non-idle time (with PP, a rank runs only its stage's layers
        and waits for the others: the rest of the step is idle on that rank)."""
        c = self.config
        budget = self.step_ms(batch)
        slots = _layer_slots(c)
        shares: dict[str, float] = {}
        for s in slots:
            shares[s.category] = shares.get(s.category, 0.0) + s.share
        per_rank = max(1, c.layers // max(1, c.pp))
        layer = [Kernel(s.name, s.category, max(budget[s.category] * 1000 * s.share / shares[s.category] / c.layers,
                                                0.8), _op(s.op, c.engine), s.grid, s.block, s.stream)
                 for s in slots if budget[s.category] > 0]
        return layer * per_rank
