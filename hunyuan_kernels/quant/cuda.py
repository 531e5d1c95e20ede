"""The CUDA variants of the quantized GEMM ops (definitions and references: linear.py), registered where
Triton imports, preferred in the order they are registered here:

  linear_mxfp8 / linear_mxfp4 / linear_nvfp4
      gemv    decode-sized inputs (at most gemv.LINEAR_MAX_M rows): gemv.py's GEMV on the codes as loaded
      triton  any other: triton_kernels.py's split-K tile kernel (dequantized tiles into bf16 MMAs)
  grouped_mm_mxfp8 / _mxfp4 / _nvfp4   triton: triton_kernels.py's grouped kernel
  quantize_fp8_rows                    triton
  fp8_scaled_mm / linear_fp8 / grouped_mm_fp8
      gemv       (linear_fp8) decode-sized inputs: the rows quantized per token, dequantized, on gemv.py's GEMV
      scaled_mm  cuBLAS's row-wise scaled FP8 GEMMs (torch._scaled_mm / _scaled_grouped_mm), rows
                 quantized per row by the Triton quantizer

Each variant's `fits` names the shapes and layouts it takes (host-known); the reference runs the rest.
"""
from __future__ import annotations

import torch

from ..registry import backend
from . import gemv
from . import triton_kernels as tk
from .linear import fp8_grouped_rows

HALF = (torch.bfloat16, torch.float16)

# cuBLAS's FP8 fast accumulation (the tensor core's own accumulator, no periodic promotion to fp32): on
# the H200 a hybrid4 rank's DiT step ran 106 ms with it and 202 ms without (bf16: 134) (bench_one_gpu.py
# --fp8-speedup, 2026-11-30; now `python -m bench one-gpu --fp8-speedup`); the error stays far below FP8's own rounding (the GPU tests' tolerance
# holds), and vLLM's SM90 FP8 GEMMs use it too.
FP8_FAST_ACCUM = True


def available() -> bool:
    return torch.cuda.is_available()


def fp8_available() -> bool:
    return (torch.cuda.is_available() and hasattr(torch, "_scaled_mm") and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability() >= (8, 9))


def _fits(x: torch.Tensor, codes: torch.Tensor) -> bool:
    return codes.stride(-1) == 1 and x.device == codes.device


def _gemv_fits(x: torch.Tensor, codes: torch.Tensor, fmt: str) -> bool:
    return (_fits(x, codes) and x.numel() // x.shape[-1] <= gemv.LINEAR_MAX_M
            and gemv.fits(codes, x.shape[-1], fmt))


def _one_gscale(g: torch.Tensor) -> torch.Tensor:
    return g.reshape(()).float()


# ------------------------------------------------------------------------ weight-only linears

@backend("linear_mxfp8", "gemv", dtypes=HALF, available=available,
         fits=lambda x, codes, scales: _gemv_fits(x, codes, "mxfp8"))
def linear_mxfp8_gemv(x, codes, scales):
    return gemv.linear(x, "mxfp8", codes, scales)


@backend("linear_mxfp8", "triton", dtypes=HALF, available=available, fits=lambda x, codes, scales: _fits(x, codes))
def linear_mxfp8_triton(x, codes, scales):
    return tk.linear(x, "mxfp8", codes, scales)


@backend("linear_mxfp4", "gemv", dtypes=HALF, available=available,
         fits=lambda x, packed, scales: _gemv_fits(x, packed, "mxfp4"))
def linear_mxfp4_gemv(x, packed, scales):
    return gemv.linear(x, "mxfp4", packed, scales)


@backend("linear_mxfp4", "triton", dtypes=HALF, available=available, fits=lambda x, packed, scales: _fits(x, packed))
def linear_mxfp4_triton(x, packed, scales):
    return tk.linear(x, "mxfp4", packed, scales)


@backend("linear_nvfp4", "gemv", dtypes=HALF, available=available,
         fits=lambda x, packed, scales, g, inverse: _gemv_fits(x, packed, "nvfp4") and g.numel() == 1)
def linear_nvfp4_gemv(x, packed, scales, global_scale, inverse):
    return gemv.linear(x, "nvfp4", packed, scales, _one_gscale(global_scale), inverse)


@backend("linear_nvfp4", "triton", dtypes=HALF, available=available,
         fits=lambda x, packed, scales, g, inverse: _fits(x, packed) and g.numel() == 1)
def linear_nvfp4_triton(x, packed, scales, global_scale, inverse):
    return tk.linear(x, "nvfp4", packed, scales, _one_gscale(global_scale), inverse)


# ------------------------------------------------------------------------ weight-only grouped GEMMs

def _grouped_fits(x, codes, offs) -> bool:
    return _fits(x, codes) and codes.dim() == 3 and offs.dtype == torch.int32 and x.stride(-1) == 1


@backend("grouped_mm_mxfp8", "triton", dtypes=HALF, available=available,
         fits=lambda x, codes, scales, offs: _grouped_fits(x, codes, offs))
def grouped_mm_mxfp8_triton(x, codes, scales, offs):
    return tk.grouped(x, "mxfp8", codes, scales, offs)


