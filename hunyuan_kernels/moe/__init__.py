"""The `moe` op (routed + shared mixture of experts of one rank, deterministic fp32 finalize) and its
variants, preferred in this order:

    decode   CUDA bf16, N <= cuda.DECODE_MAX_TOKENS: reads only the chosen experts
    fused    CUDA bf16, the grouped path with GEMM1 + SwiGLU in one kernel (gemm1.py), where it fits
    grouped  CUDA bf16, the grouped path on torch._grouped_mm
    torch    the reference, every device

reference.py  the op's definition and reference, and the routing helpers the quantized op shares
cuda.py       the CUDA variants (registered where Triton imports); triton_kernels.py, gemm1.py their kernels
"""
from __future__ import annotations

from .._triton import HAS_TRITON
from . import reference  # noqa: F401  (registers the reference)
from .reference import check_packs, moe_reference, route, routed_reference, swiglu_halves  # noqa: F401

if HAS_TRITON:
    from . import cuda  # noqa: F401  (registers the CUDA variants)
