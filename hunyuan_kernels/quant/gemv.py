"""Weight-only GEMV kernels for a few tokens (decode) on quantized weights, without tensor cores: the
MoE decode pair (`decode_up`, `decode_down`) and a small-M dense `linear`. The formats and their storage
are triton_kernels.py's (FMT 0 MXFP8,
1 MXFP4, 2 NVFP4, 3 FP8 per channel).

Why no tl.dot: at 1-8 tokens a GEMV is bound by the memory reads of the weight, and a 4-bit weight at
4.3 TB/s is ~9.6e12 values/s, so the kernel is bound by the instructions it spends per weight value.
A tile kernel dequantizes in registers, interleaves nibbles, broadcasts block scales and moves the
tile into an MMA operand layout (shared memory); here each value costs about 3 integer ops and one
fp32 FMA, in the layout the codes are loaded in:

* Codes are read as 32-bit words (8 E2M1 or 4 E4M3 codes, column order inside the word). Two shifts
  and two masks of a word place two codes at once in the bf16 bit positions of the two halves of a
  register (E2M1 s|e1e0|m -> bf16 sign, exponent bits 1..0, mantissa bit 6; E4M3 s|e3..e0|m2..m0
  likewise): each half is then the code times 2^-126 (E2M1) or 2^-120 (E4M3) exactly, subnormal
  codes included (E2M1's 0.5 is the subnormal 2^-127; the FMAs are fma.rn.f32, no flush to zero),
  and one shift or mask makes each an fp32. The pair holds columns (P, P + PH/2) of the word, so x is
  used in "phases". (E4M3's NaN code reads as a finite 480: checkpoints hold none.)
* The activations are read in phases: x_q[w] = x[w * PH + q] * 2^64 (fp32). `prep` writes them so
  (PREP=True: one 16-byte load per thread, word and phase), or the kernel reads bf16 x strided
  (PREP=False). The 2^64 keeps every product x * code * 2^-126 a normal fp32 (no precision lost for
  |x * code| >= 2^-64; |x| must stay below 2^64); the result is multiplied back once per output.
* Each thread owns chunks of CW consecutive words of a row (16 bytes: one MX block of MXFP4, half a
  block of MXFP8; 8 bytes, one 16-block, for NVFP4): the products are summed along the chunk in
  fp32, multiplied by the chunk's block scale, and summed over the K steps; the sum over the chunks
  (across threads) happens once at the end. E8M0 scales are powers of two and E2M1 / E4M3 values
  have 2 / 4 significant bits, so code * scale is exact: MXFP8 / MXFP4 results equal the reference's
  up to the fp32 summation order. NVFP4 multiplies by its block scale times 1/g (or g) in fp32
  instead of rounding every dequantized weight to bf16 first: differs from the reference by about
  that bf16 rounding (relative ~1e-3). FP8 applies its per-row scale at the end.
* Tile: [G chunks along K, R rows, CW words], G lanes along K, warps (and repetitions) along rows.
  The block scales are loaded as a [G, R] tile with contiguity 1 (tl.max_contiguous), which makes
  Triton give it the layout of the chunk sums (no shared memory in the loop; tools/compile_sm90.py
  `gemv` checks that no layout conversion through shared memory is left in any loop).
* The next K step's codes and scales are loaded before this step's arithmetic (registers, no shared
  memory): two steps of bytes in flight per thread.
* Tokens: up to DECODE_TB (2 or 4) per pass, one accumulator each; the routed slots of the MoE serve
  only the tokens that chose the slot's expert (compacted on the device), so a slot usually multiplies
  1-2 tokens however many the batch has; more: further passes over the (L1 / L2-resident) rows. Only
  the buckets a launch can need are compiled (1 token: the 1-token loop alone, ~60-80 registers).

No atomics: every output element has one writer and every sum a fixed order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import next_pow2
from ..scratch import empty as _empty
from .triton_kernels import BLOCK, FMT, FP8_MAX, _e8m0, _g_stride, _lead_strides, _slot_tokens, col_strides

PH = {"mxfp8": 4, "mxfp4": 8, "nvfp4": 8, "fp8": 4}       # columns per 32-bit code word
XSCALE = 2.0 ** 64                                          # the prescale of prepared activations
X_SCALE = tl.constexpr(XSCALE)


# ------------------------------------------------------------------------------------ the core

@triton.jit
def _pair(w, P: tl.constexpr, FP4: tl.constexpr):
    """Two codes of the int32 words w as fp32, times 2^-126 (E2M1) or 2^-120 (E4M3): FP4 columns P and
    P + 4 of the word's 8, else columns P and P + 2 of its 4. Built as the two halves of one bf16 pair."""
    if FP4:
        if P == 0:
            em = w << 6
            sg = w << 12
        elif P == 1:
            em = w << 2
            sg = w << 8
        elif P == 2:
            em = w >> 2
            sg = w << 4
        else:
            em = w >> 6
            sg = w
        r = (em & 0x01C001C0) | (sg & -2147450880)            # 0x80008000: the two sign bits
    else:
        if P == 0:
            r = ((w << 8) & -2147450880) | ((w << 4) & 0x07F007F0)
        else:
            r = (w & -2147450880) | ((w >> 4) & 0x07F007F0)
    return (r << 16).to(tl.float32, bitcast=True), (r & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _xload(x_ptr, xo, kk, q, KW, kin, EVEN_K: tl.constexpr, PREP: tl.constexpr, PH_: tl.constexpr):
    """Phase q of one token's activations at words kk, as fp32 times 2^64 (0 past K)."""
    if PREP:
        ptr = x_ptr + xo + q * KW + kk
    else:
        ptr = x_ptr + xo + kk * PH_ + q
    if EVEN_K:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=kin, other=0.0)
    if not PREP:
        v = v.to(tl.float32) * X_SCALE
    return v


