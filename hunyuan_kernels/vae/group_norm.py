"""GroupNorm followed by swish (x * sigmoid(x)), the input of each VAE ResNet conv.

    group_norm_swish(x [B,C,...], weight [C], bias [C], groups, eps, out_dtype | None)

Semantics are the VAE's `_swish(norm(x))` as it runs today: under autocast GroupNorm and swish are
fp32 (autocast's group_norm policy); the result is then cast to `out_dtype` (the conv that reads it
casts to the autocast dtype anyway), or kept when `out_dtype` is None.

Why a fused path: at the decoder's top level (128 channels, 4 frames of 1024^2) each pass of the
unfused ops moves a 1-2 GB tensor, about 20 GB for the norm, sigmoid, product and cast. The Triton
path reads x twice (statistics, then the normalise) and writes the result once in `out_dtype`.
Statistics are fp32 Welford partials over fixed chunks, combined in a fixed order (deterministic).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._triton import FLOATS, HAS_TRITON, available, next_pow2, tl, triton
from ..registry import backend, reference

BLOCK = 4096          # elements a program loads at once
MAX_SPLIT = 1024      # chunks per group of the statistics pass (its partials fit one finalize block)


@reference("group_norm_swish")
def group_norm_swish_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    y = F.group_norm(x, groups, weight, bias, eps)
    y = y * torch.sigmoid(y)        # not F.silu: the official rounding and autocast behaviour
    return y if out_dtype is None else y.to(out_dtype)


if HAS_TRITON:
    @triton.jit
    def _gn_partial_kernel(x_ptr, part_ptr, N, CHUNK, SPLIT, BLOCK: tl.constexpr):
        """(count, mean, M2) of x[row, j*CHUNK : (j+1)*CHUNK] (x as [B*groups, N] rows), blocks merged
        with Chan's formula."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        start = j.to(tl.int64) * CHUNK
        n = tl.zeros((), dtype=tl.float32)
        mean = tl.zeros((), dtype=tl.float32)
        m2 = tl.zeros((), dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK)
            mask = offs < N
            v = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
            cnt = tl.sum(mask.to(tl.float32), axis=0)
            bmean = tl.sum(v, axis=0) / tl.maximum(cnt, 1.0)
            d = tl.where(mask, v - bmean, 0.0)
            tot = n + cnt
            frac = cnt / tl.maximum(tot, 1.0)
            delta = bmean - mean
            mean += delta * frac
            m2 += tl.sum(d * d, axis=0) + delta * delta * n * frac
            n = tot
        out = part_ptr + (row * SPLIT + j) * 3
        tl.store(out, n)
        tl.store(out + 1, mean)
        tl.store(out + 2, m2)

    @triton.jit
    def _gn_stats_kernel(part_ptr, stats_ptr, SPLIT, eps, BLOCK_S: tl.constexpr):
        """Merge a group's SPLIT partials -> (mean, rstd)."""
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_S)
        m = j < SPLIT
        src = part_ptr + (row * SPLIT + j) * 3
        n = tl.load(src, mask=m, other=0.0)
        mu = tl.load(src + 1, mask=m, other=0.0)
        m2 = tl.load(src + 2, mask=m, other=0.0)
        tot = tl.sum(n, axis=0)
        mean = tl.sum(n * mu, axis=0) / tot
        d = mu - mean
        var = (tl.sum(m2, axis=0) + tl.sum(n * d * d, axis=0)) / tot
        tl.store(stats_ptr + row * 2, mean)
        tl.store(stats_ptr + row * 2 + 1, tl.math.rsqrt(var + eps))

    @triton.jit
    def _gn_swish_kernel(x_ptr, stats_ptr, w_ptr, b_ptr, out_ptr, C, S, CG, BLOCK: tl.constexpr):
        """out[row, :] = swish(x * a + shift) for one channel row (row = b*C + c), with
        a = rstd*weight[c] and shift = bias[c] - mean*a (PyTorch's fused form of the affine norm)."""
        row = tl.program_id(0).to(tl.int64)
        c = row % C
        grp = row // CG
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < S
        mean = tl.load(stats_ptr + grp * 2)
        rstd = tl.load(stats_ptr + grp * 2 + 1)
        a = rstd * tl.load(w_ptr + c).to(tl.float32)
        shift = tl.load(b_ptr + c).to(tl.float32) - mean * a
        v = tl.load(x_ptr + row * S + offs, mask=mask, other=0.0).to(tl.float32)
        y = v * a + shift
        y = y * tl.sigmoid(y)
        tl.store(out_ptr + row * S + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _fits(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, groups: int) -> bool:
    C = x.shape[1] if x.ndim >= 2 else 0
    return (x.ndim >= 3 and x.is_contiguous() and C % groups == 0 and x.numel() > 0
            and weight is not None and bias is not None and weight.shape == (C,) and bias.shape == (C,))


def _op_fits(x, weight, bias, groups: int, eps: float, out_dtype: torch.dtype | None = None) -> bool:
    """Under autocast without an output dtype the reference's own casts decide it: the reference runs."""
    return _fits(x, weight, bias, groups) and not (out_dtype is None and torch.is_autocast_enabled(x.device.type))


@backend("group_norm_swish", "triton", devices=("cuda",), dtypes=FLOATS, available=available, fits=_op_fits)
def group_norm_swish_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
                            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`group_norm_swish_ref` in three launches: chunk statistics, their merge per group, the normalise,
    for the shapes `_op_fits` takes. (Any device where Triton runs: the CPU tests call it under the
    interpreter.)"""
    return launch(x, weight, bias, groups, eps, out_dtype)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int, eps: float,
           out_dtype: torch.dtype | None = None, block: int = BLOCK, max_split: int = MAX_SPLIT) -> torch.Tensor:
    """The three kernels (block / max_split exposed so the tests reach the many-chunk merge on small
    shapes)."""
    B, C = x.shape[:2]
    S = x[0, 0].numel()
    N = (C // groups) * S                       # elements of one (batch, group): contiguous in x
    nblocks = triton.cdiv(N, block)
    iters = triton.cdiv(nblocks, max_split)
    split = triton.cdiv(nblocks, iters)
    part = torch.empty((B * groups, split, 3), dtype=torch.float32, device=x.device)
    stats = torch.empty((B * groups, 2), dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    _gn_partial_kernel[(B * groups, split)](x, part, N, iters * block, split, BLOCK=block, num_warps=8)
    _gn_stats_kernel[(B * groups,)](part, stats, split, eps, BLOCK_S=next_pow2(split), num_warps=4)
    _gn_swish_kernel[(B * C, triton.cdiv(S, block))](x, stats, weight, bias, out, C, S, C // groups,
                                                    BLOCK=block, num_warps=8)
    return out
