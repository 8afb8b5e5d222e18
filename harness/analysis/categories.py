"""Which kind of work a GPU kernel does, judged by its name.

One ordered table: the first category with a pattern found in the kernel's name wins, matching is
case-insensitive, and a name that matches nothing is "other". Order matters because kernel names
carry their template arguments, so one name often mentions several kinds of work:

- communication first: fused all-reduce kernels also name the RMSNorm they fuse;
- norm before attention: flashinfer's `flashinfer::norm::RMSNormKernel` lives beside its attention;
- moe and attention before gemm: `fused_moe_kernel` and cutlass FMHA kernels are GEMMs inside;
- gemm before copy: cutlass templates name their `NumericConverter`;
- copy before elementwise: PyTorch's dtype cast (the FP8->BF16 KV-cache cast of the GLM-5 campaign's trace) is
  `at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda ...>`, which is a copy.

To teach it a new kernel, add a pattern to the right row (patterns are regular expressions).
"""

from __future__ import annotations

import re
from functools import lru_cache

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all_?reduce", "all_?gather", "reduce_?scatter", "mscclpp",
                       "cross_device", "all_?to_?all", "deep_?ep")),
    ("norm", ("rms_?norm", "layer_?norm", "norm_kernel")),
    ("moe", ("moe", "expert", "topk", "router", "permute")),
    # Bare "flash" would also claim flashinfer's activation and sampling kernels.
    ("attention", ("flash_?attn", "flash_fwd", "flash_bwd", "flash::", "fmha", "attention",
                   "batchdecode", "batchprefill", "mla", "paged")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "matmul", "mm_")),
    ("copy", ("copy", "memcpy", "memset", "(?<!broad)cast", "convert")),
    ("elementwise", ("elementwise", "vectorized", "act_and_mul", "silu", "gelu", "add", "mul",
                     "rotary")),
)
OTHER = "other"
NAMES: tuple[str, ...] = tuple(name for name, _ in CATEGORIES) + (OTHER,)
"""Every category, in the table's order, for reports that list them all."""

_COMPILED = tuple((name, re.compile("|".join(patterns), re.IGNORECASE)) for name, patterns in CATEGORIES)


@lru_cache(maxsize=65536)
def categorize(kernel_name: str) -> str:
    """The category of a GPU kernel (or memcpy/memset) name."""
    for name, pattern in _COMPILED:
        if pattern.search(kernel_name):
            return name
    return OTHER
