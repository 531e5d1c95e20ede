"""The grouped path's down GEMM (GEMM2) of every active micro in one Triton kernel (`gemm2`).

For every permuted row r (expert order, rows of expert e = [offs[e-1], offs[e])) and output column n < H:

    out[r, n] = sum_k act[r, k] * w2[e, n, ms*I + k],   k < K = micro_count * I

accumulated in fp32 and cast once to act's dtype. act is the activation buffer moe_gemm1.gemm1_swiglu
writes (micro m of the active ones in columns [m*I, (m+1)*I)); w2 is the resident cols-packed down pack
[E, H, micros*I], whose active micros are the contiguous column block [ms*I, (ms+mc)*I) of each row, so
the kernel reads it in place (no weight copy), as torch._grouped_mm does through `moe_fast._down_cols`.

Tiles: the same scheme as moe_gemm1. The M tiles of expert e are cdiv(count_e, BM), so their number
depends on the routing; the grid is the static bound (cdiv(R, BM) + E) M tiles times cdiv(H, BN) N
tiles, flattened to one axis. Each program finds its expert on the device from offs (tiles per
expert, their cumulative sum, how many sums are <= its id); programs past the last tile exit. No host
sync, no atomics, every output element written by exactly one program. Inside an expert, GROUP_M M
tiles go side by side with M fastest, so concurrent programs share the weight tile [BN, K] of the
expert while its few A tiles stay in L2: each weight byte comes from HBM about once.

Loads. A (act rows) either by pointers (ALOAD="ptr"; rows past the expert's end clamped to its last
row, so no masks in the K loop) or by TMA over act [R, K'] (ALOAD="host"; rows past the expert's end
read the next expert's rows, zeros past R). Weight tiles by pointers (WLOAD="ptr"; columns past H
clamped to H-1), by a host-built TMA descriptor over w2 seen as [E*H, micros*I] (WLOAD="host": block
[BN, BK] at [e*H + n0, ms*I + k0]; rows past H read the next expert's first rows, zeros past E*H), or
by one built in the kernel (WLOAD="device", needs Triton's global scratch allocator). Whatever the
clamps and neighbours contribute lands only in rows / columns the store masks. K must be a multiple
of BK, so a K tile never reaches a micro outside the active block.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._triton import dot, next_pow2
from .moe_gemm1 import _device_descriptor_scratch, tiles_bound
from .moe_triton import INTERPRET

# the tile configuration the engine runs (bench/bench_gemm2.py times the alternatives in CONFIGS): a
# guess from moe_gemm1's H200 winner (BM 128 x BN 128 x BK 64, 8 warps, 4 stages, TMA weight tiles),
# not yet timed on the GPU.
CONFIG = dict(BM=128, BN=128, BK=64, GROUP_M=8, ALOAD="host", WLOAD="host", num_warps=8, num_stages=4)

# the variants bench/bench_gemm2.py tries on the GPU (name -> CONFIG overrides): "<A load>-<W load>-..."
# with tma = a host tensor descriptor, dtma = an in-kernel one, ptr = pointers
_T = dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
CONFIGS = {
    "tma-tma-m128n128s4": dict(_T, ALOAD="host", WLOAD="host"),
    "tma-tma-m128n128s3": dict(_T, ALOAD="host", WLOAD="host", num_stages=3),
    "tma-tma-m128n128s4g16": dict(_T, ALOAD="host", WLOAD="host", GROUP_M=16),
    "tma-tma-m128n256s3": dict(_T, ALOAD="host", WLOAD="host", BN=256, num_stages=3),
    "tma-tma-m256n128s3": dict(_T, ALOAD="host", WLOAD="host", BM=256, num_stages=3),
    "tma-tma-m64n256s4w4": dict(_T, ALOAD="host", WLOAD="host", BM=64, BN=256, num_warps=4),
    "tma-tma-m128n128k128s2": dict(_T, ALOAD="host", WLOAD="host", BK=128, num_stages=2),
    "ptr-tma-m128n128s4": dict(_T, ALOAD="ptr", WLOAD="host"),
    "tma-dtma-m128n128s4": dict(_T, ALOAD="host", WLOAD="device"),
    "ptr-ptr-m128n128s4": dict(_T, ALOAD="ptr", WLOAD="ptr"),
}

_ALOAD = {"ptr": 0, "host": 1}
_WLOAD = {"ptr": 0, "host": 1, "device": 2}


# micro_start unspecialised: AR prefill (micro 1 alone) and denoise (micros 0, 1) share one compile
@triton.jit(do_not_specialize=["micro_start"])
def _gemm2_kernel(act_ptr, act_desc, offs_ptr, w2_ptr, w2_desc, out_ptr, H, I, K, stride_act, stride_w,
                  stride_out, micro_start, NT, W_ROWS,
                  E: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  GROUP_M: tl.constexpr, ALOAD: tl.constexpr, WLOAD: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    # this program's expert, from offs alone (as moe_gemm1): tiles per expert, their cumulative sum,
    # then how many experts' tile ranges (in program ids) end at or before pid
    re = tl.arange(0, E_PAD)
    me = re < E
    ends = tl.load(offs_ptr + re, mask=me, other=0)
    starts = tl.load(offs_ptr + re - 1, mask=me & (re > 0), other=0)
    tiles = (ends - starts + BM - 1) // BM
    last = tl.cumsum(tiles, axis=0) * NT              # one past each expert's last program id
    e = tl.sum((last <= pid).to(tl.int32), axis=0)
    if e < E:                                          # else: past the last tile (the bound's slack)
        pick = re == e
        tiles_e = tl.sum(tl.where(pick, tiles, 0), axis=0)
        local = pid - tl.sum(tl.where(pick, last, 0), axis=0) + tiles_e * NT
        row0 = tl.sum(tl.where(pick, starts, 0), axis=0)
        row_end = tl.sum(tl.where(pick, ends, 0), axis=0)
        # grouped swizzle inside the expert: GROUP_M M tiles side by side, M fastest
        width = GROUP_M * NT
        first_m = (local // width) * GROUP_M
        group = tl.minimum(tiles_e - first_m, GROUP_M)
        mt = first_m + (local % width) % group
        n0 = ((local % width) // group) * BN

        m0 = row0 + mt * BM
        rows = m0 + tl.arange(0, BM)
        row_ok = rows < row_end
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < H
        rk = tl.arange(0, BK)
        k_w = micro_start * I                          # the active micros' first column of the pack
        if ALOAD == 0:
            a_rows = tl.minimum(rows, row_end - 1)     # clamped: no masks in the K loop
            a_ptrs = act_ptr + a_rows.to(tl.int64)[:, None] * stride_act + rk[None, :]
        if WLOAD == 0:
            w_rows = e.to(tl.int64) * H + tl.minimum(cols, H - 1)
            b_ptrs = w2_ptr + w_rows[:, None] * stride_w + (k_w + rk)[None, :]
        if WLOAD == 1:
            wd = w2_desc
        if WLOAD == 2:
            wd = tl.make_tensor_descriptor(w2_ptr, shape=[W_ROWS, stride_w], strides=[stride_w, 1],
                                           block_shape=[BN, BK])
        w_row0 = e * H + n0
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            if ALOAD == 0:
                a = tl.load(a_ptrs)
                a_ptrs += BK
            else:
                a = act_desc.load([m0, k])
            if WLOAD == 0:
                b = tl.load(b_ptrs)
                b_ptrs += BK
            else:
                b = wd.load([w_row0, k_w + k])
            acc = dot(a, tl.trans(b), acc, UPCAST)
        dst = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gemm2(act: torch.Tensor, offs: torch.Tensor, w2: torch.Tensor, micro_start: int, micro_count: int,
          out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """out [R, H] (act's dtype) <- the down GEMM of micros [micro_start, +micro_count) on the permuted
    rows act [R, micro_count*I] (unit column stride: I = act's width / micro_count), grouped by expert
    (offs [E] int32 cumulative end rows, offs[-1] == R); w2 is the cols-packed pack [E, H, micros*I]
    (contiguous). `out` [R, H] (unit column stride) may be given. Returns out."""
    cfg = dict(CONFIG, **(config or {}))
    if act.dim() != 2 or w2.dim() != 3 or micro_count < 1 or micro_start < 0:
        raise ValueError(f"gemm2: act {tuple(act.shape)}, w2 {tuple(w2.shape)}, micros [{micro_start}, +{micro_count})")
    e, h, cols_w = w2.shape
    r, kk = act.shape
    inter = kk // micro_count
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    if (r and act.stride(1) != 1) or not w2.is_contiguous() or w2.dtype != act.dtype:
        raise ValueError(f"gemm2: act {tuple(act.shape)} / {act.stride()} {act.dtype}, w2 {tuple(w2.shape)} "
                         f"{w2.dtype} (act needs unit column stride, w2 contiguous, one dtype)")
    if inter == 0 or kk % micro_count or cols_w % inter or (micro_start + micro_count) * inter > cols_w:
        raise ValueError(f"gemm2: act's {kk} columns are not {micro_count} micros of the pack's "
                         f"[E, H, micros * I] = {tuple(w2.shape)} from micro {micro_start}")
    if offs.shape != (e,) or offs.dtype != torch.int32:
        raise ValueError(f"gemm2: offs {tuple(offs.shape)} {offs.dtype}: int32 [{e}] expected")
    if kk % bk:
        raise ValueError(f"gemm2: K = micro_count * I = {kk} is not a multiple of BK {bk}")
    if out is None:
        out = torch.empty(r, h, dtype=act.dtype, device=act.device)
    if out.shape != (r, h) or out.dtype != act.dtype or (r and out.stride(1) != 1):
        raise ValueError(f"gemm2: out {tuple(out.shape)} / {out.stride()} {out.dtype} for [{r}, {h}] {act.dtype}")
    if r == 0:
        return out
    aload, wload = _ALOAD[cfg["ALOAD"]], _WLOAD[cfg["WLOAD"]]
    a_desc, w_desc = act, w2
    if aload and (act.stride(0) * act.element_size() % 16 or act.data_ptr() % 16):
        raise ValueError(f"gemm2: ALOAD='host' (TMA) needs act's rows 16-byte aligned, stride {act.stride(0)}")
    if aload or wload == 1:
        from triton.tools.tensor_descriptor import TensorDescriptor
        if aload:      # zeros past R; rows past an expert's end are the next expert's (masked at the store)
            a_desc = TensorDescriptor(act, [r, kk], [act.stride(0), 1], [bm, bk])
        if wload == 1:
            w_desc = TensorDescriptor.from_tensor(w2.view(e * h, cols_w), [bn, bk])
    if wload == 2:
        _device_descriptor_scratch()
    nt = triton.cdiv(h, bn)
    grid = (tiles_bound(r, e, bm) * nt,)
    _gemm2_kernel[grid](act, a_desc, offs, w2, w_desc, out, h, inter, kk, act.stride(0), cols_w, out.stride(0),
                        micro_start, nt, e * h, E=e, E_PAD=max(2, next_pow2(e)), BM=bm, BN=bn, BK=bk,
                        GROUP_M=cfg["GROUP_M"], ALOAD=aload, WLOAD=wload, UPCAST=INTERPRET,
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
