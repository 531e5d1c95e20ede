"""The `lora_add` op: a projection's output plus each row's LoRA update, in place.

    lora_add(out [B, T, N], x [B, T, K], a [S, R, K], b [S, N, R], slot [B] or [1] int64,
             strength [B] or [1]) -> out, with out[i] += strength[i] * (x[i] A[slot[i]]^T) B[slot[i]]^T

The tables hold every adapter slot (engine/model/lora.py; slot 0 zeros, the adapter's scale folded into
B); a [1] slot or strength is every row's. a and b may be strided views (a phase's micros of a packed
table) as long as their last dimension is unit-stride.

reference  two products per call: with one slot for every row and a contiguous `out`, A and B taken once
           and 2-D GEMMs over all the rows' tokens, the second accumulating into `out` (addmm_); else
           each row's A and B gathered and batched GEMMs (baddbmm_). u = x A^T is rounded to the dtype,
           scaled by the strength and rounded again, then out + u B^T is rounded once.
triton     a decode step's few rows (B * T <= 64): two launches, shrink (u = strength * x A[slot]^T per
           token row and 4 ranks a program, rounded as the reference rounds it, kept in fp32) then expand
           (out += u B[slot]^T per token row and 128 outputs a program), against the reference's five (two
           gathers, two GEMMs, a scale), which were what an adapter cost a decode step (+21% at 8 rows on
           an H200, 2026-12-03). One launch recomputing u in every output program measured worse (+50%): a
           program walking K alone waits on each load in turn. A row's result depends on its own data only
           (fixed sum orders, no atomics).
"""
from __future__ import annotations

import torch

from ._triton import FLOATS, HAS_TRITON, available, next_pow2, tl, triton
from .registry import backend, reference
from .scratch import empty as _empty

TRITON_MAX_ROWS = 64      # token rows (B * T) the Triton variant takes: decode steps
TRITON_MAX_RANK = 128


@reference("lora_add")
def lora_add_ref(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
                 strength: torch.Tensor) -> torch.Tensor:
    if slot.shape[0] == 1 and out.is_contiguous():      # every row one adapter: 2-D products over all tokens
        u = torch.matmul(x, a.index_select(0, slot)[0].t())
        u.mul_(strength.view(-1, 1, 1))
        out.view(-1, out.shape[-1]).addmm_(u.view(-1, u.shape[-1]), b.index_select(0, slot)[0].t())
        return out
    # each row its own ([B, R, K], [B, N, R]; a [1] slot broadcasts over the rows): batched matmuls
    u = torch.matmul(x, a.index_select(0, slot).transpose(1, 2))
    u.mul_(strength.view(-1, 1, 1))
    out.baddbmm_(u, b.index_select(0, slot).transpose(1, 2).expand(out.shape[0], -1, -1))
    return out


if HAS_TRITON:
    @triton.jit
    def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, st_ptr, u_ptr, T, K, R, s_x, s_as, s_ar, slot_step, st_step,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """u[m, r-block] = strength * (x[m] A[slot]^T), rounded as the reference rounds it, stored in fp32."""
        m = tl.program_id(0).to(tl.int64)               # token row b * T + t
        row = m // T
        s = tl.load(slot_ptr + row * slot_step)
        st = tl.load(st_ptr + row * st_step).to(tl.float32)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = tl.load(x_ptr + m * s_x + k, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + s * s_as + r[:, None] * s_ar + k[None, :], mask=rmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)
            acc += av * xv[None, :]
        dt = x_ptr.dtype.element_ty
        u = tl.sum(acc, axis=1).to(dt).to(tl.float32)                 # x A^T in the dtype, as the reference's GEMM
        u = (u * st.to(dt).to(tl.float32)).to(dt).to(tl.float32)      # ... scaled in the dtype
        tl.store(u_ptr + m * R + r, u, mask=rmask)

    @triton.jit
    def _lora_expand_kernel(out_ptr, u_ptr, b_ptr, slot_ptr, T, N, R, s_out, s_bs, s_bn, slot_step,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """out[m, n-block] += u[m] B[slot]^T, summed in fp32 and rounded once."""
        m = tl.program_id(0).to(tl.int64)
        s = tl.load(slot_ptr + (m // T) * slot_step)
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        u = tl.load(u_ptr + m * R + r, mask=rmask, other=0.0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        bv = tl.load(b_ptr + s * s_bs + n[:, None] * s_bn + r[None, :], mask=nmask[:, None] & rmask[None, :],
                     other=0.0).to(tl.float32)
        o = tl.load(out_ptr + m * s_out + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * s_out + n, (o + tl.sum(bv * u[None, :], axis=1)).to(out_ptr.dtype.element_ty),
                 mask=nmask)


def _fits(out, x, a, b, slot, strength) -> bool:
    rows = out.shape[0] * out.shape[1]
    return (out.dim() == 3 and out.is_contiguous() and rows <= TRITON_MAX_ROWS and a.shape[1] <= TRITON_MAX_RANK
            and a.stride(-1) == 1 and b.stride(-1) == 1 and x.dtype == out.dtype == a.dtype == b.dtype
            and x.shape[:2] == out.shape[:2] and x.reshape(rows, -1).stride(-1) == 1)


SHRINK_R, SHRINK_K, EXPAND_N = 4, 1024, 128    # u: 4 ranks a program over K in 1024s; B: 128 output rows a program


@backend("lora_add", "triton", devices=("cuda",), dtypes=FLOATS, available=available, fits=_fits)
def lora_add_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor,
                    strength: torch.Tensor) -> torch.Tensor:
    bsz, t, n = out.shape
    k, r = x.shape[-1], a.shape[1]
    rows = bsz * t
    if rows == 0:
        return out
    x2 = x.reshape(rows, k)
    u = _empty(rows, r, dtype=torch.float32, device=out.device)
    slot_step = 0 if slot.shape[0] == 1 else 1
    _lora_shrink_kernel[(rows, triton.cdiv(r, SHRINK_R))](
        x2, a, slot, strength, u, t, k, r, x2.stride(0), a.stride(0), a.stride(1), slot_step,
        0 if strength.shape[0] == 1 else 1, BLOCK_R=SHRINK_R, BLOCK_K=SHRINK_K, num_warps=4)
    _lora_expand_kernel[(rows, triton.cdiv(n, EXPAND_N))](
        out, u, b, slot, t, n, r, n, b.stride(0), b.stride(1), slot_step,
        BLOCK_R=max(16, next_pow2(r)), BLOCK_N=EXPAND_N, num_warps=4)
    return out
