"""Quantized weights: exact dequantization references and the weight-only / FP8 GEMM references that the
GPU backends (Triton, phase 2) will be checked against. Every op takes plain tensors, never a format
object (this package imports nothing of `engine`):

- `dequant_mxfp8(codes, scales, dtype)`: codes float8_e4m3fn [..., N, K], scales uint8 E8M0 [..., N, K/32].
- `dequant_mxfp4(packed, scales, dtype)`: packed uint8 [..., N, K/2], two E2M1 codes a byte, the even
  column in the low nibble; scales uint8 E8M0 [..., N, K/32].
- `dequant_nvfp4(packed, scales, global_scale, inverse, dtype)`: packed as MXFP4, scales float8_e4m3fn
  [..., N, K/16], global_scale a float32 scalar that multiplies the block scale (ModelOpt's
  `weight_scale_2`) or, with `inverse=True`, divides it (compressed-tensors' `weight_global_scale`).
- `dequant_fp8(codes, scale, dtype)`: codes float8_e4m3fn [..., N, K], scale float32 [] (per tensor) or
  [..., N, 1] (per output channel).

Each computes in float32 in the tools' own order (block scale first, then times the element) and rounds
once to `dtype`. MX dequantization is exact (an element times a power of two); NVFP4 rounds the
block scale over the global scale once in float32, as compressed-tensors and ModelOpt do.

GEMMs on quantized weights, with the activation first so the registry dispatches on its device and
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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import reference

MX_BLOCK = 32
NV_BLOCK = 16
FP8_MAX = 448.0            # largest finite float8_e4m3fn
# E2M1 values by raw 4-bit code: bit 3 the sign, bits 0-2 index the magnitudes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> raw 4-bit codes uint8 [..., K]; byte j holds column 2j (low nibble) and 2j+1."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of `unpack_fp4`: raw codes uint8 [..., K] (K even) -> [..., K/2]."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Raw 4-bit codes -> float32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2^(b - 127), built from the bits (exact; byte 0 is the subnormal 2^-127,
    byte 255 is NaN as in OCP MX)."""
    b = scales.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _blocks(values: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """values [..., N, K] times block_scales [..., N, K/b] broadcast over each block of b columns."""
    K, nb = values.shape[-1], block_scales.shape[-1]
    if K != nb * (K // nb):
        raise ValueError(f"{K} columns do not split into {nb} scale blocks")
    out = values.unflatten(-1, (nb, K // nb)) * block_scales.unsqueeze(-1)
    return out.flatten(-2)


@reference("dequant_mxfp8")
def dequant_mxfp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _blocks(codes.float(), e8m0_to_float(scales)).to(dtype)


@reference("dequant_mxfp4")
def dequant_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _blocks(e2m1_to_float(unpack_fp4(packed)), e8m0_to_float(scales)).to(dtype)


def nvfp4_block_scales(scales: torch.Tensor, global_scale: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The effective float32 scale of each 16-block: fp8 block scale / or * the global scale."""
    s, g = scales.float(), global_scale.float()
    return s / g if inverse else s * g


@reference("dequant_nvfp4")
def dequant_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, inverse: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    return _blocks(e2m1_to_float(unpack_fp4(packed)), nvfp4_block_scales(scales, global_scale, inverse)).to(dtype)


@reference("dequant_fp8")
def dequant_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float()).to(dtype)


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
    """Symmetric E4M3 per row of the last dimension: scale = amax / 448 (an all-zero row gets scale 1)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
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
