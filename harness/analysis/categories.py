"""Which kind of work a GPU kernel does, judged by its name.

A name is judged in three steps, the first that answers wins:

1. A TorchInductor kernel (`triton_poi_fused_...`, `triton_red_fused_...`, `triton_per_fused_...`,
   `triton_tem_fused_...`, `triton_for_fused_...`) is judged by its kind and the ATen ops it lists (see
   `_inductor`), not by the table: its name lists every op it was generated from, and those name other
   kinds of work than the kernel does. A pointwise kernel for the rotary embedding that feeds a cuDNN
   attention call is named `triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy_..._bmm_cat_cos_
   ..._sin_...`, and an RMSNorm reduction is `triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_N`
   (`_to_copy` is the dtype promotion inside the norm).
2. Template plumbing that names a cast without doing one is removed from the name: PyTorch's
   TensorIterator kernels carry `gpu_kernel_impl_nocast`, `LoadWithCast`/`StoreWithCast` or
   `LoadWithoutCast`/`StoreWithoutCast` whatever their functor computes (a multiply, an add, a fill),
   and vLLM's kernels `vllm::_typeConvert<T>::exists` in their return type.
3. One ordered table: the first category with a pattern found in what is left of the name wins,
   matching is case-insensitive, and a name that matches nothing is "other". Order matters because
   kernel names carry their template arguments, so one name often mentions several kinds of work:

   - communication first: fused all-reduce kernels also name the RMSNorm they fuse;
   - norm before attention: flashinfer's `flashinfer::norm::RMSNormKernel` lives beside its attention;
   - moe and attention before gemm: `fused_moe_kernel` and cutlass FMHA kernels are GEMMs inside;
   - gemm before copy: cutlass templates name their `NumericConverter`;
   - copy before elementwise: PyTorch's dtype cast (the FP8->BF16 KV-cache cast of the GLM-5 campaign's
     trace) is `at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda ...>`, which
     is a copy.

What the categories hold: "copy" is data moved or cast and nothing computed (memcpy, memset, PyTorch's
`direct_copy_kernel_cuda` and `*_copy_kernel_cuda` casts, `torch.cat`, `index_copy_`, an Inductor
pointwise kernel of only casts and views, vLLM's write of new keys and values into the KV cache, FP8
quantization, a cast with a scale; MLA's cache write, `concat_and_cache_mla`, names "mla" and stays
attention); "moe" is expert routing and the expert GEMMs, so a top-k counts only by a routing kernel's
name (`topkGatingSoftmax`, `grouped_topk`), while torch.topk's `sbtopk::gatherTopK` and flashinfer's
top-k/top-p sampling kernels are "other"; "elementwise" is pointwise arithmetic, a fill included.

To teach it a new kernel, add a pattern to the right row (patterns are regular expressions).
"""

from __future__ import annotations

import re
from functools import lru_cache

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all_?reduce", "all_?gather", "reduce_?scatter", "mscclpp",
                       "cross_device", "all_?to_?all", "deep_?ep")),
    ("norm", ("rms_?norm", "layer_?norm", "norm_kernel")),
    # Routing kernels by name (`topkGatingSoftmax`, `grouped_topk`, DeepSeek's `group_idx_and_topk_idx_kernel`
    # and `topk_with_k2_kernel`): a bare "topk" would also claim the sampler's (torch.topk, flashinfer).
    ("moe", ("moe", "expert", "topk_?gating", "topk_?softmax", "grouped_?topk", "topk_idx", "topk_with_k2",
             "router", "permute")),
    # Bare "flash" would also claim flashinfer's activation and sampling kernels. cuDNN's fused attention
    # is `cudnn_generated_fort_native_sdpa_sm90_flash_fprop_...` (and `..._flash_bprop_...`).
    ("attention", ("flash_?attn", "flash_fwd", "flash_bwd", "flash::", "fmha", "attention",
                   "batchdecode", "batchprefill", "mla", "paged", "sdpa", "flash_[fb]prop")),
    # `mm_` and `bmm_` only as words of their own (`cutlass_scaled_mm_...`), not the end of another (`comm_`).
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "matmul", "(?<![a-z0-9])b?mm_")),
    # vLLM's KV-cache write (`reshape_and_cache_flash_kernel`: a cast too when the cache is FP8) and FP8
    # quantization (`scaled_fp8_quant_kernel...`, SGLang's `per_token_group_quant_8bit`), not "dequant".
    ("copy", ("copy", "memcpy", "memset", "(?<!broad)cast", "convert", "reshape_and_cache", "(?<![a-z])quant")),
    ("elementwise", ("elementwise", "vectorized", "act_and_mul", "silu", "gelu", "add", "mul",
                     "rotary")),
)
OTHER = "other"
NAMES: tuple[str, ...] = tuple(name for name, _ in CATEGORIES) + (OTHER,)
"""Every category, in the table's order, for reports that list them all."""

