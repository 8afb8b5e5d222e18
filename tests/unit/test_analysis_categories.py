"""Kernel names as real traces spell them land in the category an engineer would name."""

import re
from pathlib import Path

import pytest

from harness.analysis import analyze_path
from harness.analysis.categories import NAMES, categorize

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("name, category", [
    # The GLM-5 campaign's culprit: the FP8 -> BF16 KV-cache cast is an elementwise kernel doing a copy.
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIterator"
     "Base&)::{lambda()#3}::operator()() const::{lambda()#8}::operator()() const::{lambda(c10::BFloat16)#1}, "
     "at::detail::Array<char*, 2> >(int, at::detail::Array<char*, 2>)", "copy"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("Memset (Device)", "copy"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)", "gemm"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<NumericConverter<float, bf16>>>", "gemm"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16, 4, 4, false, false>", "gemm"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(...)", "communication"),
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<RMSNorm>", "communication"),
    ("void sglang::mscclpp_allreduce_kernel<__nv_bfloat16>", "communication"),
    ("void deep_ep::internode_ll::dispatch<false>", "communication"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, unsigned int)", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>", "norm"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<>", "attention"),
    ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "attention"),
    ("void cutlass::fmha::kernel::Sm100FmhaMlaKernelTmaWarpspecialized<>", "attention"),
    ("fused_moe_kernel", "moe"),
    ("void moe_align_block_size_kernel<int>(int*, int*)", "moe"),
    ("void topkGatingSoftmax<float, 8, 256>", "moe"),
    # DeepSeek's grouped (noaux_tc) routing kernels.
    ("void group_idx_and_topk_idx_kernel<__nv_bfloat16, int>(...)", "moe"),
    ("void topk_with_k2_kernel<__nv_bfloat16>(...)", "moe"),
    # What torch.compile makes of a dtype cast: an Inductor pointwise kernel of casts and views only.
    ("triton_poi_fused__to_copy_0", "copy"),
    ("triton_poi_fused__to_copy_clone_slice_view_3", "copy"),
    ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, silu>", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "other"),
])
def test_kernel_names_are_categorized_by_the_first_matching_row(name, category):
    assert categorize(name) == category


