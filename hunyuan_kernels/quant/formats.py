"""Quantized weight formats: the codes, the exact dequantization references, and `QWeight`, one resident
quantized weight. Every op takes plain tensors, never a format object (this package imports nothing
of `engine`):

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

`QWeight` carries one resident quantized weight (its format name and plain tensors) for the modules
and the quantized `moe` op (quant/moe.py); the GEMMs on such weights are quant/linear.py's ops.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..registry import reference

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


# ---------------------------------------------------------------- MX packs folded per output channel
def _mx_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """The element values of an MX pack's codes (before the block scales), float32 [..., N, K]."""
    if fmt == "mxfp8":
        return codes.float()
    if fmt == "mxfp4":
        return e2m1_to_float(unpack_fp4(codes))
    raise ValueError(f"fold_mx folds mxfp8 or mxfp4 codes, not {fmt}")


def fold_mx(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "mxfp8") -> tuple[torch.Tensor, torch.Tensor]:
    """An MX pack (`fmt` "mxfp8": codes float8_e4m3fn [..., N, K]; "mxfp4": two E2M1 codes a byte [..., N, K/2];
    E8M0 scales [..., N, K/32]) -> FP8 per output channel (codes float8_e4m3fn [..., N, K], fp32 scale
    [..., N, 1]), the layout cuBLAS's row-wise scaled FP8 GEMMs multiply: each row's scale is its largest block
    scale, and every other block's values are multiplied by the power of two between the two (exact in fp32)
    and rounded once to E4M3 (nearest even). A block at the row's largest scale stays exact (E2M1's values are
    E4M3 values); a block d binades below loses only the values that fall under E4M3's normal range (|value| <
    2^(d-6)), each by at most half a subnormal step, 2^-10 of the row's scale: far under the per-token FP8
    rounding of the activations these weights then meet (MXFP4: exact for d <= 8). `fold_rounded` counts them."""
    e = scales.to(torch.int32)
    if bool((e == 255).any()):
        raise ValueError("fold_mx: an E8M0 scale byte is 255 (NaN)")
    top = e.amax(dim=-1, keepdim=True)
    folded = _blocks(_mx_values(codes, fmt), torch.exp2((e - top).float()))
    return folded.to(torch.float8_e4m3fn), e8m0_to_float(top.to(torch.uint8))


def fold_rounded(codes: torch.Tensor, scales: torch.Tensor, fmt: str = "mxfp8") -> tuple[float, float]:
    """What `fold_mx` rounds in one weight: (the share of its elements whose value changes, the largest
    change over its row's largest dequantized magnitude)."""
    wq, s = fold_mx(codes, scales, fmt)
    exact = _blocks(_mx_values(codes, fmt), e8m0_to_float(scales))
    diff = (wq.float() * s - exact).abs()
    row_max = exact.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return (diff > 0).float().mean().item(), (diff / row_max).max().item()


# ---------------------------------------------------------------- resident quantized weights
FORMATS = ("mxfp8", "mxfp4", "nvfp4", "fp8")
SCALE_BLOCK = {"mxfp8": MX_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NV_BLOCK, "fp8": None}
PER_BYTE = {"mxfp8": 1, "mxfp4": 2, "nvfp4": 2, "fp8": 1}


@dataclass(frozen=True, eq=False)
class KernelLayout:
    """How a resident quantized pack was laid out at load for one kernel family (humming.py): that family's
    codes and scales replace the plain ones in the `QWeight` (same memory: a permutation of the codes, the
    scales rebased where the family folds them), so no conversion runs per step. Host-known: the kernel's
    name, the logical [..., N, K] shape, the activations' dtype it multiplies in ("bf16" or "fp8"), the
    family's own config object; `scale2`: the family's per-matrix fp32 remainder of folded scales, if any.
    The leading dim of codes, scales and scale2 is the pack's micro (one laid-out matrix stack per micro)."""
    kernel: str
    shape: tuple[int, ...]
    activations: str
    config: object
    scale2: torch.Tensor | None = None


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
    layout: "KernelLayout | None" = None    # None: the plain layout above; else laid out at load for one kernel

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized weight format {self.fmt!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., N, K] shape."""
        if self.layout is not None:
            return self.layout.shape
        return (*self.codes.shape[:-1], self.codes.shape[-1] * PER_BYTE[self.fmt])

    def _plain(self, what: str) -> None:
        if self.layout is not None:
            raise ValueError(f"{what} reads the plain layout of a {self.fmt} weight, but this one was laid out at load "
                             f"for the {self.layout.kernel!r} kernels (only their variants read it)")

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.scales, self.gscale) if t is not None)

    def __getitem__(self, index) -> "QWeight":
        """Index / slice the leading dims (never N or K)."""
        self._plain("indexing")
        g = self.gscale
        if g is not None and g.dim() == self.codes.dim():     # a gscale per index of the first dim
            g = g[index]
        return replace(self, codes=self.codes[index], scales=self.scales[index], gscale=g)

    def flat_rows(self) -> "QWeight":
        """[..., N, K] -> [prod(...) * N, K] (a view when the leading dims are contiguous); one global
        scale for all of them (a shared MLP's micros, never an expert pack)."""
        if self.gscale is not None and self.gscale.numel() != 1:
            raise ValueError("flat_rows would mix matrices with different global scales")
        self._plain("flat_rows")
        return replace(self, codes=self.codes.reshape(-1, self.codes.shape[-1]),
                       scales=self.scales.reshape(-1, self.scales.shape[-1]))

    def cols(self, start: int, stop: int) -> "QWeight":
        """Input columns [start, stop) (element indices, on whole scale blocks) of every matrix: a
        micro block of a cols-packed [N, micros * c] weight or of an [E, N, micros * c] expert pack (a
        strided view of the same codes). Codes and block scales sliced to match, per-channel scales and
        the global scales kept."""
        self._plain("cols")
        b = SCALE_BLOCK[self.fmt]
        if b and (start % b or stop % b):
            raise ValueError(f"columns {start}:{stop} cut the {self.fmt} scale blocks of {b}")
        pb = PER_BYTE[self.fmt]
        scales = self.scales[..., start // b:stop // b] if b else self.scales
        return replace(self, codes=self.codes[..., start // pb:stop // pb], scales=scales)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        self._plain("dequantize")
        if self.fmt == "mxfp8":
            return dequant_mxfp8(self.codes, self.scales, dtype)
        if self.fmt == "mxfp4":
            return dequant_mxfp4(self.codes, self.scales, dtype)
        if self.fmt == "nvfp4":
            return dequant_nvfp4(self.codes, self.scales, self.gscale, self.inverse, dtype)
        return dequant_fp8(self.codes, self.scales, dtype)


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