@triton.jit
def _wtile(c_ptr, crow, rmask, k0, kofs, KW, EVEN_K: tl.constexpr):
    """The code words of K step k0 ([G, R, CW]); past K they read as 0."""
    if EVEN_K:
        w = tl.load(c_ptr + crow + (k0 + kofs))
    else:
        w = tl.load(c_ptr + crow + (k0 + kofs), mask=rmask & (k0 + kofs < KW), other=0)
    return w


@triton.jit
def _stile(s_ptr, srow, smask, k0, rg, KW, FMT: tl.constexpr, CW: tl.constexpr, EVEN_K: tl.constexpr):
    """The stored block scale of each chunk of K step k0 ([G, R]), as loaded. Contiguity 1 along the
    chunks (tl.max_contiguous) gives the tile the layout of the chunk sums (no conversion)."""
    WPB: tl.constexpr = 8 if FMT == 0 else 4 if FMT == 1 else 2          # code words per scale block
    blk = (k0 // CW + rg) // (WPB // CW)
    off = tl.max_contiguous(srow + blk[:, None], [1, 1])     # on the offsets: a hint on a range can fold away
    if EVEN_K:
        sm = smask | True
    else:
        sm = smask & (blk < KW // WPB)[:, None]
    if FMT == 2:
        sb = tl.load(s_ptr + off, mask=sm, other=0.0)
    else:
        sb = tl.load(s_ptr + off, mask=sm, other=0)
    return sb


@triton.jit
def _gemv(c_ptr, crow, rmask, s_ptr, srow, smask, KW, g, x_ptr, xo0, xo1, xo2, xo3,
          FMT: tl.constexpr, T: tl.constexpr, R: tl.constexpr, G: tl.constexpr, CW: tl.constexpr,
          EVEN_K: tl.constexpr, PREP: tl.constexpr):
    """Dot products of R weight rows with T (<= 4) tokens' activations -> T fp32 vectors [R].
    c_ptr: int32 code words; crow [1, R, 1] each row's first word (int64), rmask its validity; s_ptr /
    srow [1, R] / smask: the block scales (FP8: the row's fp32 scale); KW words per row; g: NVFP4's
    global factor (the block scale is multiplied by it); xo_t: token t's offset in x (a token past the
    ones served repeats a valid offset: no predicated loads; its result is not stored).
    The next K step's codes and scales are loaded before this step's arithmetic (software pipelining
    in registers: twice the bytes in flight per thread)."""
    FP4: tl.constexpr = FMT == 1 or FMT == 2
    PH_: tl.constexpr = 8 if FP4 else 4
    NP: tl.constexpr = PH_ // 2
    STEP: tl.constexpr = G * CW
    rg = tl.arange(0, G)
    kofs = rg[:, None, None] * CW + tl.arange(0, CW)[None, None, :]          # [G, 1, CW]
    acc0 = tl.zeros((G, R), dtype=tl.float32)
    acc1 = tl.zeros((G, R), dtype=tl.float32)
    acc2 = tl.zeros((G, R), dtype=tl.float32)
    acc3 = tl.zeros((G, R), dtype=tl.float32)
    w = _wtile(c_ptr, crow, rmask, 0, kofs, KW, EVEN_K)
    if FMT != 3:
        sb = _stile(s_ptr, srow, smask, 0, rg, KW, FMT, CW, EVEN_K)
    for k0 in range(0, KW, STEP):
        kk = k0 + kofs
        if EVEN_K:
            kin = kk >= 0
            kn = tl.minimum(k0 + STEP, KW - STEP)         # the last step reloads itself: in bounds
        else:
            kin = kk < KW
            kn = k0 + STEP
        w_next = _wtile(c_ptr, crow, rmask, kn, kofs, KW, EVEN_K)
        if FMT != 3:
            sb_next = _stile(s_ptr, srow, smask, kn, rg, KW, FMT, CW, EVEN_K)
            if FMT == 2:            # E4M3 block scale times the global factor
                scale = sb.to(tl.float32) * g
            else:
                scale = _e8m0(sb)
        # the chunk's products, one fp32 FMA chain per token (pair 0 starts it)
        lo, hi = _pair(w, 0, FP4)
        p0 = tl.fma(hi, _xload(x_ptr, xo0, kk, NP, KW, kin, EVEN_K, PREP, PH_),
                    lo * _xload(x_ptr, xo0, kk, 0, KW, kin, EVEN_K, PREP, PH_))
        if T > 1:
            p1 = tl.fma(hi, _xload(x_ptr, xo1, kk, NP, KW, kin, EVEN_K, PREP, PH_),
                        lo * _xload(x_ptr, xo1, kk, 0, KW, kin, EVEN_K, PREP, PH_))
        if T > 2:
            p2 = tl.fma(hi, _xload(x_ptr, xo2, kk, NP, KW, kin, EVEN_K, PREP, PH_),
                        lo * _xload(x_ptr, xo2, kk, 0, KW, kin, EVEN_K, PREP, PH_))
            p3 = tl.fma(hi, _xload(x_ptr, xo3, kk, NP, KW, kin, EVEN_K, PREP, PH_),
                        lo * _xload(x_ptr, xo3, kk, 0, KW, kin, EVEN_K, PREP, PH_))
        for P in tl.static_range(1, NP):
            lo, hi = _pair(w, P, FP4)
            p0 = tl.fma(lo, _xload(x_ptr, xo0, kk, P, KW, kin, EVEN_K, PREP, PH_), p0)
            p0 = tl.fma(hi, _xload(x_ptr, xo0, kk, P + NP, KW, kin, EVEN_K, PREP, PH_), p0)
            if T > 1:
                p1 = tl.fma(lo, _xload(x_ptr, xo1, kk, P, KW, kin, EVEN_K, PREP, PH_), p1)
                p1 = tl.fma(hi, _xload(x_ptr, xo1, kk, P + NP, KW, kin, EVEN_K, PREP, PH_), p1)
            if T > 2:
                p2 = tl.fma(lo, _xload(x_ptr, xo2, kk, P, KW, kin, EVEN_K, PREP, PH_), p2)
                p2 = tl.fma(hi, _xload(x_ptr, xo2, kk, P + NP, KW, kin, EVEN_K, PREP, PH_), p2)
                p3 = tl.fma(lo, _xload(x_ptr, xo3, kk, P, KW, kin, EVEN_K, PREP, PH_), p3)
                p3 = tl.fma(hi, _xload(x_ptr, xo3, kk, P + NP, KW, kin, EVEN_K, PREP, PH_), p3)
        if FMT == 3:
            acc0 += tl.sum(p0, axis=2)
            if T > 1:
                acc1 += tl.sum(p1, axis=2)
            if T > 2:
                acc2 += tl.sum(p2, axis=2)
                acc3 += tl.sum(p3, axis=2)
        else:
            acc0 = tl.fma(tl.sum(p0, axis=2), scale, acc0)
            if T > 1:
                acc1 = tl.fma(tl.sum(p1, axis=2), scale, acc1)
            if T > 2:
                acc2 = tl.fma(tl.sum(p2, axis=2), scale, acc2)
                acc3 = tl.fma(tl.sum(p3, axis=2), scale, acc3)
            sb = sb_next
        w = w_next
    # back from 2^64 * 2^-126 (E2M1) or 2^64 * 2^-120 (E4M3): exact powers of two
    fix = 4611686018427387904.0 if FP4 else 72057594037927936.0         # 2^62, 2^56
    if FMT == 3:
        rs = tl.sum(tl.load(s_ptr + srow, mask=smask, other=0.0), axis=0)      # [R]: the row's scale
        fix = fix * rs
    return (tl.sum(acc0, axis=0) * fix, tl.sum(acc1, axis=0) * fix, tl.sum(acc2, axis=0) * fix,
            tl.sum(acc3, axis=0) * fix)


@triton.jit
def _global_factor(g_ptr, offset, FMT: tl.constexpr, INVERSE: tl.constexpr):
    """NVFP4's global factor g (the block scale is multiplied by it): the stored global scale, or its
    IEEE reciprocal when the scale divides (the reference divides every block scale instead: equal up
    to one fp32 rounding of the block scale)."""
    if FMT == 2:
        g = tl.load(g_ptr + offset).to(tl.float32)
        if INVERSE:
            g = tl.div_rn(tl.full((), 1.0, tl.float32), g)
    else:
        g = 1.0
    return g


@triton.jit
def _rows(row, valid, c_sr, s_sr):
    """The [1, R, 1] word offsets / mask of weight rows and the [1, R] scale-row offsets / mask. Rows
    past the matrix read row 0 instead (no predicated loads; their results are not stored)."""
    r64 = tl.where(valid, row, 0).to(tl.int64)
    return r64[None, :, None] * c_sr, valid[None, :, None], r64[None, :] * s_sr, valid[None, :]


@triton.jit
def _token(sel, pos, rn, t):
    """The index of the t-th selected token (the tokens of `sel` in order)."""
    return tl.sum(tl.where(sel & (pos == t), rn, 0), axis=0)


# ------------------------------------------------------------------------------------ prep

@triton.jit
def _prep_kernel(x_ptr, out_ptr, KW, stride_x, stride_o, PH_: tl.constexpr, BW: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BW + tl.arange(0, BW)
    q = tl.arange(0, PH_)
    m = (w < KW)[:, None]
    v = tl.load(x_ptr + r * stride_x + w[:, None] * PH_ + q[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + q[None, :] * KW + w[:, None], v * X_SCALE, mask=m)


@triton.jit
def _fp8_prep_store(x_ptr, out_ptr, r, stride_o, KW, w, q, m, v, scale, PH_: tl.constexpr):
    """v (x's tile as fp32) quantized by `scale` to E4M3, dequantized, rounded to x's dtype, stored prepared."""
    c = tl.minimum(tl.maximum(tl.div_rn(v, scale), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
    d = (c.to(tl.float32) * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * stride_o + q[None, :] * KW + w[:, None], d * X_SCALE, mask=m)


@triton.jit
def _fp8_scale(a):
    return tl.where(a > 0, tl.div_rn(a, tl.full((), FP8_MAX, tl.float32)), 1.0)


@triton.jit
def _prep_fp8_kernel(x_ptr, out_ptr, KW, stride_x, stride_o, PH_: tl.constexpr, BW: tl.constexpr,
                     ONE_PASS: tl.constexpr):
    """`_prep_kernel` of one row quantized per row to E4M3 and dequantized first (as quantize_rows(fake=True)
    writes it, rounded to x's dtype): W8A8's activations for the FP8 GEMVs, in one launch. ONE_PASS: the row
    is one tile (BW >= KW), read once and kept in registers for its quantization; else read twice (its amax,
    then the codes)."""
    r = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, PH_)
    if ONE_PASS:
        w = tl.arange(0, BW)
        m = (w < KW)[:, None]
        v = tl.load(x_ptr + r * stride_x + w[:, None] * PH_ + q[None, :], mask=m, other=0.0).to(tl.float32)
        scale = _fp8_scale(tl.max(tl.max(tl.abs(v), axis=1), axis=0))
        _fp8_prep_store(x_ptr, out_ptr, r, stride_o, KW, w, q, m, v, scale, PH_)
    else:
        amax = tl.zeros((BW, PH_), dtype=tl.float32)
        for w0 in range(0, KW, BW):
            w = w0 + tl.arange(0, BW)
            v = tl.load(x_ptr + r * stride_x + w[:, None] * PH_ + q[None, :], mask=(w < KW)[:, None], other=0.0)
            amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
        scale = _fp8_scale(tl.max(tl.max(amax, axis=1), axis=0))
        for w0 in range(0, KW, BW):
            w = w0 + tl.arange(0, BW)
            m = (w < KW)[:, None]
            v = tl.load(x_ptr + r * stride_x + w[:, None] * PH_ + q[None, :], mask=m, other=0.0).to(tl.float32)
            _fp8_prep_store(x_ptr, out_ptr, r, stride_o, KW, w, q, m, v, scale, PH_)


# the FP8 prep reads a row of up to this many code words once (its tile in registers: at 4 columns a word and
# 8 warps, 64 fp32 a thread), a longer one twice
FP8_PREP_ONE_PASS_WORDS = 4096


def prep(x: torch.Tensor, fmt: str, fp8_rows: bool = False) -> torch.Tensor:
    """x [..., K] (bf16 / fp16) -> the activations as the PREP kernels read them: fp32 [..., K] where row
    r holds x[r, w*PH + q] * 2^64 at q*(K/PH) + w (PH = the code words' columns of `fmt`). fp8_rows: each
    row quantized per row to E4M3 and dequantized first, bit for bit `prep(quantize_rows(x, fake=True))`
    in one launch (the FP8 GEMVs' W8A8 activations)."""
    k = x.shape[-1]
    ph = PH[fmt]
    if k % ph:
        raise ValueError(f"{k} columns are not whole {fmt} code words")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _empty(*x.shape, dtype=torch.float32, device=x.device)
    rows, kw = x2.shape[0], k // ph
    if rows and fp8_rows:
        one = kw <= FP8_PREP_ONE_PASS_WORDS
        bw = next_pow2(kw) if one else 512
        _prep_fp8_kernel[(rows,)](x2, out, kw, x2.stride(0), k, PH_=ph, BW=bw, ONE_PASS=one,
                                  num_warps=8 if bw > 512 else 4)
    elif rows:
        bw = min(256, next_pow2(kw))
        _prep_kernel[(rows, triton.cdiv(kw, bw))](x2, out, kw, x2.stride(0), k, PH_=ph, BW=bw, num_warps=4)
    return out


# ----------------------------------------------------------------------------- argument checks

def fits(codes: torch.Tensor, k: int, fmt: str) -> bool:
    """Whether `codes` ([..., N, K / per byte]) can be read as 32-bit words: contiguous, 4-byte aligned
    rows of whole words (every real shape; a test's odd one goes elsewhere)."""
    return (codes.stride(-1) == 1 and codes.shape[-1] % 4 == 0 and codes.storage_offset() % 4 == 0
            and all(st % 4 == 0 for st in codes.stride()[:-1]) and k % PH[fmt] == 0)


def _words(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """The codes as int32 words (a view: the last dim must be contiguous, 4-byte aligned, whole words)."""
    if codes.stride(-1) != 1 or codes.shape[-1] % 4:
        raise ValueError(f"{fmt} codes {tuple(codes.shape)} are not rows of whole 32-bit words")
    return codes.view(torch.int32)


def _chunk_words(fmt: str) -> int:
    return 2 if fmt == "nvfp4" else 4           # 8 bytes (one NVFP4 16-block) or 16 bytes per thread


def _gscale(g, like):
    return g if g is not None else like


# ------------------------------------------------------------------------------------ dense linear

@triton.jit
def _linear_kernel(x_ptr, c_ptr, s_ptr, g_ptr, out_ptr, M, N, KW, stride_x, stride_c, stride_s, stride_o,
                   FMT: tl.constexpr, INVERSE: tl.constexpr, TB: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                   CW: tl.constexpr, EVEN_K: tl.constexpr, PREP: tl.constexpr):
    rr = tl.program_id(0) * R + tl.arange(0, R)
    mr = rr < N
    crow, rmask, srow, smask = _rows(rr, mr, stride_c, stride_s)
    g = _global_factor(g_ptr, 0, FMT, INVERSE)
    for t0 in range(0, M, TB):
        t64 = t0 + tl.zeros((), tl.int64)          # the loop index is a Python int under the interpreter
        last = M - 1
        o0, o1, o2, o3 = _gemv(c_ptr, crow, rmask, s_ptr, srow, smask, KW, g, x_ptr, t64 * stride_x,
                               tl.minimum(t64 + 1, last) * stride_x, tl.minimum(t64 + 2, last) * stride_x,
                               tl.minimum(t64 + 3, last) * stride_x, FMT, TB, R, G, CW, EVEN_K, PREP)
        dst = out_ptr + t64 * stride_o + rr
        tl.store(dst, o0.to(out_ptr.dtype.element_ty), mask=mr)
        if TB > 1:
            tl.store(dst + stride_o, o1.to(out_ptr.dtype.element_ty), mask=mr & (t64 + 1 < M))
        if TB > 2:
            tl.store(dst + 2 * stride_o, o2.to(out_ptr.dtype.element_ty), mask=mr & (t64 + 2 < M))
            tl.store(dst + 3 * stride_o, o3.to(out_ptr.dtype.element_ty), mask=mr & (t64 + 3 < M))


# rows per program x chunks along K per step (G lanes: a power of two <= 32), warps, and whether the
# activations are prepared first (one more launch, no conversion in the loop). R / num_warps rows each
# thread holds (the x loads are shared between them).
LINEAR = dict(R=16, G=32, num_warps=8, PREP=True)
LINEAR_MAX_M = 8                     # up to this many tokens the GEMV wins (bench --decode decides)


def _tile(cfg: dict, kw: int, cw: int, rows: int) -> tuple[int, int, bool]:
    """(chunks per K step, rows per program, whether the steps cover K exactly): the most chunks up to
    cfg's G whose step divides the row (a step of G lanes x 16 bytes; tp4's 384-byte rows take G = 8),
    and at least the rows the warps' other lanes cover (32 / G per warp), `rows` = cfg's."""
    g = cfg["G"]
    while g > 1 and kw % (g * cw):
        g //= 2
    even = kw % (g * cw) == 0
    if not even:                                  # odd row lengths (tests): masked steps
        g = min(cfg["G"], next_pow2(triton.cdiv(kw, cw)))
    return g, max(rows, (32 // min(g, 32)) * cfg["num_warps"]), even


def linear(x: torch.Tensor, fmt: str, codes: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor | None = None,
           inverse: bool = False, cfg: dict | None = None, fp8_rows: bool = False) -> torch.Tensor:
    """x [..., K] (bf16 / fp16, at most a few tokens) @ dequant(W [N, K])^T -> [..., N] in x.dtype, as
    triton_kernels.linear (FP8: weight-only here, on x as given, or with `fp8_rows` on x quantized per
    row to E4M3 first: W8A8's numbers up to one rounding of each activation to x's dtype)."""
    c = dict(LINEAR, **(cfg or {}))
    k, n = x.shape[-1], codes.shape[-2]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = _empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cw = _chunk_words(fmt)
    words = _words(codes, fmt)
    kw = words.shape[-1]
    if kw * PH[fmt] != k:
        raise ValueError(f"x has {k} columns, the {fmt} weight {kw * PH[fmt]}")
    g, r, even = _tile(c, kw, cw, c["R"])
    prepared = bool(c["PREP"]) or fp8_rows
    xin = prep(x2, fmt, fp8_rows) if prepared else x2
    tb = _max_t(m, c)
    _linear_kernel[(triton.cdiv(n, r),)](
        xin, words, scales, _gscale(gscale, x2), out.view(-1, n), m, n, kw, xin.stride(0), words.stride(-2),
        scales.stride(-2), n, FMT=FMT[fmt], INVERSE=bool(inverse), TB=tb, R=r, G=g, CW=cw, EVEN_K=even,
        PREP=prepared, **_launch(c))
    return out


# ------------------------------------------------------------------------------ MoE decode kernels

@triton.jit
def _up_pass(x_ptr, stride_x, act_ptr, pid, t0, cnt, sel, pos, cb, crow, rmask, sb, srow, smask, KW, g, ri, mi, I,
             BLOCK_N: tl.constexpr, N_PAD: tl.constexpr, BI: tl.constexpr, FMT: tl.constexpr, TB: tl.constexpr,
             G: tl.constexpr, CW: tl.constexpr, EVEN_K: tl.constexpr, PREP: tl.constexpr, ACT_PH: tl.constexpr):
    """Up to TB of the slot's tokens from the t0-th: gate/up GEMV, SwiGLU, act rows written."""
    rn = tl.arange(0, N_PAD)
    tok0 = _token(sel, pos, rn, t0)
    tok1 = _token(sel, pos, rn, t0 + 1)
    tok2 = _token(sel, pos, rn, t0 + 2)
    tok3 = _token(sel, pos, rn, t0 + 3)
    o0, o1, o2, o3 = _gemv(cb, crow, rmask, sb, srow, smask, KW, g, x_ptr,
                           tok0.to(tl.int64) * stride_x, tok1.to(tl.int64) * stride_x, tok2.to(tl.int64) * stride_x,
                           tok3.to(tl.int64) * stride_x, FMT, TB, 2 * BI, G, CW, EVEN_K, PREP)
    _act_store(act_ptr, pid, tok0, o0, ri, mi & (t0 < cnt), I, BLOCK_N, BI, ACT_PH)
    if TB > 1:
        _act_store(act_ptr, pid, tok1, o1, ri, mi & (t0 + 1 < cnt), I, BLOCK_N, BI, ACT_PH)
    if TB > 2:
        _act_store(act_ptr, pid, tok2, o2, ri, mi & (t0 + 2 < cnt), I, BLOCK_N, BI, ACT_PH)
        _act_store(act_ptr, pid, tok3, o3, ri, mi & (t0 + 3 < cnt), I, BLOCK_N, BI, ACT_PH)


@triton.jit
def _act_store(act_ptr, pid, tok, o, ri, ok, I, BLOCK_N: tl.constexpr, BI: tl.constexpr, ACT_PH: tl.constexpr):
    """SwiGLU of one token's [gate rows, up rows] sums, rounded to bf16 as the reference does; ACT_PH:
    stored prepared for the down kernel (fp32 times 2^64, phase-major for ACT_PH columns a word)."""
    a, b = tl.split(tl.trans(tl.reshape(o, (2, BI))))
    v = (a * (b * tl.sigmoid(b))).to(tl.bfloat16)
    row = (pid.to(tl.int64) * BLOCK_N + tok) * I
    if ACT_PH > 0:
        tl.store(act_ptr + row + (ri % ACT_PH) * (I // ACT_PH) + ri // ACT_PH, v.to(tl.float32) * X_SCALE, mask=ok)
    else:
        tl.store(act_ptr + row + ri, v.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_up_kernel(x_ptr, ids_ptr, active_ptr, c_ptr, s_ptr, g_ptr, act_ptr, N, I, KW, stride_x,
                    c_sm, c_se, c_sr, s_sm, s_se, s_sr, g_se, SLOTS,
                    K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, N_PAD: tl.constexpr, BI: tl.constexpr,
                    G: tl.constexpr, CW: tl.constexpr, FMT: tl.constexpr, INVERSE: tl.constexpr,
                    ROUTED: tl.constexpr, EVEN_K: tl.constexpr, PREP: tl.constexpr, ACT_PH: tl.constexpr,
                    MAX_T: tl.constexpr):
    """Gate/up GEMV + SwiGLU of (micro, slot) programs x BI rows of I: rows [i, I + i) of the expert's
    [2I, H] matrix (gate then up) in one tile."""
    pid = tl.program_id(0)
    m = pid // SLOTS
    slot = pid % SLOTS
    e, sel, pos, j, cnt = _slot_tokens(ids_ptr, active_ptr, slot, N, K, K_PAD, N_PAD, ROUTED)
    if cnt > 0:                      # a slot past the chosen experts reads no weight
        cb = c_ptr + m.to(tl.int64) * c_sm + e.to(tl.int64) * c_se
        sb = s_ptr + m.to(tl.int64) * s_sm + e.to(tl.int64) * s_se
        g = _global_factor(g_ptr, e * g_se, FMT, INVERSE)
        rr = tl.arange(0, 2 * BI)
        i = tl.program_id(1) * BI + rr % BI
        crow, rmask, srow, smask = _rows(i + (rr // BI) * I, i < I, c_sr, s_sr)
        ri = tl.program_id(1) * BI + tl.arange(0, BI)
        mi = ri < I
        # token buckets 1, 2, MAX_T (= min(N, DECODE_TB), known at launch): only those up to MAX_T are
        # compiled, so one token's kernel keeps the registers of the 1-token loop
        if MAX_T == 1 or cnt == 1:
            _up_pass(x_ptr, stride_x, act_ptr, pid, 0, cnt, sel, pos, cb, crow, rmask, sb, srow, smask, KW, g, ri,
                     mi, I, BLOCK_N, N_PAD, BI, FMT, 1, G, CW, EVEN_K, PREP, ACT_PH)
        elif MAX_T > 2 and cnt == 2:
            _up_pass(x_ptr, stride_x, act_ptr, pid, 0, cnt, sel, pos, cb, crow, rmask, sb, srow, smask, KW, g, ri,
                     mi, I, BLOCK_N, N_PAD, BI, FMT, 2, G, CW, EVEN_K, PREP, ACT_PH)
        else:                            # passes of MAX_T tokens (their weight rows come again from L2)
            for t0 in range(0, cnt, MAX_T):
                _up_pass(x_ptr, stride_x, act_ptr, pid, t0, cnt, sel, pos, cb, crow, rmask, sb, srow, smask, KW, g,
                         ri, mi, I, BLOCK_N, N_PAD, BI, FMT, MAX_T, G, CW, EVEN_K, PREP, ACT_PH)


@triton.jit
def _down_pass(act_ptr, y_ptr, slot, t0, cnt, sel, pos, jk, c_ptr, s_ptr, e, c_sm, c_se, s_sm, s_se, crow, rmask,
               srow, smask, KW, g, rh, mh, H, I, SLOTS, MC,
               K: tl.constexpr, BLOCK_N: tl.constexpr, N_PAD: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr,
               TB: tl.constexpr, G: tl.constexpr, CW: tl.constexpr, EVEN_K: tl.constexpr, PREP: tl.constexpr,
               ROUTED: tl.constexpr):
    """Up to TB of the slot's tokens from the t0-th: the down GEMV summed over the micros (fp32), y rows
    written (routed: row t*K + j of token t's j-th choice; shared: row t)."""
    rn = tl.arange(0, N_PAD)
    tok0 = _token(sel, pos, rn, t0)
    tok1 = _token(sel, pos, rn, t0 + 1)
    tok2 = _token(sel, pos, rn, t0 + 2)
    tok3 = _token(sel, pos, rn, t0 + 3)
    y0 = tl.zeros((R,), dtype=tl.float32)
    y1 = tl.zeros((R,), dtype=tl.float32)
    y2 = tl.zeros((R,), dtype=tl.float32)
    y3 = tl.zeros((R,), dtype=tl.float32)
    for m in range(MC):             # micro partials summed here, before the route weight (finalize)
        m64 = m + tl.zeros((), tl.int64)          # the loop index is a Python int under the interpreter
        cb = c_ptr + m64 * c_sm + e.to(tl.int64) * c_se
        sb = s_ptr + m64 * s_sm + e.to(tl.int64) * s_se
        base = (m64 * SLOTS + slot) * BLOCK_N
        o0, o1, o2, o3 = _gemv(cb, crow, rmask, sb, srow, smask, KW, g, act_ptr,
                               (base + tok0) * I, (base + tok1) * I, (base + tok2) * I, (base + tok3) * I,
                               FMT, TB, R, G, CW, EVEN_K, PREP)
        y0 += o0
        y1 += o1
        y2 += o2
        y3 += o3
    _y_store(y_ptr, tok0, tl.sum(tl.where(sel & (pos == t0), jk, 0), axis=0), y0, rh, mh & (t0 < cnt), H, K, ROUTED)
    if TB > 1:
        _y_store(y_ptr, tok1, tl.sum(tl.where(sel & (pos == t0 + 1), jk, 0), axis=0), y1, rh, mh & (t0 + 1 < cnt), H,
                 K, ROUTED)
    if TB > 2:
        _y_store(y_ptr, tok2, tl.sum(tl.where(sel & (pos == t0 + 2), jk, 0), axis=0), y2, rh, mh & (t0 + 2 < cnt), H,
                 K, ROUTED)
        _y_store(y_ptr, tok3, tl.sum(tl.where(sel & (pos == t0 + 3), jk, 0), axis=0), y3, rh, mh & (t0 + 3 < cnt), H,
                 K, ROUTED)


@triton.jit
def _y_store(y_ptr, tok, j, y, rh, ok, H, K: tl.constexpr, ROUTED: tl.constexpr):
    if ROUTED:
        row = tok.to(tl.int64) * K + j
    else:
        row = tok.to(tl.int64)
    tl.store(y_ptr + row * H + rh, y, mask=ok)


@triton.jit
def _gemv_down_kernel(act_ptr, ids_ptr, active_ptr, c_ptr, s_ptr, g_ptr, y_ptr, N, H, I, KW,
                      c_sm, c_se, c_sr, s_sm, s_se, s_sr, g_se, SLOTS, MC,
                      K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, N_PAD: tl.constexpr,
                      R: tl.constexpr, G: tl.constexpr, CW: tl.constexpr, FMT: tl.constexpr, INVERSE: tl.constexpr,
                      ROUTED: tl.constexpr, EVEN_K: tl.constexpr, PREP: tl.constexpr, MAX_T: tl.constexpr):
    """Down GEMV of each slot x R rows of H, the micro partials summed here (fp32)."""
    slot = tl.program_id(0)
    rh = tl.program_id(1) * R + tl.arange(0, R)
    mh = rh < H
    e, sel, pos, jk, cnt = _slot_tokens(ids_ptr, active_ptr, slot, N, K, K_PAD, N_PAD, ROUTED)
    if cnt > 0:
        g = _global_factor(g_ptr, e * g_se, FMT, INVERSE)
        crow, rmask, srow, smask = _rows(rh, mh, c_sr, s_sr)
        if MAX_T == 1 or cnt == 1:
            _down_pass(act_ptr, y_ptr, slot, 0, cnt, sel, pos, jk, c_ptr, s_ptr, e, c_sm, c_se, s_sm, s_se, crow,
                       rmask, srow, smask, KW, g, rh, mh, H, I, SLOTS, MC, K, BLOCK_N, N_PAD, R, FMT, 1, G, CW, EVEN_K,
                       PREP, ROUTED)
        elif MAX_T > 2 and cnt == 2:
            _down_pass(act_ptr, y_ptr, slot, 0, cnt, sel, pos, jk, c_ptr, s_ptr, e, c_sm, c_se, s_sm, s_se, crow,
                       rmask, srow, smask, KW, g, rh, mh, H, I, SLOTS, MC, K, BLOCK_N, N_PAD, R, FMT, 2, G, CW, EVEN_K,
                       PREP, ROUTED)
        else:
            for t0 in range(0, cnt, MAX_T):
                _down_pass(act_ptr, y_ptr, slot, t0, cnt, sel, pos, jk, c_ptr, s_ptr, e, c_sm, c_se, s_sm, s_se, crow,
                           rmask, srow, smask, KW, g, rh, mh, H, I, SLOTS, MC, K, BLOCK_N, N_PAD, R, FMT, MAX_T, G, CW,
                           EVEN_K, PREP, ROUTED)


# The most tokens one pass multiplies (2 or 4). A kernel's registers are those of its largest bucket: with 4,
# every program of an N > 2 launch holds ~200 (one CTA of 8 warps per SM); with 2, ~128, and a slot's 3+
# tokens take more passes over its rows (from L1 / L2). bench --decode times both at 8 tokens.
DECODE_TB = 2


def _max_t(n: int, cfg: dict) -> int:
    """The largest token bucket a launch for n tokens needs: 1, 2 or DECODE_TB (cfg's TB)."""
    return n if n <= 2 else cfg.get("TB", DECODE_TB)

# decode tiles: BI rows of I (x2: gate and up) / R rows of H per program, G chunks along K per step
DECODE_UP = dict(BI=16, G=32, num_warps=8)     # bench_decode_parts.py moe (2026-12-01): 106.9 vs 108.8 us a layer (BI=8)
DECODE_DOWN = dict(R=16, G=32, num_warps=8)
DECODE_UP_FMT: dict[str, dict] = {}
DECODE_DOWN_FMT: dict[str, dict] = {}


def _launch(cfg: dict) -> dict:
    """The launch options of a tile config (maxnreg: a register cap, e.g. for the 4-token bucket)."""
    out = dict(num_warps=cfg["num_warps"], num_stages=1)
    if cfg.get("maxnreg"):
        out["maxnreg"] = cfg["maxnreg"]
    return out


def act_ph(fmt: str) -> int:
    """The PH a down GEMV of `fmt` reads prepared activations with (0: it reads bf16 act: FP8, whose
    activations are quantized per row between the two GEMVs)."""
    return 0 if fmt == "fp8" else PH[fmt]


def decode_up(x, ids, active, fmt: str, codes, scales, gscale, inverse: bool, act, slots: int, inter: int,
              up: dict | None = None, *, x_prepared: bool = False, act_prep: int = 0) -> None:
    """Gate/up + SwiGLU for every (micro, slot), the quantized form of moe/triton_kernels.decode_up: routed (active given) codes
    [micros, E, 2I, H/pb], shared (active None) [micros, 2I, H/pb] with slots == 1; act [micros, slots,
    16, I] gets the rows of the tokens each slot serves. x: [N, H] bf16, or (x_prepared) `prep(x, fmt)`.
    act_prep = PH > 0: act is fp32 and written prepared for a down GEMV of that PH (`act_ph`)."""
    cfg = dict(DECODE_UP, **DECODE_UP_FMT.get(fmt, {}), **(up or {}))
    n, h = x.shape
    mc = act.shape[0]
    words = _words(codes, fmt)
    cw = _chunk_words(fmt)
    kw = words.shape[-1]
    if kw * PH[fmt] != h:
        raise ValueError(f"x has {h} columns, the {fmt} weight {kw * PH[fmt]}")
    if act_prep and (act.dtype != torch.float32 or inter % act_prep):
        raise ValueError("prepared act is fp32 with whole code words per row")
    g, r, even = _tile(cfg, kw, cw, 2 * cfg["BI"])
    bi = r // 2
    gs = _gscale(gscale, x)
    grid = (mc * slots, triton.cdiv(inter, bi))
    _gemv_up_kernel[grid](x, ids, active if active is not None else ids, words, scales, gs, act, n, inter, kw,
                          x.stride(0), *_lead_strides(words), *_lead_strides(scales), _g_stride(gscale), slots,
                          K=ids.shape[1], K_PAD=max(2, next_pow2(ids.shape[1])), BLOCK_N=act.shape[2],
                          N_PAD=max(2, next_pow2(n)), BI=bi, G=g, CW=cw, FMT=FMT[fmt], INVERSE=bool(inverse),
                          ROUTED=active is not None, EVEN_K=even, PREP=bool(x_prepared), ACT_PH=int(act_prep),
                          MAX_T=_max_t(n, cfg), **_launch(cfg))


def decode_down(act, ids, active, fmt: str, codes, scales, gscale, inverse: bool, y, slots: int, inter: int,
                down: dict | None = None, *, act_prepared: bool = False) -> None:
    """Down GEMV of every slot, micro partials summed, the quantized form of moe/triton_kernels.decode_down: both packs
    cols-packed, codes and scales of the active micros' column block (`QWeight.cols`; micro m's columns
    start at m*I): routed [E, H, micros*I/pb], y [N*k, H] fp32; shared (active None) [H, micros*I/pb],
    y [N, H] fp32. act: [micros, slots, 16, I] bf16, or (act_prepared) fp32 as decode_up(act_prep=PH)
    writes it."""
    cfg = dict(DECODE_DOWN, **DECODE_DOWN_FMT.get(fmt, {}), **(down or {}))
    mc, _, bn, _ = act.shape
    n, k = ids.shape
    h = y.shape[1]
    words = _words(codes, fmt)
    cw = _chunk_words(fmt)
    ph = PH[fmt]
    kw = inter // ph
    bs = BLOCK[fmt]
    if act_prepared != (act.dtype == torch.float32):
        raise ValueError("prepared act is fp32, plain act bf16 / fp16")
    if words.dim() != (3 if active is not None else 2) or words.shape[-1] != mc * kw or inter % ph or inter % bs:
        raise ValueError(f"act has {mc} micros of {inter} columns, the {fmt} weight block {words.shape[-1] * ph}")
    c_str = col_strides(words, kw)
    s_str = col_strides(scales, inter // bs if fmt != "fp8" else 0)
    g, r, even = _tile(cfg, kw, cw, cfg["R"])
    gs = _gscale(gscale, y)
    grid = (slots, triton.cdiv(h, r))
    _gemv_down_kernel[grid](act, ids, active if active is not None else ids, words, scales, gs, y, n, h, inter, kw,
                            *c_str, *s_str, _g_stride(gscale), slots, mc,
                            K=k, K_PAD=max(2, next_pow2(k)), BLOCK_N=bn, N_PAD=max(2, next_pow2(n)), R=r, G=g,
                            CW=cw, FMT=FMT[fmt], INVERSE=bool(inverse), ROUTED=active is not None, EVEN_K=even,
                            PREP=bool(act_prepared), MAX_T=_max_t(n, cfg), **_launch(cfg))
