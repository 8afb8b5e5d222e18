"""Kernel names as real traces spell them land in the category an engineer would name."""

import pytest

from harness.analysis.categories import NAMES, categorize


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
    ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, silu>", "elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "other"),
])
def test_kernel_names_are_categorized_by_the_first_matching_row(name, category):
    assert categorize(name) == category


def test_every_category_is_listed_with_other_last():
    assert NAMES == ("communication", "norm", "moe", "attention", "gemm", "copy", "elementwise", "other")