@backend("grouped_mm_mxfp4", "triton", dtypes=HALF, available=available,
         fits=lambda x, packed, scales, offs: _grouped_fits(x, packed, offs))
def grouped_mm_mxfp4_triton(x, packed, scales, offs):
    return tk.grouped(x, "mxfp4", packed, scales, offs)


@backend("grouped_mm_nvfp4", "triton", dtypes=HALF, available=available,
         fits=lambda x, packed, scales, g, inverse, offs: (_grouped_fits(x, packed, offs)
                                                           and g.numel() in (1, packed.shape[0])))
def grouped_mm_nvfp4_triton(x, packed, scales, global_scale, inverse, offs):
    g = global_scale.float()
    g = g.reshape(()) if g.numel() == 1 and g.dim() != 3 else g.reshape(-1, 1, 1)
    return tk.grouped(x, "nvfp4", packed, scales, offs, g, inverse)


# ------------------------------------------------------------------------ online FP8 (W8A8)

@backend("quantize_fp8_rows", "triton", dtypes=(torch.bfloat16, torch.float16, torch.float32), available=available)
def quantize_fp8_rows_triton(x):
    return tk.quantize_rows(x)


def _scaled_mm_fits(k: int, n: int, dtype: torch.dtype) -> bool:
    return k % 16 == 0 and n % 16 == 0 and dtype == torch.bfloat16


@backend("fp8_scaled_mm", "scaled_mm", dtypes=(torch.float8_e4m3fn,), available=fp8_available,
         fits=lambda xq, xs, wq, ws, dtype: _scaled_mm_fits(xq.shape[1], wq.shape[0], dtype) and wq.stride(1) == 1)
def fp8_scaled_mm_cuda(xq, x_scale, wq, w_scale, dtype):
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale.float().reshape(-1, 1).contiguous(),
                            scale_b=w_scale.float().reshape(1, -1).contiguous(), out_dtype=dtype,
                            use_fast_accum=FP8_FAST_ACCUM)


@backend("linear_fp8", "gemv", dtypes=(torch.bfloat16,), available=available,
         fits=lambda x, wq, ws: _gemv_fits(x, wq, "fp8") and ws.numel() == wq.shape[0])
def linear_fp8_gemv(x, wq, w_scale):
    """W8A8 for a few tokens (decode) on gemv.py's GEMV: each row quantized per token and dequantized in the
    kernel that prepares the GEMV's activations (as the quantized MoE's decode GEMVs take FP8 activations:
    W8A8's numbers up to one bf16 rounding of each activation), times the FP8 codes: two launches, as the
    MXFP8 GEMV's, reading the weight at the bytes floor's pace, where cuBLAS's FP8 tiles are made for many rows.
    On one H200 (2026-12-05) the MXFP4 build with its MXFP8 linears folded into FP8 (its attention linears on
    this variant) decoded at 5.62 ms/token against 4.43 unfolded; which share of that is this variant's and
    which the shared MLP's FP8 decode GEMVs' is not measured (`bench kernels-quant --decode` times it against
    scaled_mm)."""
    return gemv.linear(x, "fp8", wq, w_scale, fp8_rows=True)


@backend("linear_fp8", "scaled_mm", dtypes=(torch.bfloat16,), available=fp8_available,
         fits=lambda x, wq, ws: (_scaled_mm_fits(x.shape[-1], wq.shape[0], x.dtype) and wq.stride(1) == 1
                                 and ws.numel() == wq.shape[0]))
def linear_fp8_cuda(x, wq, w_scale):
    k, n = x.shape[-1], wq.shape[0]
    xq, xs = tk.quantize_rows(x.reshape(-1, k))
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale.float().reshape(1, n).contiguous(),
                           out_dtype=x.dtype, use_fast_accum=FP8_FAST_ACCUM)
    return out.view(*x.shape[:-1], n)


def scaled_grouped(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                   offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The row-wise FP8 grouped GEMM on already quantized rows (the MoE quantizes its rows once for
    every micro): xq [T, K] / xs [T, 1], wq [G, N, K] / w_scale [G, N, 1] -> [T, N]. Shapes cuBLAS
    cannot take (rows not a multiple of 16 bytes: tiny models) run the per-group reference."""
    if xq.shape[1] % 16 or wq.shape[1] % 16:
        return fp8_grouped_rows(xq, xs, wq, w_scale, offs, dtype)
    return torch._scaled_grouped_mm(xq, wq.transpose(1, 2), xs.reshape(-1), w_scale[..., 0], offs=offs,
                                    out_dtype=dtype, use_fast_accum=FP8_FAST_ACCUM)


@backend("grouped_mm_fp8", "scaled_mm", dtypes=(torch.bfloat16,), available=fp8_available,
         fits=lambda x, wq, ws, offs: (_scaled_mm_fits(x.shape[-1], wq.shape[1], x.dtype) and wq.is_contiguous()
                                       and offs.dtype == torch.int32))
def grouped_mm_fp8_cuda(x, wq, w_scale, offs):
    xq, xs = tk.quantize_rows(x)
    return scaled_grouped(xq, xs, wq, w_scale.float(), offs, x.dtype)