# Whole names as the real traces spell them (tests/fixtures/transformers_trace: transformers serve with
# torch.compile; tests/fixtures/vllm_h200: vLLM 0.26.0) whose template arguments, or whose list of the
# ops Inductor generated them from, mention another kind of work than the kernel does.
@pytest.mark.parametrize("name, category", [
    # PyTorch's TensorIterator kernels name `gpu_kernel_impl_nocast` and `LoadWithCast`/`LoadWithoutCast`
    # whatever they compute: a multiply, an add, a negation, a compare, a bitwise and, a fill.
    ('void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFun'
     'ctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > '
     '>(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, '
     'at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, '
     'at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, '
     'c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, '
     'at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, '
     'at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1})', 'elementwise'),
    ('void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::CUDAFunct'
     'or_add<c10::BFloat16> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<c10::BFloat16> '
     'const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<c10::B'
     'Float16> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<c10::BFloat16> '
     'const&)::{lambda(int)#1})', 'elementwise'),
    ('void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::neg_kerne'
     'l_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#9}::operator()() '
     'const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, at::native::neg_kernel_cuda(at::TensorIte'
     'ratorBase&)::{lambda()#2}::operator()() const::{lambda()#9}::operator()() '
     'const::{lambda(c10::BFloat16)#1} const&)::{lambda(int)#1}>(int, '
     'at::native::gpu_kernel_impl_nocast<at::native::neg_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2'
     '}::operator()() const::{lambda()#9}::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIterat'
     'orBase&, at::native::neg_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() '
     'const::{lambda()#9}::operator()() const::{lambda(c10::BFloat16)#1} const&)::{lambda(int)#1})', 'elementwise'),
    ('void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::(anonymou'
     's namespace)::CompareFunctor<long> >(at::TensorIteratorBase&, at::native::(anonymous '
     'namespace)::CompareFunctor<long> const&)::{lambda(int)#1}>(int, '
     'at::native::gpu_kernel_impl_nocast<at::native::(anonymous namespace)::CompareFunctor<long> '
     '>(at::TensorIteratorBase&, at::native::(anonymous namespace)::CompareFunctor<long> '
     'const&)::{lambda(int)#1})', 'elementwise'),
    ('void at::native::unrolled_elementwise_kernel<at::native::BinaryFunctor<long, long, long, '
     'at::native::BitwiseAndFunctor<long> >, std::array<char*, 3ul>, 4, TrivialOffsetCalculator<2, '
     'unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<2>, '
     'at::native::memory::StoreWithCast<1> >(int, at::native::BinaryFunctor<long, long, long, '
     'at::native::BitwiseAndFunctor<long> >, std::array<char*, 3ul>, TrivialOffsetCalculator<2, unsigned '
     'int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<2>, '
     'at::native::memory::StoreWithCast<1>)', 'elementwise'),
    ('void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<long>, std::array<char*, '
     '3ul>, 4, TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, '
     'at::native::memory::LoadWithoutCast, at::native::memory::StoreWithoutCast>(int, '
     'at::native::CUDAFunctor_add<long>, std::array<char*, 3ul>, TrivialOffsetCalculator<2, unsigned '
     'int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithoutCast, '
     'at::native::memory::StoreWithoutCast)', 'elementwise'),
    ('void at::native::unrolled_elementwise_kernel<at::native::FillFunctor<int>, std::array<char*, 1ul>, '
     '4, TrivialOffsetCalculator<0, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, '
     'at::native::memory::LoadWithoutCast, at::native::memory::StoreWithoutCast>(int, '
     'at::native::FillFunctor<int>, std::array<char*, 1ul>, TrivialOffsetCalculator<0, unsigned int>, '
     'TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithoutCast, '
     'at::native::memory::StoreWithoutCast)', 'elementwise'),
    # ... while the dtype casts and the copies among them stay copies.
    ('void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorB'
     'ase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, '
     'std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, '
     'unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, '
     'at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() '
     'const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, '
     'TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, '
     'at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1>)', 'copy'),
    ('void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_co'
     'py_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() '
     'const::{lambda()#4}::operator()() const::{lambda(long)#1}>(at::TensorIteratorBase&, '
     'at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() '
     'const::{lambda()#4}::operator()() const::{lambda(long)#1} const&)::{lambda(int)#1}>(int, '
     'at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{la'
     'mbda()#3}::operator()() const::{lambda()#4}::operator()() const::{lambda(long)#1}>(at::TensorIterato'
     'rBase&, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() '
     'const::{lambda()#4}::operator()() const::{lambda(long)#1} const&)::{lambda(int)#1})', 'copy'),
    ('void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda(at::TensorIt'
     'eratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, '
     'at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}, '
     'std::array<char*, 2ul>)', 'copy'),
    ('void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous '
     'namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(at::native::(anonymous '
     'namespace)::OpaqueType<2u>*, at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native'
     '::(anonymous namespace)::OpaqueType<2u>, unsigned int, 64, 64>, at::native::(anonymous '
     'namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)', 'copy'),
    ('void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<at::native::Opa'
     'queType<2> >(at::TensorIterator&, long, long, long)::{lambda(int)#1}>(long, '
     'at::native::index_copy_kernel_impl<at::native::OpaqueType<2> >(at::TensorIterator&, long, long, '
     'long)::{lambda(int)#1})', 'copy'),
    # Inductor: an RMSNorm reduction (its `_to_copy` is the dtype promotion inside it) is a norm.
    ("triton_per_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_11", "norm"),
    ("triton_per_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_red_fused_fused_add_rms_norm_2", "norm"),
    ("triton_red_fused__to_copy_embedding_rms_norm_0", "norm"),
    # Inductor pointwise kernels are elementwise, whatever ops they were generated from: the rotary
    # embedding's K = 1 `bmm`, the rotary embedding and mask before a cuDNN attention call.
    ("triton_poi_fused__to_copy_bmm_expand_unsqueeze_1", "elementwise"),
    ("triton_poi_fused__to_copy__unsafe_view_add_arange_bmm_cat_cos_index_copy_mul_neg_sin_slice_transpose_unsqueeze_"
     "view_2", "elementwise"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_bmm_cat_clone_cos_expand_mul_"
     "neg_scalar_tensor_sin_slice_transpose_unsqueeze_view_where_5", "elementwise"),
    ("triton_poi_fused_add_copy__16", "elementwise"),
    ("triton_poi_fused__unsafe_view_mul_silu_8", "elementwise"),
    ("triton_poi_fused_3", "elementwise"),
    # cuDNN's fused attention (SDPA's cuDNN backend).
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3_64x64x64_4x1x1_cga1x1x1_kernel0_0",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_cga1x1x1_kernel0_0",
     "attention"),
    # A sampler's top-k is no MoE routing: torch.topk as Kineto names it (PyTorch 2.x), and flashinfer's
    # fused top-k/top-p sampler (its template arguments left out).
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float const, "
     "unsigned int>, unsigned int, unsigned int, bool, unsigned int, unsigned int, at::cuda::detail::TensorInfo<float, "
     "unsigned int>, unsigned int, at::cuda::detail::TensorInfo<long, unsigned int>, unsigned int, float*)", "other"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<...>", "other"),
    # vLLM 0.26's KV-cache write on an H200 (tests/fixtures/vllm_h200), with an FP8 cache a cast too, and
    # its FP8 quantization of activations: 7.2% and 2.7% of the eager-kv-fp8 trace's kernel time.
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>"
     "(__nv_bfloat16 const*, __nv_bfloat16 const*, unsigned char*, unsigned char*, long const*, long, long, long, "
     "long, long, int, int, int, float const*, float const*)", "copy"),
    ("void vllm::scaled_fp8_quant_kernel_strided_group_shape<c10::BFloat16, c10::Float8_e4m3fn, true, true>"
     "(c10::Float8_e4m3fn*, c10::BFloat16 const*, float const*, int, long, long, long, long, long, long)", "copy"),
    ("void per_token_group_quant_8bit_kernel<__nv_bfloat16, c10::Float8_e4m3fn>", "copy"),
    ("void dequant_kernel<half>", "other"),
])
def test_real_kernel_names_are_categorized_by_what_they_compute(name, category):
    assert categorize(name) == category


