"""Quantized weights (MXFP8, MXFP4, NVFP4, FP8 per output channel) and the ops on them.

formats.py        the formats: codes, exact dequantization references, `QWeight` (one resident weight)
linear.py         the GEMM ops on quantized weights and their references; `qlinear` / `qgrouped`
moe.py            the `moe_quant` op (the `moe` op over quantized experts) and its reference
moe_lora.py       the `moe_lora` op: `moe` / `moe_quant` with each token's LoRA adapter on the MLPs
cuda.py           the GEMMs' CUDA variants (registered where Triton imports): gemv.py's GEMVs for a few
                  rows, triton_kernels.py's tile and grouped kernels, cuBLAS's scaled FP8 GEMMs
moe_cuda.py       the `moe_quant` op's CUDA variants (batched: a decode step's 1..32 rows, expert-major;
                  decode on the GEMVs; grouped)
humming.py        humming-kernels (the `humming` extra) as the `moe_quant` variant for packs laid out for it
                  at load (`lay_out`): W4A16 / W4A8 grouped GEMMs with no dequantize pass
"""
from __future__ import annotations

from .._triton import HAS_TRITON
from .formats import (E2M1_VALUES, FORMATS, FP8_MAX, PER_BYTE, SCALE_BLOCK, QWeight, dequant_fp8, dequant_mxfp4,  # noqa: F401
                      dequant_mxfp8, dequant_nvfp4, e2m1_to_float, e8m0_to_float, pack_fp4, random_qweight,
                      unpack_fp4)
from .linear import qgrouped, qlinear, quantize_fp8_rows  # noqa: F401
from . import moe, moe_lora  # noqa: F401,E402  (register moe_quant's reference and moe_lora)

if HAS_TRITON:
    from . import cuda, moe_cuda  # noqa: F401  (register the CUDA variants, the GEMVs first)
    from . import humming  # noqa: F401  (its variant takes only packs laid out for it)
