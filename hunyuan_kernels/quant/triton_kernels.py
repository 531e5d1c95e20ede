"""Triton kernels of the quantized GEMMs and their launchers (the ops and their references are linear.py's,
their CUDA variants cuda.py's; the quantized MoE pipelines that chain these are moe_cuda.py's).

Hopper has no MX / FP4 tensor cores, so every kernel here is weight-only: it loads the compact codes
and block scales, dequantizes them in registers (exactly as `formats.dequant_*` does: the element times
its block scale in fp32, rounded once to the activation dtype) and runs a bf16 MMA. Formats, as the
constexpr FMT:
  0 MXFP8  codes float8_e4m3fn [N, K],       scales uint8 E8M0 [N, K/32]
  1 MXFP4  codes uint8 [N, K/2] (E2M1 pairs, even column in the low nibble), scales E8M0 [N, K/32]
  2 NVFP4  codes as MXFP4, scales float8_e4m3fn [N, K/16], times (or, INVERSE, divided by) an fp32
           global scale per matrix
  3 FP8    codes float8_e4m3fn [N, K], scales fp32 [N, 1] (per output channel)
Kernels:
  `linear`  x [M, K] @ W^T -> [M, N]: tiles of W rows x tokens ("swap AB": the dequantized weight is
            the register operand of the MMA), grouped tile order for L2 reuse; for a few tokens a
            split over K whose fp32 partials are summed in a fixed order by a second pass.
  `grouped` rows of x sorted by group, offs = cumulative end row per group (torch._grouped_mm):
            each program finds its group from the offsets on the device (no host sync, a grid sized
            by the worst case), the same tiles as `linear`.
  `edecode_up` / `edecode_down`  the expert-major decode MoE of 1..32 rows (moe_cuda.py `batched`): one
            program per (micro, touched expert, weight row tile) over all the expert's tokens, 16 a MMA.
  `quantize_rows`  per-row symmetric E4M3 (scale amax / 448) of the online FP8 path; `fake=True` writes
            the dequantized values instead (the decode path's activations, see moe_cuda.py).
No atomics: every output element has one writer and every sum a fixed order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton import knobs

from .._triton import dot, next_pow2
from ..scratch import empty as _empty      # NaN-filled under scratch.poisoned() (tests)

# Under Triton's CPU interpreter bf16 dot operands are multiplied as raw integers (numpy has no bf16):
# the kernels then upcast them to fp32 first (see moe/triton_kernels.py).
INTERPRET = bool(knobs.runtime.interpret)

FMT = {"mxfp8": 0, "mxfp4": 1, "nvfp4": 2, "fp8": 3}
BLOCK = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16, "fp8": 1}
PER_BYTE = {"mxfp8": 1, "mxfp4": 2, "nvfp4": 2, "fp8": 1}
FP8_MAX = tl.constexpr(448.0)      # a constexpr: jit functions read no other globals


@triton.jit
def _e2m1(c):
    """Raw 4-bit E2M1 codes (uint32) -> fp32, built from the bits: magnitude codes 2..7 are normal
    numbers 2^(e-1) * (1 + m/2), code 1 is 0.5, code 0 is zero; bit 3 is the sign."""
    em = c & 7
    bits = tl.where(em > 1, (em << 22) + (126 << 23), (em * 126) << 23) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(b):
    """E8M0 bytes -> fp32 2^(b - 127) (byte 0 the subnormal 2^-127, 255 NaN), as quant.e8m0_to_float."""
    b = b.to(tl.uint32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _wload(c_ptr, s_ptr, rn, mn, k0, K, stride_c, stride_s, FMT: tl.constexpr, BS: tl.constexpr,
           BK: tl.constexpr):
    """The stored codes and scales of rows rn (mask mn) x columns [k0, k0 + BK) of a quantized [N, K]
    weight, as loaded (the loops issue these loads one K step ahead of their use, so the memory latency
    overlaps the previous step's dequantization and MMA); columns past K read as zero."""
    rowc = rn.to(tl.int64)[:, None] * stride_c
    if FMT == 1 or FMT == 2:
        rb = k0 // 2 + tl.arange(0, BK // 2)             # byte j holds columns 2j (low nibble) and 2j + 1
        codes = tl.load(c_ptr + rowc + rb[None, :], mask=mn[:, None] & (rb < K // 2)[None, :], other=0)
    else:
        rk = k0 + tl.arange(0, BK)
        codes = tl.load(c_ptr + rowc + rk[None, :], mask=mn[:, None] & (rk < K)[None, :], other=0.0)
    if FMT == 3:
        scales = tl.load(s_ptr + rn.to(tl.int64) * stride_s, mask=mn, other=0.0)
    else:
        rs = k0 // BS + tl.arange(0, BK // BS)
        sp = s_ptr + rn.to(tl.int64)[:, None] * stride_s + rs[None, :]
        ms = mn[:, None] & (rs < K // BS)[None, :]
        if FMT == 2:
            scales = tl.load(sp, mask=ms, other=0.0)
        else:
            scales = tl.load(sp, mask=ms, other=0)
    return codes, scales


@triton.jit
def _wdequant(codes, scales, g, FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    """A `_wload` tile dequantized to fp32 [BN, BK] (the caller rounds it once to the activation dtype,
    as the reference does): the element times its block's scale (E8M0, or NVFP4's E4M3 scale times /
    divided by the global scale, in the reference's fp32 order), or its row's scale (FP8)."""
    if FMT == 1 or FMT == 2:
        byte = codes.to(tl.uint32)
        v = tl.interleave(_e2m1(byte & 15), _e2m1(byte >> 4))       # low nibble = even column
    else:
        v = codes.to(tl.float32)
    if FMT == 3:
        w = v * scales.to(tl.float32)[:, None]
    else:
        if FMT == 2:
            s = scales.to(tl.float32)
            if INVERSE:
                s = tl.div_rn(s, g)
            else:
                s = s * g
        else:
            s = _e8m0(scales)
        w = v * tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // BS, BS)), (BN, BK))
    return w


@triton.jit
def _global_scale(g_ptr, offset, FMT: tl.constexpr):
    """NVFP4's fp32 global scale of the matrix (the other formats have none: g_ptr is any tensor)."""
    if FMT == 2:
        g = tl.load(g_ptr + offset).to(tl.float32)
    else:
        g = 1.0
    return g


@triton.jit
def _tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row tiles of tokens sweep every weight tile before the next group, so
    both the tokens' tiles and the weight tiles are read from L2 while they are reused."""
    width = GROUP_M * num_n
    first = (pid // width) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


# ------------------------------------------------------------------------------------- dense linear

@triton.jit
def _linear_kernel(x_ptr, c_ptr, s_ptr, g_ptr, out_ptr, M, N, K, stride_xm, stride_c, stride_s, stride_om,
                   k_split, FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr):
    pid_m, pid_n = _tile_ids(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    split = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm = rm < M
    mn = rn < N
    g = _global_scale(g_ptr, 0, FMT)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    cw, sw = _wload(c_ptr, s_ptr, rn, mn, k_lo, k_hi, stride_c, stride_s, FMT, BS, BK)
    for k0 in range(k_lo, k_hi, BK):
        rk = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & (rk < K)[None, :],
                     other=0.0)
        cn, sn = _wload(c_ptr, s_ptr, rn, mn, k0 + BK, k_hi, stride_c, stride_s, FMT, BS, BK)    # next step's
        w = _wdequant(cw, sw, g, FMT, INVERSE, BS, BN, BK)
        acc = dot(w.to(xt.dtype), tl.trans(xt), acc, UPCAST)
        cw, sw = cn, sn
    dst = out_ptr + split.to(tl.int64) * M * N + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mn[:, None] & mm[None, :])


@triton.jit
def _sum_splits_kernel(p_ptr, out_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = r < MN
    acc = tl.load(p_ptr + r, mask=m, other=0.0)
    for s in tl.static_range(1, SPLITS):           # in split order: deterministic
        acc += tl.load(p_ptr + s * MN + r, mask=m, other=0.0)
    tl.store(out_ptr + r, acc.to(out_ptr.dtype.element_ty), mask=m)


# Rows (per group, for the grouped GEMM) from which a GEMM dequantizes its weight once (one pass over the
# codes into a bf16 copy, `dequant`) and multiplies on the tensor cores at the bf16 rate (F.linear,
# torch._grouped_mm), instead of dequantizing every weight tile for every row tile in registers (those
# W4A16 / W8A16 tiles reach about a third of the bf16 rate on Hopper): the prefill's and the denoise
# phase's row counts; decode and small batches keep the register-dequantizing kernels.
DEQUANT_ROWS = 256

# tile configs by token count (`python -m bench kernels-quant --tune` sweeps them; tools/compile_sm90.py shows
# each one's registers and spills without a GPU: these spill nothing on sm_90 for any format)
LINEAR_LARGE = dict(BM=128, BN=128, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
LINEAR_MID = dict(BM=64, BN=128, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
LINEAR_SMALL = dict(BM=16, BN=32, BK=256, GROUP_M=1, num_warps=8, num_stages=3)
SMALL_M = 16
TARGET_PROGRAMS = 264            # about two per SM of an H200 (132): enough loads in flight for a GEMV


def _gscale(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The global-scale argument: NVFP4's tensor, else any tensor of the device (never read)."""
    return g if g is not None else like


def linear(x: torch.Tensor, fmt: str, codes: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor | None = None,
           inverse: bool = False, cfg: dict | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16) @ dequant(W [N, K])^T -> [..., N] in x.dtype. W's rows may be strided
    (a micro's column block of a cols-packed weight); its columns must be contiguous."""
    k = x.shape[-1]
    n = codes.shape[-2]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if cfg is None and m >= DEQUANT_ROWS and fmt != "fp8" and not INTERPRET:    # see DEQUANT_ROWS
        return F.linear(x, dequant(fmt, codes, scales, gscale, inverse, x.dtype))
    out = _empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    small = m <= SMALL_M
    c = dict(cfg or (LINEAR_SMALL if small else LINEAR_MID if m <= 256 else LINEAR_LARGE))
    bm, bn, bk = c.pop("BM"), c.pop("BN"), c.pop("BK")
    bk = max(bk, BLOCK[fmt])           # whole scale blocks per K step
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    splits = 1
    if small:
        splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), k // bk))
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_split)
    g = _gscale(gscale, x)
    dst = out.view(-1, n) if splits == 1 else _empty(splits, m, n, dtype=torch.float32, device=x.device)
    _linear_kernel[(tiles, splits)](x2, codes, scales, g, dst, m, n, k, x2.stride(0), codes.stride(-2),
                                   scales.stride(-2), n, k_split, FMT=FMT[fmt], INVERSE=bool(inverse), BS=BLOCK[fmt],
                                   BM=bm, BN=bn, BK=bk, UPCAST=INTERPRET, **c)
    if splits > 1:
        blk = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, blk),)](dst, out, m * n, SPLITS=splits, BLOCK=blk, num_warps=4)
    return out


# ------------------------------------------------------------------------------------ grouped GEMM

@triton.jit
def _grouped_kernel(x_ptr, c_ptr, s_ptr, g_ptr, offs_ptr, out_ptr, N, K, stride_xm, stride_cg, stride_c,
                    stride_sg, stride_s, stride_gg, stride_om, num_m, G,
                    G_PAD: tl.constexpr, FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    UPCAST: tl.constexpr):
    vm, pid_n = _tile_ids(tl.program_id(0), num_m, tl.cdiv(N, BN), GROUP_M)
    # which group this row tile belongs to: tiles are laid out group after group, each group's rows
    # cut into BM-row tiles (a group of no rows has none); vm past the last tile does nothing
    rg = tl.arange(0, G_PAD)
    mg = rg < G
    ends = tl.load(offs_ptr + rg, mask=mg, other=0)
    starts = tl.load(offs_ptr + rg - 1, mask=mg & (rg > 0), other=0)
    tiles = tl.where(mg, (ends - starts + BM - 1) // BM, 0)
    cum = tl.cumsum(tiles, axis=0)
    e = tl.sum((cum <= vm).to(tl.int32), axis=0)
    if e < G:
        first_tile = tl.sum(tl.where(rg == e, cum - tiles, 0), axis=0)
        row0 = tl.sum(tl.where(rg == e, starts, 0), axis=0) + (vm - first_tile) * BM
        row_end = tl.sum(tl.where(rg == e, ends, 0), axis=0)
        rm = row0 + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mm = rm < row_end
        mn = rn < N
        ce = c_ptr + e.to(tl.int64) * stride_cg
        se = s_ptr + e.to(tl.int64) * stride_sg
        g = _global_scale(g_ptr, e * stride_gg, FMT)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        cw, sw = _wload(ce, se, rn, mn, 0, K, stride_c, stride_s, FMT, BS, BK)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                         mask=mm[:, None] & (rk < K)[None, :], other=0.0)
            cn, sn = _wload(ce, se, rn, mn, k0 + BK, K, stride_c, stride_s, FMT, BS, BK)
            w = _wdequant(cw, sw, g, FMT, INVERSE, BS, BN, BK)
            acc = dot(w.to(xt.dtype), tl.trans(xt), acc, UPCAST)
            cw, sw = cn, sn
        dst = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mn[:, None] & mm[None, :])


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, g_ptr, out_ptr, N, K, stride_c, stride_s, stride_cg, stride_sg, stride_gg,
                    FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
    """One [BN, BK] tile of matrix program_id(2) of a [G, N, K] pack, dequantized as the reference does."""
    e = tl.program_id(2).to(tl.int64)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    mn = rn < N
    codes, scales = _wload(c_ptr + e * stride_cg, s_ptr + e * stride_sg, rn, mn, k0, K, stride_c, stride_s, FMT,
                           BS, BK)
    w = _wdequant(codes, scales, _global_scale(g_ptr, e * stride_gg, FMT), FMT, INVERSE, BS, BN, BK)
    rk = k0 + tl.arange(0, BK)
    dst = out_ptr + e * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :]
    tl.store(dst, w.to(out_ptr.dtype.element_ty), mask=mn[:, None] & (rk < K)[None, :])


def dequant(fmt: str, codes: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor | None, inverse: bool,
            dtype: torch.dtype) -> torch.Tensor:
    """A [G, N, K] (or [N, K]) pack -> its exact dequantization in `dtype`, in one pass."""
    c3, s3 = (codes, scales) if codes.dim() == 3 else (codes[None], scales[None])
    gcount, n = c3.shape[0], c3.shape[1]
    k = c3.shape[2] * PER_BYTE[fmt]
    out = _empty(gcount, n, k, dtype=dtype, device=codes.device)
    g = _gscale(gscale, codes)
    stride_gg = g.stride(0) if gscale is not None and g.dim() == 3 else 0
    bn, bk = 64, 128
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk), gcount)](
        c3, s3, g, out, n, k, c3.stride(1), s3.stride(1), c3.stride(0), s3.stride(0), stride_gg, FMT=FMT[fmt],
        INVERSE=bool(inverse), BS=BLOCK[fmt], BN=bn, BK=bk, num_warps=4)
    return out if codes.dim() == 3 else out[0]


