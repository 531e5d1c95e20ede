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
- `grouped_mm_fp8(x, wq, w_scale, offs)`: rows of x quantized per row, wq [G, N, K] / w_scale [G, N, 1],
  as `torch._scaled_grouped_mm` computes with row-wise scales.

`QWeight` carries one resident quantized weight (its format name and plain tensors) for the modules
and the quantized `moe` op; `qlinear` / `qgrouped` call the op of its format.

CUDA backends (registered below, `quant_triton.py` / `torch._scaled_mm`): "triton" for the weight-only
linear and grouped GEMMs (bf16 / fp16 activations) and the row quantizer; "scaled_mm" for the FP8 ones.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .registry import backend, reference

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


# ---------------------------------------------------------------- resident quantized weights
FORMATS = ("mxfp8", "mxfp4", "nvfp4", "fp8")
SCALE_BLOCK = {"mxfp8": MX_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NV_BLOCK, "fp8": None}
PER_BYTE = {"mxfp8": 1, "mxfp4": 2, "nvfp4": 2, "fp8": 1}


@dataclass(frozen=True)
class QWeight:
    """One quantized weight [..., N, K] as plain tensors: `fmt` one of FORMATS ("fp8": E4M3 with an
    fp32 scale per output channel); codes [..., N, K / PER_BYTE]; scales [..., N, K / block] or
    [..., N, 1] (fp8); gscale (nvfp4) fp32, broadcasting against scales from the right ([] for one
    matrix, [E, 1, 1] for the experts of a [micros, E, N, K] gate/up pack or an [E, N, K] down pack),
    `inverse`: it divides the block scale. Leading dims are the packed layout's; indexing the first
    one indexes a gscale only when the gscale has that dim too (an expert's global scale is the same
    in every micro)."""
    fmt: str
    codes: torch.Tensor
    scales: torch.Tensor
    gscale: torch.Tensor | None = None
    inverse: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized weight format {self.fmt!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape."""
        return (*self.codes.shape[:-1], self.codes.shape[-1] * PER_BYTE[self.fmt])

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.scales, self.gscale) if t is not None)

    def __getitem__(self, index) -> "QWeight":
        """Index / slice the leading dims (never N or K)."""
        g = self.gscale
        if g is not None and g.dim() == self.codes.dim():     # a gscale per index of the first dim
            g = g[index]
        return replace(self, codes=self.codes[index], scales=self.scales[index], gscale=g)

    def flat_rows(self) -> "QWeight":
        """[..., N, K] -> [prod(...) * N, K] (a view when the leading dims are contiguous); one global
        scale for all of them (a shared MLP's micros, never an expert pack)."""
        if self.gscale is not None and self.gscale.numel() != 1:
            raise ValueError("flat_rows would mix matrices with different global scales")
        return replace(self, codes=self.codes.reshape(-1, self.codes.shape[-1]),
                       scales=self.scales.reshape(-1, self.scales.shape[-1]))

    def cols(self, start: int, stop: int) -> "QWeight":
        """Input columns [start, stop) (element indices, on whole scale blocks) of every matrix: a
        micro block of a cols-packed [N, micros * c] weight or of an [E, N, micros * c] expert pack (a
        strided view of the same codes). Codes and block scales sliced to match, per-channel scales and
        the global scales kept."""
        b = SCALE_BLOCK[self.fmt]
        if b and (start % b or stop % b):
            raise ValueError(f"columns {start}:{stop} cut the {self.fmt} scale blocks of {b}")
        pb = PER_BYTE[self.fmt]
        scales = self.scales[..., start // b:stop // b] if b else self.scales
        return replace(self, codes=self.codes[..., start // pb:stop // pb], scales=scales)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "mxfp8":
            return dequant_mxfp8(self.codes, self.scales, dtype)
        if self.fmt == "mxfp4":
            return dequant_mxfp4(self.codes, self.scales, dtype)
        if self.fmt == "nvfp4":
            return dequant_nvfp4(self.codes, self.scales, self.gscale, self.inverse, dtype)
        return dequant_fp8(self.codes, self.scales, dtype)


def qlinear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [..., K] @ W^T through the registry op of W's format (a host-known string, never data)."""
    from .registry import call
    if w.fmt == "nvfp4":
        return call("linear_nvfp4", x, w.codes, w.scales, w.gscale, w.inverse)
    return call("linear_" + w.fmt, x, w.codes, w.scales)


def qgrouped(x: torch.Tensor, w: QWeight, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group times W[g]^T ([G, N, K]), offs as torch._grouped_mm."""
    from .registry import call
    if w.fmt == "nvfp4":
        return call("grouped_mm_nvfp4", x, w.codes, w.scales, w.gscale, w.inverse, offs)
    return call("grouped_mm_" + w.fmt, x, w.codes, w.scales, offs)


# ---------------------------------------------------------------- CUDA backends
_HALF = (torch.bfloat16, torch.float16)


def _triton_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from . import quant_triton  # noqa: F401
    except ImportError:
        return False
    return True


def _fp8_available() -> bool:
    return (torch.cuda.is_available() and hasattr(torch, "_scaled_mm") and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability() >= (8, 9) and _triton_available())


def _tk():
    from . import quant_triton        # imported once by _triton_available; here a module-cache lookup
    return quant_triton


def _fits(x: torch.Tensor, codes: torch.Tensor) -> bool:
    return codes.stride(-1) == 1 and x.device == codes.device


@backend("linear_mxfp8", "triton", devices=("cuda",), dtypes=_HALF, available=_triton_available)
def linear_mxfp8_triton(x, codes, scales):
    if not _fits(x, codes):
        return linear_mxfp8(x, codes, scales)
    if _gemv_rows(x, codes, "mxfp8"):
        return _gemv().linear(x, "mxfp8", codes, scales)
    return _tk().linear(x, "mxfp8", codes, scales)


# Dense linears of a few tokens (decode: at most quant_gemv.LINEAR_MAX_M rows) on quant_gemv's GEMV, per
# format, instead of the split-K tile kernel (MXFP8, NVFP4), or
# torch._scaled_mm (FP8: the activations quantized per row first, as W8A8 does). The rows count is a
# host-known shape. bench/bench_kernels_quant.py --decode times both sides.
GEMV_LINEAR = {"mxfp8": True, "mxfp4": True, "nvfp4": True, "fp8": False}


def _gemv():
    from . import quant_gemv
    return quant_gemv


def _gemv_rows(x: torch.Tensor, codes: torch.Tensor, fmt: str) -> bool:
    qg = _gemv()
    return (GEMV_LINEAR.get(fmt, False) and x.numel() // x.shape[-1] <= qg.LINEAR_MAX_M
            and qg.fits(codes, x.shape[-1], fmt))


@backend("linear_mxfp4", "triton", devices=("cuda",), dtypes=_HALF, available=_triton_available)
def linear_mxfp4_triton(x, packed, scales):
    if not _fits(x, packed):
        return linear_mxfp4(x, packed, scales)
    if _gemv_rows(x, packed, "mxfp4"):
        return _gemv().linear(x, "mxfp4", packed, scales)
    return _tk().linear(x, "mxfp4", packed, scales)


@backend("linear_nvfp4", "triton", devices=("cuda",), dtypes=_HALF, available=_triton_available)
def linear_nvfp4_triton(x, packed, scales, global_scale, inverse):
    if not _fits(x, packed) or global_scale.numel() != 1:
        return linear_nvfp4(x, packed, scales, global_scale, inverse)
    if _gemv_rows(x, packed, "nvfp4"):
        return _gemv().linear(x, "nvfp4", packed, scales, global_scale.reshape(()).float(), inverse)
    return _tk().linear(x, "nvfp4", packed, scales, global_scale.reshape(()).float(), inverse)


def _grouped_fits(x, codes, offs) -> bool:
    return _fits(x, codes) and codes.dim() == 3 and offs.dtype == torch.int32 and x.stride(-1) == 1


@backend("grouped_mm_mxfp8", "triton", devices=("cuda",), dtypes=_HALF, available=_triton_available)
def grouped_mm_mxfp8_triton(x, codes, scales, offs):
    if not _grouped_fits(x, codes, offs):
        return grouped_mm_mxfp8(x, codes, scales, offs)
    return _tk().grouped(x, "mxfp8", codes, scales, offs)


@backend("grouped_mm_mxfp4", "triton", devices=("cuda",), dtypes=_HALF, available=_triton_available)
def grouped_mm_mxfp4_triton(x, packed, scales, offs):
    if not _grouped_fits(x, packed, offs):
        return grouped_mm_mxfp4(x, packed, scales, offs)
    return _tk().grouped(x, "mxfp4", packed, scales, offs)


@backend("grouped_mm_nvfp4", "triton", devices=("cuda",), dtypes=_HALF, available=_triton_available)
def grouped_mm_nvfp4_triton(x, packed, scales, global_scale, inverse, offs):
    g = global_scale.float()
    if not _grouped_fits(x, packed, offs) or g.numel() not in (1, packed.shape[0]):
        return grouped_mm_nvfp4(x, packed, scales, global_scale, inverse, offs)
    g = g.reshape(()) if g.numel() == 1 and g.dim() != 3 else g.reshape(-1, 1, 1)
    return _tk().grouped(x, "nvfp4", packed, scales, offs, g, inverse)


@backend("quantize_fp8_rows", "triton", devices=("cuda",), dtypes=(torch.bfloat16, torch.float16, torch.float32),
         available=_triton_available)
def quantize_fp8_rows_triton(x):
    return _tk().quantize_rows(x)


# cuBLAS's FP8 fast accumulation (the tensor core's own accumulator, no periodic promotion to fp32): on
# the H200 a hybrid4 rank's DiT step runs 106 ms with it and 202 ms without (bf16: 134), the error stays
# far below FP8's own rounding (the GPU tests' tolerance holds), and vLLM's SM90 FP8 GEMMs use it too.
FP8_FAST_ACCUM = True


def _scaled_mm_fits(k: int, n: int, dtype: torch.dtype) -> bool:
    return k % 16 == 0 and n % 16 == 0 and dtype == torch.bfloat16


@backend("fp8_scaled_mm", "scaled_mm", devices=("cuda",), dtypes=(torch.float8_e4m3fn,), available=_fp8_available)
def fp8_scaled_mm_cuda(xq, x_scale, wq, w_scale, dtype):
    if not _scaled_mm_fits(xq.shape[1], wq.shape[0], dtype) or wq.stride(1) != 1:
        return fp8_scaled_mm(xq, x_scale, wq, w_scale, dtype)
    return torch._scaled_mm(xq, wq.t(), scale_a=x_scale.float().reshape(-1, 1).contiguous(),
                            scale_b=w_scale.float().reshape(1, -1).contiguous(), out_dtype=dtype,
                            use_fast_accum=FP8_FAST_ACCUM)


@backend("linear_fp8", "scaled_mm", devices=("cuda",), dtypes=(torch.bfloat16,), available=_fp8_available)
def linear_fp8_cuda(x, wq, w_scale):
    k, n = x.shape[-1], wq.shape[0]
    if not _scaled_mm_fits(k, n, x.dtype) or wq.stride(1) != 1 or w_scale.numel() != n:
        return linear_fp8(x, wq, w_scale)
    if _gemv_rows(x, wq, "fp8") and w_scale.dim() == 2:
        return _gemv().linear(_tk().quantize_rows(x, fake=True), "fp8", wq, w_scale.float())
    xq, xs = _tk().quantize_rows(x.reshape(-1, k))
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


@backend("grouped_mm_fp8", "scaled_mm", devices=("cuda",), dtypes=(torch.bfloat16,), available=_fp8_available)
def grouped_mm_fp8_cuda(x, wq, w_scale, offs):
    k, n = x.shape[-1], wq.shape[1]
    if not (_scaled_mm_fits(k, n, x.dtype) and wq.is_contiguous() and offs.dtype == torch.int32):
        return grouped_mm_fp8(x, wq, w_scale, offs)
    xq, xs = _tk().quantize_rows(x)
    return scaled_grouped(xq, xs, wq, w_scale.float(), offs, x.dtype)


# ---------------------------------------------------------------- test and bench inputs
def random_qweight(fmt: str, shape: tuple[int, ...], std: float = 1.0, device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None, inverse: bool = False,
                   gscale_dims: int = 0) -> QWeight:
    """Random codes and scales of a [..., N, K] weight whose dequantized values have about `std`:
    every code value occurs (all 16 nibbles, every finite E4M3 byte up to the range used) and block
    scales vary by a factor of 2 around the level, so kernels are checked on every element and every
    block. Drawn on `device` (real shapes are GBs). gscale_dims (nvfp4): how many trailing leading
    dims get their own global scale (1 for a [micros, E, N, K] expert pack: one per expert)."""
    *lead, n, k = shape
    kw = dict(device=device, generator=generator)
    b = SCALE_BLOCK[fmt]

    def jitter(*s):                                # -1, 0 or +1 binade per block
        return torch.randint(-1, 2, s, **kw)
    if fmt in ("mxfp8", "fp8"):
        codes = (torch.randn(*lead, n, k, **kw) * 64).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        level = std / 64
    else:
        codes = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, **kw)
        level = std / 2.9                            # RMS of the 16 E2M1 values
    if fmt == "fp8":
        scales = (level * 2.0 ** jitter(*lead, n, 1).float()).float()
        return QWeight(fmt, codes, scales)
    if fmt in ("mxfp8", "mxfp4"):
        e = round(torch.log2(torch.tensor(level)).item()) + 127
        scales = (e + jitter(*lead, n, k // b)).clamp(1, 254).to(torch.uint8)
        return QWeight(fmt, codes, scales)
    gdims = tuple(lead[len(lead) - gscale_dims:]) if gscale_dims else ()
    g = (0.5 + torch.rand(gdims, **kw)) * level / 4           # block scales near 4 in E4M3
    block = (4.0 * 2.0 ** jitter(*lead, n, k // b).float() * (0.75 + 0.5 * torch.rand(*lead, n, k // b, **kw)))
    scales = block.to(torch.float8_e4m3fn)
    gscale = (1.0 / g if inverse else g).float().reshape((*gdims, 1, 1) if gdims else ())
    return QWeight(fmt, codes, scales, gscale, inverse)