_COMPILED = tuple((name, re.compile("|".join(patterns), re.IGNORECASE)) for name, patterns in CATEGORIES)

_PLUMBING = re.compile(r"gpu_kernel_impl_nocast|(?:load|store)with(?:out)?cast|_typeconvert", re.IGNORECASE)
"""Template arguments that say how a kernel loads, stores or dispatches, not what it computes."""

_INDUCTOR = re.compile(r"triton_(poi|for|red|per|tem)_(?:_|fused(?:_|$))(.*?)(?:_?\d+)?", re.IGNORECASE)
"""An Inductor kernel: its kind (pointwise, foreach, reduction, persistent reduction, template), "fused"
and the ATen ops it was generated from joined by "_" (nothing with descriptive names off), its number."""

_MOVES = frozenset((
    "to", "copy", "clone", "contiguous", "unsafe", "view", "reshape", "as", "strided", "alias",
    "expand", "slice", "select", "narrow", "split", "with", "sizes", "unbind", "cat", "stack",
    "transpose", "permute", "t", "squeeze", "unsqueeze", "flatten", "unflatten", "repeat", "index",
    "put", "scatter", "gather", "embedding", "constant", "pad", "nd", "convert", "element", "type",
    "lift", "fresh",
))
"""The words of ATen ops that move or cast data and compute nothing (`_to_copy`, `index_copy`,
`_unsafe_view`, `slice_scatter`, `constant_pad_nd`, ...). A word of another op (`add`, `mul`, `bmm`,
`where`, `fill`, `arange`) makes a pointwise kernel elementwise, index arithmetic included: a kernel
that writes a static KV cache and computes where (`_unsafe_view_add_arange_index_copy_transpose_view`)
cannot be told by its name from one that adds to the data."""

_NORM_OPS = re.compile(r"rms_?norm|layer_?norm|group_?norm|batch_?norm")
_MATMULS = frozenset(("mm", "bmm", "addmm", "baddbmm"))


def _inductor(kind: str, ops: str) -> str:
    """An Inductor kernel's category, by what its kind and ops say it computes:

    - norm, of any kind, when it names a norm op or an rsqrt with a mean or variance (the decomposed
      RMSNorm and LayerNorm);
    - a template (`tem`) is a matmul, or attention when it names one (flex attention);
    - a reduction (`red`, `per`) that names a matmul is one (a skinny mm decomposed into mul and sum);
      any other reduction (sum, max, softmax) is "other", like PyTorch's own `reduce_kernel`;
    - a pointwise kernel (`poi`, `for`) is a copy when every op only moves or casts data, else elementwise,
      whatever its ops' names say: a `bmm` with K = 1 is an outer product, and a pointwise kernel that
      names an attention op prepares that op's inputs (their layout, the rotary embedding, the mask).
    """
    words = {w for w in ops.split("_") if w}
    if _NORM_OPS.search(ops) or ("rsqrt" in words and words & {"mean", "var"}):
        return "norm"
    if kind == "tem":
        return "attention" if "attention" in words else "gemm"
    if kind in ("red", "per"):
        return "gemm" if words & _MATMULS else OTHER
    return "copy" if words and words <= _MOVES else "elementwise"


@lru_cache(maxsize=65536)
def categorize(kernel_name: str) -> str:
    """The category of a GPU kernel (or memcpy/memset) name."""
    inductor = _INDUCTOR.fullmatch(kernel_name)
    if inductor:
        return _inductor(inductor[1].lower(), inductor[2].lower())
    name = _PLUMBING.sub("", kernel_name)
    for category, pattern in _COMPILED:
        if pattern.search(name):
            return category
    return OTHER
