"""GEMMs on quantized weights, with the activation first so the registry dispatches on its device and
dtype (a W4A16 / W8A16 backend is an entry for (cuda, bfloat16); callers never change):
- `linear_mxfp8 / linear_mxfp4 (x, codes, scales)`, `linear_nvfp4 (x, packed, scales, global_scale,
  inverse)`: x [..., K] -> [..., N].
- `grouped_mm_mxfp8 / grouped_mm_mxfp4 (x, codes, scales, offs)`, `grouped_mm_nvfp4 (x, packed, scales,
  global_scale, inverse, offs)`: rows of x sorted by group, weights [G, N, ·], offs int32 cumulative end
  rows per group (as `torch._grouped_mm`) -> [T, N].
Online FP8 (weights per output channel, activations per token, both symmetric E4M3 with scale
amax / 448):
- `quantize_fp8_rows(x)` -> (codes float8_e4m3fn, scale float32 [..., 1]) per row of the last dim.
- `fp8_scaled_mm(xq, x_scale, wq, w_scale, dtype)`: (xq @ wq^T) * x_scale * w_scale^T, as
  `torch._scaled_mm` computes with row-wise scales.
- `linear_fp8(x, wq, w_scale)`: x quantized per token, then `fp8_scaled_mm`.
- `grouped_mm_fp8(x, wq, w_scale, offs)`: rows of x quantized per row, wq [G, N, K] / w_scale [G, N, 1],
  as `torch._scaled_grouped_mm` computes with row-wise scales.

`qlinear` / `qgrouped` call the op of a `QWeight`'s format. The CUDA variants are quant/cuda.py's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import call, reference
from .formats import FP8_MAX, QWeight, dequant_mxfp4, dequant_mxfp8, dequant_nvfp4

# ---------------------------------------------------------------- weight-only GEMMs (W8A16 / W4A16)
@reference("linear_mxfp8")
def linear_mxfp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequant_mxfp8(codes, scales, x.dtype))


@reference("linear_mxfp4")
def linear_mxfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequant_mxfp4(packed, scales, x.dtype))


@reference("linear_nvfp4")
def linear_nvfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 inverse: bool) -> torch.Tensor:
    return F.linear(x, dequant_nvfp4(packed, scales, global_scale, inverse, x.dtype))


def _grouped(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)


@reference("grouped_mm_mxfp8")
def grouped_mm_mxfp8(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped(x, dequant_mxfp8(codes, scales, x.dtype), offs)


@reference("grouped_mm_mxfp4")
def grouped_mm_mxfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped(x, dequant_mxfp4(packed, scales, x.dtype), offs)


@reference("grouped_mm_nvfp4")
def grouped_mm_nvfp4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                     inverse: bool, offs: torch.Tensor) -> torch.Tensor:
    return _grouped(x, dequant_nvfp4(packed, scales, global_scale, inverse, x.dtype), offs)


# ---------------------------------------------------------------- online FP8 (W8A8)
@reference("quantize_fp8_rows")
def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric E4M3 per row of the last dimension: scale = amax / 448 (an all-zero row gets scale 1).
    Both divisions are IEEE divisions on every device: on CUDA, torch divides by a Python number as a
    multiplication by its reciprocal, which is an ulp off for some rows, so the 448 is a tensor."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


@reference("fp8_scaled_mm")
def fp8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] fp8 with x_scale [M, 1], wq [N, K] fp8 with w_scale [N, 1] -> [M, N] in `dtype`."""
    acc = xq.float() @ wq.float().t()
    return (acc * x_scale.float() * w_scale.float().t()).to(dtype)


@reference("linear_fp8")
def linear_fp8(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] quantized per token, times per-output-channel FP8 weights wq [N, K] / w_scale [N, 1]."""
    xq, xs = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    return fp8_scaled_mm(xq, xs, wq, w_scale, x.dtype).reshape(*x.shape[:-1], wq.shape[0])


@reference("grouped_mm_fp8")
def grouped_mm_fp8(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [T, K] rows sorted by group (quantized per row here), wq [G, N, K] fp8 with w_scale [G, N, 1]."""
    return fp8_grouped_rows(*quantize_fp8_rows(x), wq, w_scale, offs, x.dtype)


def fp8_grouped_rows(xq: torch.Tensor, xs: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                     offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The grouped FP8 GEMM on rows already quantized per row (xq [T, K], xs [T, 1]), in fp32."""
    acc = torch._grouped_mm(xq.float(), wq.float().transpose(1, 2), offs=offs)
    group = torch.searchsorted(offs, torch.arange(xq.shape[0], device=xq.device, dtype=offs.dtype), right=True)
    ws = w_scale[..., 0].float()[group.clamp_max(wq.shape[0] - 1).long()]
    return (acc * xs * ws).to(dtype)


def qlinear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [..., K] @ W^T through the registry op of W's format (a host-known string, never data)."""
    if w.fmt == "nvfp4":
        return call("linear_nvfp4", x, w.codes, w.scales, w.gscale, w.inverse)
    return call("linear_" + w.fmt, x, w.codes, w.scales)


def qgrouped(x: torch.Tensor, w: QWeight, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group times W[g]^T ([G, N, K]), offs as torch._grouped_mm."""
    if w.fmt == "nvfp4":
        return call("grouped_mm_nvfp4", x, w.codes, w.scales, w.gscale, w.inverse, offs)
    return call("grouped_mm_" + w.fmt, x, w.codes, w.scales, offs)