GROUPED = dict(BM=128, BN=128, BK=32, GROUP_M=8, num_warps=8, num_stages=3)
GROUPED_FEW = dict(BM=64, BN=128, BK=32, GROUP_M=4, num_warps=8, num_stages=3)    # a few rows per group
GROUPED_FMT = {"mxfp8": dict(BM=64), "fp8": dict(BM=64)}     # 8-bit codes: a 128-row tile spills on sm_90


def grouped(x: torch.Tensor, fmt: str, codes: torch.Tensor, scales: torch.Tensor, offs: torch.Tensor,
            gscale: torch.Tensor | None = None, inverse: bool = False, cfg: dict | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] rows sorted by group, W [G, N, K] quantized, offs [G] int32 cumulative end rows ->
    [T, N] in x.dtype (rows past offs[-1] are not written). gscale (NVFP4): [G, 1, 1] or 0-d."""
    t, k = x.shape
    gcount, n = codes.shape[0], codes.shape[-2]
    if cfg is None and t > 0 and t >= DEQUANT_ROWS * gcount and fmt != "fp8" and x.dtype == torch.bfloat16 \
            and not INTERPRET:
        y = torch._grouped_mm(x, dequant(fmt, codes, scales, gscale, inverse, x.dtype).transpose(1, 2), offs=offs)
        return y if out is None else out.copy_(y)
    if out is None:
        out = _empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    c = dict(cfg or (dict(GROUPED, **GROUPED_FMT.get(fmt, {})) if t >= 64 * gcount else GROUPED_FEW))
    bm, bn, bk = c.pop("BM"), c.pop("BN"), c.pop("BK")
    bk = max(bk, BLOCK[fmt])           # whole scale blocks per K step
    num_m = triton.cdiv(t, bm) + gcount                 # the most row tiles any split into groups has
    g = _gscale(gscale, x)
    stride_gg = g.stride(0) if gscale is not None and g.dim() == 3 else 0
    _grouped_kernel[(num_m * triton.cdiv(n, bn),)](
        x, codes, scales, g, offs, out, n, k, x.stride(0), codes.stride(0), codes.stride(1), scales.stride(0),
        scales.stride(1), stride_gg, out.stride(0), num_m, gcount, G_PAD=max(2, next_pow2(gcount)), FMT=FMT[fmt],
        INVERSE=bool(inverse), BS=BLOCK[fmt], BM=bm, BN=bn, BK=bk, UPCAST=INTERPRET, **c)
    return out


# ------------------------------------------------------------------------------ shared by gemv.py

def col_strides(t: torch.Tensor, per_micro: int) -> tuple[int, int, int]:
    """(micro, expert, row) strides of the active micros' column block of a cols-packed down pack:
    [E, H, micros * c] (routed experts) or [H, micros * c] (the shared MLP, expert 0); micro m starts at
    column m * per_micro (per_micro = 0: every micro reads the same column, a per-channel scale)."""
    return (per_micro, t.stride(0), t.stride(1)) if t.dim() == 3 else (per_micro, 0, t.stride(0))


# ------------------------------------------------------------------------------- FP8 per-row scaling

@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, SEGS, seg_x, seg_q, FAKE: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Row r = its SEGS segments of K (segment j at j * seg_x: the decode act's micro slices), one scale."""
    r = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, SEGS):
        xr = x_ptr + r * stride_x + j * seg_x
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            v = tl.load(xr + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
    a = tl.max(amax, axis=0)
    # IEEE divisions (Triton's `/` is the approximate one), so the codes are the reference's bit for bit
    scale = tl.where(a > 0, tl.div_rn(a, tl.full((), FP8_MAX, tl.float32)), 1.0)
    for j in range(0, SEGS):
        xr = x_ptr + r * stride_x + j * seg_x
        qr = q_ptr + r * stride_q + j * seg_q
        for k0 in range(0, K, BLOCK):
            rk = k0 + tl.arange(0, BLOCK)
            v = tl.load(xr + rk, mask=rk < K, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
            if FAKE:
                tl.store(qr + rk, (q.to(tl.float32) * scale).to(q_ptr.dtype.element_ty), mask=rk < K)
            else:
                tl.store(qr + rk, q, mask=rk < K)
    if not FAKE:
        tl.store(s_ptr + r, scale)


def quantize_rows(x: torch.Tensor, fake: bool = False, out: torch.Tensor | None = None, micros: int = 1):
    """x [..., K] -> (codes float8_e4m3fn [..., K], scale fp32 [..., 1]) per row, as quant.quantize_fp8_rows;
    fake: the dequantized rows in x.dtype instead (written to `out`, which may be x itself).
    micros > 1 (fake only, x contiguous [micros, ..., K]: the decode paths' act): a row is the
    concatenation of x[m, ..., :] over the micros, one down-GEMM row over all of them, one scale."""
    k = x.shape[-1]
    if micros > 1:
        if not (fake and x.is_contiguous() and x.shape[0] == micros and (out is None or out.is_contiguous())):
            raise ValueError("quantize_rows over micros: fake, on a contiguous [micros, ..., K]")
    x2 = x.reshape(micros, -1, k)[0] if micros > 1 else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if fake:
        q = out if out is not None else _empty(*x.shape, dtype=x.dtype, device=x.device)
        scale = q               # unused
    else:
        q = _empty(*x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        scale = _empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    q2 = q.view(micros, -1, k)[0] if micros > 1 else q.view(-1, k)
    if rows:
        block = min(4096, next_pow2(k))
        seg = rows * k if micros > 1 else 0     # micro m's slice of a row: m * rows * K elements on
        _quantize_rows_kernel[(rows,)](x2, q2, scale, k, x2.stride(0), q2.stride(0), micros, seg, seg, FAKE=fake,
                                       BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q if fake else (q, scale)


@triton.jit
def _swiglu_quantize_rows_kernel(h_ptr, q_ptr, s_ptr, I, stride_h, stride_q, BLOCK: tl.constexpr):
    """Row r of [R, 2I] -> its SwiGLU rounded to the activation dtype (as moe swiglu writes it), then
    quantized per row (as `_quantize_rows_kernel`): one read of h, the codes and the scale written."""
    r = tl.program_id(0).to(tl.int64)
    ri = tl.arange(0, BLOCK)
    mi = ri < I
    a = tl.load(h_ptr + r * stride_h + ri, mask=mi, other=0.0).to(tl.float32)
    b = tl.load(h_ptr + r * stride_h + I + ri, mask=mi, other=0.0).to(tl.float32)
    v = (a * (b * tl.sigmoid(b))).to(h_ptr.dtype.element_ty).to(tl.float32)
    amax = tl.max(tl.abs(v), axis=0)
    scale = tl.where(amax > 0, tl.div_rn(amax, tl.full((), FP8_MAX, tl.float32)), 1.0)
    q = tl.minimum(tl.maximum(tl.div_rn(v, scale), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
    tl.store(q_ptr + r * stride_q + ri, q, mask=mi)
    tl.store(s_ptr + r, scale)


SWIGLU_QUANT_MAX_I = 8192       # a row's SwiGLU held in one program's registers (the real I: 3072 and its shards)


def swiglu_quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [R, 2I] (bf16 / fp16: [x1 ; x2] of a GEMM1 row) -> the down GEMM's FP8 input: codes [R, I] and scale
    fp32 [R, 1], bit for bit `quantize_rows(moe swiglu(h))` without the bf16 activation's round trip
    through memory (the FP8 grouped path with one micro; I <= SWIGLU_QUANT_MAX_I)."""
    r, width = h.shape
    i = width // 2
    if width != 2 * i or i > SWIGLU_QUANT_MAX_I or h.stride(1) != 1:
        raise ValueError(f"swiglu_quantize_rows: h {tuple(h.shape)} / {h.stride()} (2I columns, I <= "
                         f"{SWIGLU_QUANT_MAX_I}, unit column stride)")
    q = _empty(r, i, dtype=torch.float8_e4m3fn, device=h.device)
    scale = _empty(r, 1, dtype=torch.float32, device=h.device)
    if r:
        block = next_pow2(i)
        _swiglu_quantize_rows_kernel[(r,)](h, q, scale, i, h.stride(0), q.stride(0), BLOCK=block,
                                           num_warps=4 if block <= 1024 else 8)
    return q, scale


# ------------------------------------------------------- expert-major decode MoE (1..32 rows, moe_cuda.py)
#
# One program per (micro, touched expert, tile of weight rows): it reads its weight tile once and
# multiplies it with every token routed to that expert, BT tokens per MMA (the tokens gathered from the
# routing on the device; a 17th token of one expert takes a second pass, its rows then from L1 / L2).
# Batch invariance: a token's sums run over K in the same BK steps, in the same MMA shape [rows, BT],
# whatever else shares its pass (the other columns of an MMA do not touch its column): the output of a
# token is bitwise the same alone or in any batch. Format 4 is a plain bf16 weight (a float shared MLP).
BF16_W = 4
DECODE_BT = 16                       # tokens per MMA (tl.dot's minimum); one pass holds N <= 16 of one expert


@triton.jit
def _ewload(c_ptr, s_ptr, rows, mrows, k0, K, stride_c, stride_s, FMT: tl.constexpr, BS: tl.constexpr,
            BK: tl.constexpr):
    """`_wload`, or a bf16 weight's values (FMT 4: returned twice, the second never read)."""
    if FMT == 4:
        rk = k0 + tl.arange(0, BK)
        a = tl.load(c_ptr + rows.to(tl.int64)[:, None] * stride_c + rk[None, :],
                    mask=mrows[:, None] & (rk < K)[None, :], other=0.0)
        b = a
    else:
        a, b = _wload(c_ptr, s_ptr, rows, mrows, k0, K, stride_c, stride_s, FMT, BS, BK)
    return a, b


@triton.jit
def _ewtile(a, b, g, FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):
    """The bf16 MMA operand of an `_ewload` tile: MX codes times their power-of-two scale and E4M3 codes
    alone (FP8: its row scale multiplies the sums) are exact in bf16; NVFP4 is rounded once as the
    reference rounds it."""
    if FMT == 4:
        w = a
    elif FMT == 3:
        w = a.to(tl.float32).to(tl.bfloat16)
    else:
        w = _wdequant(a, b, g, FMT, INVERSE, BS, BN, BK).to(tl.bfloat16)
    return w


@triton.jit
def _emma(a, b, g, xt, acc, FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr, SFMT: tl.constexpr):
    """acc + (the `_ewload` tile a, b as weights) @ xt [BK, BT]. SCALED (MX formats: SFMT "e2m1" / "e4m3"):
    Triton's tl.dot_scaled takes the codes and their E8M0 block scales as they are and upcasts them itself
    (on Hopper, which has no MX MMA, its own conversion to bf16 before a bf16 MMA); else `_ewtile`'s
    dequantization in fp32, rounded to bf16 (the same products: E2M1 / E4M3 values times a power of two are
    exact in bf16). Which is the faster is `bench moe-decode --tune`'s question (the "SCALED" tile key)."""
    if SCALED:
        out = tl.dot_scaled(a, b, SFMT, xt, None, "bf16", acc=acc)
    else:
        out = dot(_ewtile(a, b, g, FMT, INVERSE, BS, BN, BK), xt, acc, UPCAST)
    return out


@triton.jit
def _pass_tokens(sel, pos, j, t0, cnt, N_PAD: tl.constexpr, BT: tl.constexpr):
    """The slot's tokens t0 .. t0 + BT - 1 (in token order): their indices, top-k positions, validity."""
    rn = tl.arange(0, N_PAD)
    rt = t0 + tl.arange(0, BT)
    hit = sel[None, :] & (pos[None, :] == rt[:, None])
    return (tl.sum(tl.where(hit, rn[None, :], 0), axis=1), tl.sum(tl.where(hit, j[None, :], 0), axis=1),
            rt < cnt)


@triton.jit
def _slot_tokens(ids_ptr, active_ptr, slot, N, K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
                 ROUTED: tl.constexpr):
    """The tokens a slot serves: ROUTED, those that chose expert active[slot] (with the top-k position
    j of that choice), else all N. -> (expert, sel [N_PAD], position among the selected, j, count)."""
    rn = tl.arange(0, N_PAD)
    mn = rn < N
    rk = tl.arange(0, K_PAD)
    if ROUTED:
        e = tl.load(active_ptr + slot)
        ids = tl.load(ids_ptr + rn[:, None] * K + rk[None, :], mask=mn[:, None] & (rk[None, :] < K), other=-1)
        hit = (ids == e) & (e >= 0)
        sel = (tl.max(hit.to(tl.int32), axis=1) > 0) & mn
        j = tl.sum(tl.where(hit, rk[None, :], 0), axis=1)
        e = tl.maximum(e, 0)
    else:
        sel = mn
        j = rn * 0
        e = tl.full((), 0, tl.int32)
    s32 = sel.to(tl.int32)
    return e, sel, tl.cumsum(s32, axis=0) - s32, j, tl.sum(s32, axis=0)


@triton.jit
def _edecode_up_kernel(x_ptr, ids_ptr, active_ptr, c_ptr, s_ptr, g_ptr, act_ptr, N, H, I, stride_x, stride_am,
                       c_sm, c_se, c_sr, s_sm, s_se, s_sr, g_se, SLOTS,
                       K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr, FMT: tl.constexpr,
                       INVERSE: tl.constexpr, BS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
                       BT: tl.constexpr, ROUTED: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
                       SFMT: tl.constexpr):
    """Rows [i, i + BI) of the first (linear) and second (SiLU) halves of micro m of the slot's expert, one
    [2 BI, BK] weight tile a K step, times each of its tokens, SwiGLU, written to act[m, row] (routed: row
    t*K + j of token t's j-th choice; shared: row t)."""
    pid = tl.program_id(0)
    m = pid // SLOTS
    slot = pid % SLOTS
    e, sel, pos, j, cnt = _slot_tokens(ids_ptr, active_ptr, slot, N, K, K_PAD, N_PAD, ROUTED)
    if cnt > 0:                      # a slot past the chosen experts reads no weight
        cb = c_ptr + m.to(tl.int64) * c_sm + e.to(tl.int64) * c_se
        sb = s_ptr + m.to(tl.int64) * s_sm + e.to(tl.int64) * s_se
        g = _global_scale(g_ptr, e * g_se, FMT)
        rr = tl.arange(0, 2 * BI)
        i = tl.program_id(1) * BI + rr // 2
        rows = i + (rr % 2) * I          # the tile's rows interleave the halves (split as gemm1.py splits them)
        mrows = i < I
        for t0 in range(0, cnt, BT):
            tok, jt, ok = _pass_tokens(sel, pos, j, t0, cnt, N_PAD, BT)
            acc = tl.zeros((2 * BI, BT), dtype=tl.float32)
            a, b = _ewload(cb, sb, rows, mrows, 0, H, c_sr, s_sr, FMT, BS, BK)
            for k0 in range(0, H, BK):
                rk = k0 + tl.arange(0, BK)
                xt = tl.load(x_ptr + tok.to(tl.int64)[:, None] * stride_x + rk[None, :],
                             mask=ok[:, None] & (rk < H)[None, :], other=0.0)
                na, nb = _ewload(cb, sb, rows, mrows, k0 + BK, H, c_sr, s_sr, FMT, BS, BK)      # the next step's
                acc = _emma(a, b, g, tl.trans(xt), acc, FMT, INVERSE, BS, 2 * BI, BK, UPCAST, SCALED, SFMT)
                a, b = na, nb
            if FMT == 3:             # the rows' per-channel scales
                acc = acc * tl.load(sb + rows.to(tl.int64) * s_sr, mask=mrows, other=0.0)[:, None]
            h1, h2 = tl.split(tl.permute(tl.reshape(acc, (BI, 2, BT)), (0, 2, 1)))
            act = h1 * (h2 * tl.sigmoid(h2))
            if ROUTED:
                row = tok * K + jt
            else:
                row = tok
            ri = tl.program_id(1) * BI + tl.arange(0, BI)
            dst = act_ptr + m.to(tl.int64) * stride_am + row.to(tl.int64)[None, :] * I + ri[:, None]
            tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=(ri < I)[:, None] & ok[None, :])


@triton.jit
def _edecode_down_kernel(act_ptr, ids_ptr, active_ptr, c_ptr, s_ptr, g_ptr, y_ptr, N, H, I, stride_am,
                         c_sm, c_se, c_sr, s_sm, s_se, s_sr, g_se, MC,
                         K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr, FMT: tl.constexpr,
                         INVERSE: tl.constexpr, BS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                         BT: tl.constexpr, ROUTED: tl.constexpr, UPCAST: tl.constexpr, SCALED: tl.constexpr,
                         SFMT: tl.constexpr):
    """Rows [h, h + BH) of the slot's down weight over every active micro's columns (one sum, micro after
    micro), times each of its tokens' act rows, written to y (fp32, the route weights come in finalize)."""
    slot = tl.program_id(0)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = rh < H
    e, sel, pos, j, cnt = _slot_tokens(ids_ptr, active_ptr, slot, N, K, K_PAD, N_PAD, ROUTED)
    if cnt > 0:
        g = _global_scale(g_ptr, e * g_se, FMT)
        for t0 in range(0, cnt, BT):
            tok, jt, ok = _pass_tokens(sel, pos, j, t0, cnt, N_PAD, BT)
            if ROUTED:
                row = (tok * K + jt).to(tl.int64)
            else:
                row = tok.to(tl.int64)
            acc = tl.zeros((BH, BT), dtype=tl.float32)
            for m in range(MC):
                m64 = m + tl.zeros((), tl.int64)          # the loop index is a Python int under the interpreter
                cb = c_ptr + m64 * c_sm + e.to(tl.int64) * c_se
                sb = s_ptr + m64 * s_sm + e.to(tl.int64) * s_se
                ab = act_ptr + m64 * stride_am + row[:, None] * I
                a, b = _ewload(cb, sb, rh, mh, 0, I, c_sr, s_sr, FMT, BS, BK)
                for k0 in range(0, I, BK):
                    rk = k0 + tl.arange(0, BK)
                    at = tl.load(ab + rk[None, :], mask=ok[:, None] & (rk < I)[None, :], other=0.0)
                    na, nb = _ewload(cb, sb, rh, mh, k0 + BK, I, c_sr, s_sr, FMT, BS, BK)
                    acc = _emma(a, b, g, tl.trans(at), acc, FMT, INVERSE, BS, BH, BK, UPCAST, SCALED, SFMT)
                    a, b = na, nb
            if FMT == 3:             # the per-channel scale, one for every micro's columns
                acc = acc * tl.load(s_ptr + e.to(tl.int64) * s_se + rh.to(tl.int64) * s_sr, mask=mh,
                                    other=0.0)[:, None]
            tl.store(y_ptr + row[None, :] * H + rh[:, None], acc, mask=mh[:, None] & ok[None, :])


# tiles of the expert-major decode (`python -m bench moe-decode --tune` sweeps them); fixed for every N, so that
# a token's sums do not depend on its batch. SCALED (MXFP4 / MXFP8): tl.dot_scaled instead of our
# dequantization (`_emma`); off until the GPU says it is faster
EDECODE_UP = dict(BI=32, BK=128, num_warps=4, num_stages=2)     # a [64, BK] tile: gate and up halves
EDECODE_DOWN = dict(BH=64, BK=128, num_warps=4, num_stages=2)


def _scaled(cfg: dict, fmt: str) -> str:
    """The tl.dot_scaled operand format where a tile config asks for it (key SCALED, popped) and the weight
    is an MX format; "" otherwise (NVFP4's E4M3 block scales of 16 and FP8's row scales are not MX)."""
    return {"mxfp4": "e2m1", "mxfp8": "e4m3"}.get(fmt, "") if cfg.pop("SCALED", False) else ""


def _fmt_id(fmt: str) -> int:
    return BF16_W if fmt == "bf16" else FMT[fmt]


def _lead_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(micro, expert, row) strides of a [micros, E, rows, ·] pack or a [micros, rows, ·] one (expert 0)."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (t.stride(0), 0, t.stride(1))


def _g_stride(gscale) -> int:
    return gscale.stride(0) if gscale is not None and gscale.dim() == 3 else 0


def edecode_up(x: torch.Tensor, ids: torch.Tensor, active: torch.Tensor | None, fmt: str, codes: torch.Tensor,
               scales: torch.Tensor | None, gscale: torch.Tensor | None, inverse: bool, act: torch.Tensor,
               cfg: dict | None = None) -> None:
    """Gate/up + SwiGLU of every (micro, slot, row tile): routed (active [S] given) codes [micros, E, 2I, H/pb],
    act [micros, N*k, I]; shared (active None) [micros, 2I, H/pb], act [micros, N, I]. fmt "bf16": codes
    are the bf16 weight, scales None. x [N, H] bf16."""
    c = dict(EDECODE_UP, **(cfg or {}))
    bi, bk = c.pop("BI"), c.pop("BK")
    scaled = _scaled(c, fmt)
    n, h = x.shape
    mc, _, inter = act.shape
    pb = 1 if fmt == "bf16" else PER_BYTE[fmt]
    if codes.shape[-1] * pb != h or codes.shape[-2] != 2 * inter or not act.is_contiguous():
        raise ValueError(f"edecode_up: x {tuple(x.shape)}, {fmt} weight {tuple(codes.shape)}, act {tuple(act.shape)}")
    bs = 1 if fmt == "bf16" else BLOCK[fmt]
    bk = max(bk, bs)
    slots = active.shape[0] if active is not None else 1
    s = scales if scales is not None else codes
    _edecode_up_kernel[(mc * slots, triton.cdiv(inter, bi))](
        x, ids, active if active is not None else ids, codes, s, _gscale(gscale, x), act, n, h, inter, x.stride(0),
        act.stride(0), *_lead_strides(codes), *_lead_strides(s), _g_stride(gscale), slots, K=ids.shape[1],
        K_PAD=max(2, next_pow2(ids.shape[1])), N_PAD=max(2, next_pow2(n)), FMT=_fmt_id(fmt), INVERSE=bool(inverse),
        BS=bs, BI=bi, BK=bk, BT=DECODE_BT, ROUTED=active is not None, UPCAST=INTERPRET, SCALED=bool(scaled),
        SFMT=scaled, **c)


def edecode_down(act: torch.Tensor, ids: torch.Tensor, active: torch.Tensor | None, fmt: str, codes: torch.Tensor,
                 scales: torch.Tensor | None, gscale: torch.Tensor | None, inverse: bool, y: torch.Tensor,
                 cfg: dict | None = None) -> None:
    """Down GEMM of every (slot, row tile), the active micros' columns summed: codes / scales the active
    micros' column block of the cols-packed pack (`QWeight.cols`: routed [E, H, micros*I/pb], shared [H, ·];
    micro m's columns start at m*I), act as edecode_up wrote it, y [N*k, H] (routed) / [N, H] fp32."""
    c = dict(EDECODE_DOWN, **(cfg or {}))
    bh, bk = c.pop("BH"), c.pop("BK")
    scaled = _scaled(c, fmt)
    mc, _, inter = act.shape
    n = ids.shape[0]
    h = y.shape[1]
    pb = 1 if fmt == "bf16" else PER_BYTE[fmt]
    bs = 1 if fmt == "bf16" else BLOCK[fmt]
    if (codes.dim() != (3 if active is not None else 2) or codes.shape[-1] * pb != mc * inter
            or codes.shape[-2] != h or inter % bs or not act.is_contiguous()):
        raise ValueError(f"edecode_down: act {tuple(act.shape)}, {fmt} weight block {tuple(codes.shape)}, "
                         f"y {tuple(y.shape)}")
    bk = max(bk, bs)
    slots = active.shape[0] if active is not None else 1
    s = scales if scales is not None else codes
    per_micro_s = 0 if fmt == "fp8" else inter // bs if fmt != "bf16" else inter
    _edecode_down_kernel[(slots, triton.cdiv(h, bh))](
        act, ids, active if active is not None else ids, codes, s, _gscale(gscale, y), y, n, h, inter, act.stride(0),
        *col_strides(codes, inter // pb), *col_strides(s, per_micro_s), _g_stride(gscale), mc, K=ids.shape[1],
        K_PAD=max(2, next_pow2(ids.shape[1])), N_PAD=max(2, next_pow2(n)), FMT=_fmt_id(fmt), INVERSE=bool(inverse),
        BS=bs, BH=bh, BK=bk, BT=DECODE_BT, ROUTED=active is not None, UPCAST=INTERPRET, SCALED=bool(scaled),
        SFMT=scaled, **c)
