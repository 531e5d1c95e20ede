"""The grouped path's GEMM1 + SwiGLU of every active micro in one Triton kernel (`gemm1_swiglu`).

For every permuted row r (expert order, rows of expert e = [offs[e-1], offs[e])), active micro m and
column j < I:

    act[r, m*I + j] = (x[src[r]] . w1[ms+m, e, j]) * silu(x[src[r]] . w1[ms+m, e, I + j])

accumulated in fp32 and cast once to act's dtype. It replaces three steps of the unfused path
(`cuda.permute` / `cuda.expert_mlp`): dispatch copying each token's row into its k routes' rows of xs
[N*k, H], per micro torch._grouped_mm -> hmid [R, 2I], and SwiGLU of hmid into act's column block.
Here the A operand is gathered straight from x by src (the token of each permuted row,
`triton_kernels.dispatch_rows`), so xs never exists; each program computes a BM x BN tile of BOTH halves
(two fp32 accumulators: gate columns j.. and up columns I+j.. of one expert and micro) and writes
their SwiGLU product, so the 2I-wide intermediate never reaches memory either. One launch covers all
micros.

Tiles. The M tiles of each expert are cdiv(count_e, BM) (its last one masked at its end), so their
number depends on the routing: the grid is a static upper bound, (cdiv(R, BM) + E) M tiles times
micro_count * cdiv(I, BN) N tiles, flattened to one axis; each program finds its expert on the device
from offs (tiles per expert, their cumulative sum, how many sums are <= its id) and programs past the
last tile exit. No host sync, no atomics, every output element written by exactly one program.
Inside an expert the programs walk GROUP_M M tiles at a time with M fastest (the usual grouped
swizzle): programs running side by side share one weight tile of the expert, and the expert's few A
tiles stay in L2 while its N tiles go by, so each weight byte comes from HBM about once.

Loads. A (gathered rows of x) by pointers, which Triton pipelines with cp.async. The weight tiles
either by pointers too (WLOAD="ptr") or by TMA through a tensor descriptor over the pack seen as
[micros*E*2I, H] (WLOAD="host": a host-built descriptor passed as a kernel argument; WLOAD="device":
built in the kernel by tl.make_tensor_descriptor, which needs a global scratch allocator). Rows past
an expert's end and columns past I are clamped to valid ones for the pointer loads (no masks in the
K loop) and masked only at the store; the TMA forms read the neighbouring rows there (or zeros past
the pack), which only reach masked columns. H must be a multiple of BK (4096 is).

FUSE_N: the gate and up tiles as ONE [2BN, BK] weight tile and ONE [BM, 2BN] accumulator (split into the
halves in the epilogue), so each K step is one wide MMA on the A tile instead of two narrow ones; with
TMA the tile is a [2, BN, BK] box of the pack seen as [micros*E*2, I, H] (zeros past I). The fastest
form on the H200 (see CONFIG).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import dot, next_pow2
from .triton_kernels import INTERPRET

# the tile configuration the engine runs (`python -m bench gemm1` times the alternatives in CONFIGS). One H200,
# 2026-12-01 (`python bench/bench_gemm1.py`, now `python -m bench gemm1`, +-5% run to run): this one 1.33 ms = 621 TFLOP/s at hybrid4 denoise (uniform routing;
# today's dispatch + 2 grouped GEMM1s + SwiGLU 1.51 ms), the two-dot TMA forms ~560-600, pointer-loaded
# weights ~540, BM 64 / BN 64 / BK 128 tiles slower still. In the whole op (profiler, per layer): this
# kernel 1.31 ms where torch._grouped_mm's two GEMM1s took 1.34 ms plus dispatch 83 us and SwiGLU 78 us.
CONFIG = dict(BM=128, BN=128, BK=64, GROUP_M=8, WLOAD="host", FUSE_N=True, num_warps=8, num_stages=4)

# the variants `python -m bench gemm1` tries on the GPU (name -> CONFIG overrides); "f-" = FUSE_N (one
# [BM, 2BN] accumulator), tma / dtma = weight tiles by a host / in-kernel tensor descriptor, ptr = pointers
_T = dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
CONFIGS = {
    "f-tma-m128n128s4": dict(_T, WLOAD="host", FUSE_N=True),
    "f-tma-m128n128s3": dict(_T, WLOAD="host", FUSE_N=True, num_stages=3),
    "f-tma-m128n128s4g16": dict(_T, WLOAD="host", FUSE_N=True, GROUP_M=16),
    "f-dtma-m128n128s4": dict(_T, WLOAD="device", FUSE_N=True),
    "f-ptr-m128n128s4": dict(_T, WLOAD="ptr", FUSE_N=True),
    "f-tma-m64n128s4w4": dict(_T, WLOAD="host", FUSE_N=True, BM=64, num_warps=4),
    "tma-m128n128s4": dict(_T, WLOAD="host", FUSE_N=False),
    "dtma-m128n128s4": dict(_T, WLOAD="device", FUSE_N=False),
    "ptr-m128n128s4": dict(_T, WLOAD="ptr", FUSE_N=False),
    "ptr-m128n128s3g1": dict(_T, WLOAD="ptr", FUSE_N=False, num_stages=3, GROUP_M=1),
}

_WLOAD = {"ptr": 0, "host": 1, "device": 2}


# micro_start / MC unspecialised: AR prefill (micro 1 alone) and denoise (micros 0, 1) share one compile
@triton.jit(do_not_specialize=["micro_start", "MC"])
def _gemm1_swiglu_kernel(x_ptr, src_ptr, offs_ptr, w1_ptr, w1_desc, act_ptr, H, I, stride_x, stride_act,
                         micro_start, NT_MICRO, MC, W_ROWS,
                         E: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, WLOAD: tl.constexpr, FUSE_N: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    nt = MC * NT_MICRO                                 # N tiles of one M tile: every micro's columns
    # this program's expert, from offs alone: tiles per expert, their cumulative sum, then how many
    # experts' tile ranges (in program ids) end at or before pid
    re = tl.arange(0, E_PAD)
    me = re < E
    ends = tl.load(offs_ptr + re, mask=me, other=0)
    starts = tl.load(offs_ptr + re - 1, mask=me & (re > 0), other=0)
    tiles = (ends - starts + BM - 1) // BM
    last = tl.cumsum(tiles, axis=0) * nt              # one past each expert's last program id
    e = tl.sum((last <= pid).to(tl.int32), axis=0)
    if e < E:                                          # else: past the last tile (the bound's slack)
        pick = re == e
        tiles_e = tl.sum(tl.where(pick, tiles, 0), axis=0)
        local = pid - tl.sum(tl.where(pick, last, 0), axis=0) + tiles_e * nt
        row0 = tl.sum(tl.where(pick, starts, 0), axis=0)
        row_end = tl.sum(tl.where(pick, ends, 0), axis=0)
        # grouped swizzle inside the expert: GROUP_M M tiles side by side, M fastest
        width = GROUP_M * nt
        first_m = (local // width) * GROUP_M
        group = tl.minimum(tiles_e - first_m, GROUP_M)
        mt = first_m + (local % width) % group
        n = (local % width) // group
        m = n // NT_MICRO                              # the active micro, and its column tile
        j0 = (n % NT_MICRO) * BN

        rows = row0 + mt * BM + tl.arange(0, BM)
        row_ok = rows < row_end
        tok = tl.load(src_ptr + tl.minimum(rows, row_end - 1))     # clamped: no masks in the K loop
        cols = j0 + tl.arange(0, BN)
        col_ok = cols < I
        rk = tl.arange(0, BK)
        a_ptrs = x_ptr + tok.to(tl.int64)[:, None] * stride_x + rk[None, :]
        # the expert's gate/up block of this micro: rows ((ms+m)*E + e)*2I .. of the pack seen as [., H]
        w_row = ((micro_start + m) * E + e).to(tl.int64) * (2 * I)
        if FUSE_N:
            # both halves as ONE [2BN, BK] weight tile (gate rows j0.., then up rows I+j0..) and one
            # [BM, 2BN] accumulator: one wide MMA per K step instead of two narrow ones on the same A
            r2 = tl.arange(0, 2 * BN)
            if WLOAD == 0:
                wc2 = (r2 // BN) * I + tl.minimum(j0 + r2 % BN, I - 1)
                b_ptrs = w1_ptr + (w_row + wc2)[:, None] * H + rk[None, :]
            if WLOAD == 1:
                wd = w1_desc
            if WLOAD == 2:
                wd = tl.make_tensor_descriptor(w1_ptr, shape=[W_ROWS // I, I, H], strides=[I * H, H, 1],
                                               block_shape=[2, BN, BK])
            acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
            for k in range(0, H, BK):
                a = tl.load(a_ptrs)
                if WLOAD == 0:
                    b = tl.load(b_ptrs)
                    b_ptrs += BK
                else:   # [2, BN, BK] of the pack seen as [micros*E*2, I, H]: zeros past I
                    b = wd.load([((micro_start + m) * E + e) * 2, j0, k]).reshape(2 * BN, BK)
                acc = dot(a, tl.trans(b), acc, UPCAST)
                a_ptrs += BK
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        else:
            if WLOAD == 0:
                wc = tl.minimum(cols, I - 1)
                g_ptrs = w1_ptr + (w_row + wc)[:, None] * H + rk[None, :]
                u_ptrs = w1_ptr + (w_row + I + wc)[:, None] * H + rk[None, :]
            if WLOAD == 1:
                wd = w1_desc
            if WLOAD == 2:
                wd = tl.make_tensor_descriptor(w1_ptr, shape=[W_ROWS, H], strides=[H, 1], block_shape=[BN, BK])
            acc_g = tl.zeros((BM, BN), dtype=tl.float32)
            acc_u = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(0, H, BK):
                a = tl.load(a_ptrs)
                if WLOAD == 0:
                    bg = tl.load(g_ptrs)
                    bu = tl.load(u_ptrs)
                    g_ptrs += BK
                    u_ptrs += BK
                else:
                    bg = wd.load([(w_row + j0).to(tl.int32), k])
                    bu = wd.load([(w_row + I + j0).to(tl.int32), k])
                acc_g = dot(a, tl.trans(bg), acc_g, UPCAST)
                acc_u = dot(a, tl.trans(bu), acc_u, UPCAST)
                a_ptrs += BK
        act = acc_g * (acc_u * tl.sigmoid(acc_u))
        dst = act_ptr + rows.to(tl.int64)[:, None] * stride_act + (m * I + cols)[None, :]
        tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_ALLOCATOR = [False]


def _device_descriptor_scratch() -> None:
    """tl.make_tensor_descriptor in a kernel writes its descriptors to a global scratch buffer that
    Triton asks for through this allocator (set once, process-wide)."""
    if not _ALLOCATOR[0]:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR[0] = True


def fits(x: torch.Tensor, w1: torch.Tensor) -> bool:
    """Shapes the default CONFIG runs (host-known, never data): H a multiple of BK, and 16-byte aligned
    rows for the weight descriptor (every real checkpoint: H 4096). Other shapes take torch._grouped_mm."""
    h, inter = w1.shape[3], w1.shape[2] // 2
    return (x.dtype == w1.dtype and x.shape[1] == h and h % CONFIG["BK"] == 0 and w1.is_contiguous()
            and (h * w1.element_size()) % 16 == 0 and (inter * h * w1.element_size()) % 16 == 0)


def tiles_bound(rows: int, experts: int, bm: int) -> int:
    """The M tiles any routing of `rows` permuted rows over `experts` experts can need:
    sum_e cdiv(c_e, BM) <= sum_e (c_e / BM + 1)."""
    return triton.cdiv(rows, bm) + experts


def gemm1_swiglu(x: torch.Tensor, src: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, micro_start: int,
                 micro_count: int, act: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """act [R, >= micro_count*I] (unit column stride) <- SwiGLU of micros [micro_start, +micro_count)
    of GEMM1 on the rows x[src] grouped by expert (offs [E] int32 cumulative end rows); w1 is the
    resident pack [micros, E, 2I, H] (contiguous). Returns act."""
    cfg = dict(CONFIG, **(config or {}))
    n, h = x.shape
    micros, e, two_i, h1 = w1.shape
    inter = two_i // 2
    r = src.shape[0]
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    if h1 != h or x.stride(1) != 1 or not w1.is_contiguous() or offs.shape != (e,):
        raise ValueError(f"gemm1_swiglu: x {tuple(x.shape)} / {x.stride()}, w1 {tuple(w1.shape)}, offs {tuple(offs.shape)}")
    if act.shape[0] != r or act.shape[1] < micro_count * inter or (r and act.stride(1) != 1):
        raise ValueError(f"gemm1_swiglu: act {tuple(act.shape)} / {act.stride()} for {r} rows of {micro_count} x {inter}")
    if h % bk:
        raise ValueError(f"gemm1_swiglu: H {h} is not a multiple of BK {bk}")
    if not 0 <= micro_start < micro_start + micro_count <= micros:
        raise ValueError(f"gemm1_swiglu: micros [{micro_start}, +{micro_count}) of {micros}")
    if r == 0:
        return act
    wload = _WLOAD[cfg["WLOAD"]]
    w_rows = micros * e * two_i
    desc = w1
    if wload == 1:
        from triton.tools.tensor_descriptor import TensorDescriptor
        if cfg["FUSE_N"]:
            desc = TensorDescriptor.from_tensor(w1.view(micros * e * 2, inter, h), [2, bn, bk])
        else:
            desc = TensorDescriptor.from_tensor(w1.view(w_rows, h), [bn, bk])
    elif wload == 2:
        _device_descriptor_scratch()
    nt_micro = triton.cdiv(inter, bn)
    grid = (tiles_bound(r, e, bm) * micro_count * nt_micro,)
    _gemm1_swiglu_kernel[grid](x, src, offs, w1, desc, act, h, inter, x.stride(0), act.stride(0), micro_start,
                               nt_micro, micro_count, w_rows, E=e, E_PAD=max(2, next_pow2(e)), BM=bm, BN=bn, BK=bk,
                               GROUP_M=cfg["GROUP_M"], WLOAD=wload, FUSE_N=bool(cfg["FUSE_N"]), UPCAST=INTERPRET,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return act