COPIES = re.compile(r"memcpy|memset|direct_copy_kernel|_copy_kernel_cuda|CatArrayBatchedCopy|index_copy_kernel"
                    r"|reshape_and_cache|fp8_quant", re.I)


GPU_TRACES = ("real_trace", "transformers_trace", "vllm_h200/graphs", "vllm_h200/eager-kv-fp8")


@pytest.mark.parametrize("folder", GPU_TRACES)
def test_in_every_real_trace_copy_holds_copies_and_casts_only(folder):
    """Every kernel of the GPU traces in tests/fixtures: copy holds the memcpys, memsets, dtype casts,
    torch.cat and index_copy_, and every one of those is a copy."""
    (trace,) = (FIXTURES / folder).glob("*.pt.trace.json.gz")
    analysis = analyze_path(trace, top=1000)
    assert len(analysis["top"]) < 1000
    copies = [k["name"] for k in analysis["top"] if k["category"] == "copy"]
    assert [n for n in copies if not COPIES.search(n)] == []
    assert [k["name"] for k in analysis["top"] if COPIES.search(k["name"]) and k["category"] != "copy"] == []


def test_a_compiled_servers_rmsnorm_is_norm_and_its_copy_share_is_its_copies():
    """transformers serve with torch.compile: Inductor's RMSNorm kernels are 5.2% of kernel time, and
    copy is the memcpys, casts, torch.cat and the static cache's index_copy (4.3%)."""
    analysis = analyze_path(FIXTURES / "transformers_trace" / "serve.pt.trace.json.gz", top=1000)
    assert analysis["categories"]["norm"] == pytest.approx(0.052, abs=0.002)
    assert analysis["categories"]["copy"] == pytest.approx(0.043, abs=0.002)
    assert analysis["categories"]["attention"] > 0.05


def test_every_category_is_listed_with_other_last():
    assert NAMES == ("communication", "norm", "moe", "attention", "gemm", "copy", "elementwise", "other")
