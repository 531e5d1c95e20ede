"""Triton kernels of the MoE fast paths and their thin launchers (the op, its reference and the
pipelines that chain these are in `cuda.py`).

Routing, shared by both paths:
  `router_logits`  fp32 logits x @ gate^T (bf16 x upcast in registers: no fp32 copy of x);
  `router_select`  softmax, top-k, renormalise; for the grouped path also the two halves of a stable
                   counting sort (per token-block expert histogram, each route's rank in its block),
                   for the decode path the compact list of the experts any token chose.
Grouped (denoise / prefill) path: `route_plan` (expert offsets + block bases, one program),
`dispatch` (each route's row in expert order, x rows copied there; `dispatch_rows`: the rows' tokens
instead, for gemm1.py's gathering GEMM1), `swiglu`, `finalize`.
Decode path: `decode_up` (gate/up GEMV + SwiGLU of the chosen experts and the shared MLP),
`decode_down` (down GEMV, micro partials summed), then the same `finalize`.

No kernel here uses atomics: every output element has one writer and every sum has a fixed order,
so results are bitwise reproducible and a token's result does not depend on the rest of its batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from .._triton import dot, next_pow2

# Triton's CPU interpreter multiplies bf16 dot operands as their raw 16-bit integers (numpy has no
# bf16), so under the interpreter the kernels upcast dot operands to fp32 first. Decided when this
# module is imported, as the interpreter itself is (`triton.jit` looks at TRITON_INTERPRET then).
INTERPRET = bool(knobs.runtime.interpret)




# ----------------------------------------------------------------------------------------- routing

@triton.jit
def _logits_kernel(x_ptr, g_ptr, out_ptr, N, H, stride_x, H_SPLIT,
                   E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                   USE_DOT: tl.constexpr, X_BF16: tl.constexpr = False, INTERPRET: tl.constexpr = False):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    re = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    mn = rn < N
    me = re < E
    acc = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
    for h0 in range(split * H_SPLIT, (split + 1) * H_SPLIT, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        mh = rh < H
        xt = tl.load(x_ptr + rn[:, None] * stride_x + rh[None, :], mask=mn[:, None] & mh[None, :], other=0.0)
        gt = tl.load(g_ptr + re[:, None] * H + rh[None, :], mask=me[:, None] & mh[None, :], other=0.0)
        if USE_DOT and X_BF16:
            # x is exact in bf16 and the fp32 gate is the exact sum of three bf16 parts (8 + 8 + 8 bits of
            # its 24-bit significand): three bf16 MMAs with fp32 accumulation give the fp32 logits up to
            # the summation order, at twice the TF32 rate and with half-size x tiles
            g1 = gt.to(tl.bfloat16)
            r1 = gt - g1.to(tl.float32)
            g2 = r1.to(tl.bfloat16)
            g3 = (r1 - g2.to(tl.float32)).to(tl.bfloat16)
            xb = xt.to(tl.bfloat16)
            acc = dot(xb, tl.trans(g3), acc, INTERPRET)
            acc = dot(xb, tl.trans(g2), acc, INTERPRET)
            acc = dot(xb, tl.trans(g1), acc, INTERPRET)
        elif USE_DOT:
            # 3xTF32 keeps fp32 accuracy at tensor-core speed (x of another dtype)
            acc = tl.dot(xt.to(tl.float32), tl.trans(gt), acc, input_precision="tf32x3")
        else:   # a few tokens (decode): a GEMV split over experts and hidden slices
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * gt[None, :, :], axis=2)
    tl.store(out_ptr + split * N * E + rn[:, None] * E + re[None, :], acc, mask=mn[:, None] & me[None, :])


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [N, H] (any float dtype), gate [E, H] fp32 -> fp32 logits [splits, N, E], to be summed over
    the splits (in order, by router_select): a few decode tokens split H over many programs, since
    one program per expert slice would wait on its loads one after another."""
    n, h = x.shape
    e = gate.shape[0]
    if n <= DECODE_ROUTER_ROWS:
        # one tile shape for every decode size (rows in programs of 4): a token's logits are then the same
        # sums in the same order whatever else is in the batch (batch invariance; a tile of next_pow2(n)
        # rows could lay the H sums out across threads differently)
        bn, be, bh, h_split = 4, 2, 256, 512
        splits = triton.cdiv(h, h_split)
        out = torch.empty(splits, n, e, dtype=torch.float32, device=x.device)
        _logits_kernel[(triton.cdiv(n, bn), triton.cdiv(e, be), splits)](
            x, gate, out, n, h, x.stride(0), h_split, E=e, BLOCK_N=bn, BLOCK_E=be, BLOCK_H=bh, USE_DOT=False,
            num_warps=4)
    else:
        # H split too, so that there are about two programs per SM: 4098 tokens make only 65 row tiles
        # (one program per tile looped over all of H: ~16 TFLOP/s, 4 ms of a DiT step)
        bn, be, bh = 64, min(64, max(16, next_pow2(e))), 64
        tiles = triton.cdiv(n, bn) * triton.cdiv(e, be)
        splits = max(1, min(MAX_LOGIT_SPLITS, triton.cdiv(2 * _sm_count(x.device), tiles), h // (4 * bh)))
        h_split = triton.cdiv(triton.cdiv(h, splits), bh) * bh
        splits = triton.cdiv(h, h_split)
        out = torch.empty(splits, n, e, dtype=torch.float32, device=x.device)
        _logits_kernel[(triton.cdiv(n, bn), triton.cdiv(e, be), splits)](x, gate, out, n, h, x.stride(0), h_split,
                                                                          E=e, BLOCK_N=bn, BLOCK_E=be, BLOCK_H=bh,
                                                                          USE_DOT=True, X_BF16=x.dtype == torch.bfloat16,
                                                                          INTERPRET=INTERPRET, num_warps=4,
                                                                          num_stages=3)
    return out


MAX_LOGIT_SPLITS = 8
DECODE_ROUTER_ROWS = 32      # the most tokens of a decode step the router takes (one select program)
_SMS: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 132          # the interpreter: the H200's count, so that CPU tests take the GPU's splits
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


@triton.jit
def _select_kernel(logits_ptr, w_ptr, ids_ptr, rank_ptr, counts_ptr, active_ptr, N, S,
                   SPLITS: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, NORM: tl.constexpr, PLAN: tl.constexpr, ACTIVE: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    re = tl.arange(0, E_PAD)
    rk = tl.arange(0, K_PAD)
    mn = rn < N
    me = re < E
    lg = tl.load(logits_ptr + rn[:, None] * E + re[None, :], mask=mn[:, None] & me[None, :], other=0.0)
    for sp in tl.static_range(1, SPLITS):
        lg += tl.load(logits_ptr + sp * N * E + rn[:, None] * E + re[None, :], mask=mn[:, None] & me[None, :],
                      other=0.0)
    lg = tl.where(me[None, :], lg, float("-inf"))
    p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    # a token whose logits are not finite (an overflowed activation) still picks k distinct real experts
    # (its probabilities read as 0): an expert id out of range would send dispatch out of bounds
    p = tl.where(p == p, p, 0.0)
    # top-k by repeated arg-max (the lowest expert id wins a tie); taken and padded columns hold -1
    cur = tl.where(me[None, :], p, -1.0)
    wk = tl.zeros((BLOCK_N, K_PAD), dtype=tl.float32)
    ik = tl.zeros((BLOCK_N, K_PAD), dtype=tl.int32)
    chosen = tl.zeros((BLOCK_N, E_PAD), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(cur, axis=1)
        e_j = tl.min(tl.where(cur == best[:, None], re[None, :], E_PAD), axis=1)
        hit = re[None, :] == e_j[:, None]
        cur = tl.where(hit, -1.0, cur)
        chosen += hit.to(tl.int32)
        wk = tl.where(rk[None, :] == j, best[:, None], wk)
        ik = tl.where(rk[None, :] == j, e_j[:, None], ik)
    if NORM:
        wk = wk / tl.maximum(tl.sum(wk, axis=1), 1e-8)[:, None]
    mk2 = mn[:, None] & (rk[None, :] < K)
    tl.store(w_ptr + rn[:, None] * K + rk[None, :], wk, mask=mk2)
    tl.store(ids_ptr + rn[:, None] * K + rk[None, :], ik, mask=mk2)
    chosen = tl.where(mn[:, None], chosen, 0)
    if PLAN:
        # counting sort, stable in (expert, token): a route's row = start of its expert + routes to
        # that expert from earlier blocks (route_plan) + from earlier tokens of this block (here)
        tl.store(counts_ptr + pid * E + re, tl.sum(chosen, axis=0), mask=me)
        before = tl.cumsum(chosen, axis=0) - chosen
        rank = tl.zeros((BLOCK_N, K_PAD), dtype=tl.int32)
        for j in tl.static_range(K):
            e_j = tl.sum(tl.where(rk[None, :] == j, ik, 0), axis=1)
            r_j = tl.sum(tl.where(re[None, :] == e_j[:, None], before, 0), axis=1)
            rank = tl.where(rk[None, :] == j, r_j[:, None], rank)
        tl.store(rank_ptr + rn[:, None] * K + rk[None, :], rank, mask=mk2)
    if ACTIVE:
        # one program holds every token: list the experts any token chose, ascending, then -1
        used = tl.max(chosen, axis=0)
        slot = tl.cumsum(used, axis=0) - used
        tl.store(active_ptr + slot, re, mask=(used > 0) & me)
        tl.store(active_ptr + re, tl.full((E_PAD,), -1, tl.int32), mask=(re >= tl.sum(used, axis=0)) & (re < S))


def router_select(logits: torch.Tensor, topk: int, norm_topk: bool, plan: bool):
    """-> (weights [N, k] fp32, ids [N, k] int32, then for plan: (rank [N, k], counts [blocks, E],
    block_tokens), else active [min(E, N*k)] int32 (decode: needs N <= DECODE_ROUTER_ROWS))."""
    splits, n, e = logits.shape
    dev = logits.device
    w = torch.empty(n, topk, dtype=torch.float32, device=dev)
    ids = torch.empty(n, topk, dtype=torch.int32, device=dev)
    meta = dict(SPLITS=splits, E=e, E_PAD=next_pow2(e), K=topk, K_PAD=max(2, next_pow2(topk)), NORM=bool(norm_topk))
    if plan:
        bn = 64
        while triton.cdiv(n, bn) > 256:       # route_plan holds every block's histogram in one tile
            bn *= 2
        nblk = triton.cdiv(n, bn)
        rank = torch.empty(n, topk, dtype=torch.int32, device=dev)
        counts = torch.empty(nblk, e, dtype=torch.int32, device=dev)
        _select_kernel[(nblk,)](logits, w, ids, rank, counts, ids, n, 0, BLOCK_N=bn, PLAN=True, ACTIVE=False,
                                num_warps=8, **meta)
        return w, ids, (rank, counts, bn)
    if n > DECODE_ROUTER_ROWS:
        raise ValueError(f"the decode router holds every token in one program (N <= {DECODE_ROUTER_ROWS}, got {n})")
    s = min(e, n * topk)
    active = torch.empty(s, dtype=torch.int32, device=dev)
    # one tile of DECODE_ROUTER_ROWS rows whatever n is: the softmax and top-k sums of a token are laid out,
    # and so rounded, the same in every batch (batch invariance)
    _select_kernel[(1,)](logits, w, ids, ids, ids, active, n, s, BLOCK_N=DECODE_ROUTER_ROWS, PLAN=False,
                         ACTIVE=True, num_warps=2, **meta)
    return w, ids, active


@triton.jit
def _plan_kernel(counts_ptr, base_ptr, offs_ptr, NBLK, E: tl.constexpr, E_PAD: tl.constexpr,
                 NB_PAD: tl.constexpr, LAYOUT: tl.constexpr):
    rb = tl.arange(0, NB_PAD)
    re = tl.arange(0, E_PAD)
    m = (rb[:, None] < NBLK) & (re[None, :] < E)
    c = tl.load(counts_ptr + rb[:, None] * E + re[None, :], mask=m, other=0)
    total = tl.sum(c, axis=0)
    ends = tl.cumsum(total, axis=0)
    tl.store(base_ptr + rb[:, None] * E + re[None, :], tl.cumsum(c, axis=0) - c + (ends - total)[None, :], mask=m)
    if LAYOUT:          # int64 [E + 1]: each expert's first row, then the end
        tl.store(offs_ptr + 1 + re, ends.to(tl.int64), mask=re < E)
        tl.store(offs_ptr + re, tl.zeros_like(ends).to(tl.int64), mask=re == 0)
    else:
        tl.store(offs_ptr + re, ends, mask=re < E)


def route_plan(counts: torch.Tensor, layout: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block expert histogram [blocks, E] -> (first row of each (block, expert) [blocks, E],
    cumulative end row of each expert [E] int32, as torch._grouped_mm takes it). `layout`: the offsets as
    int64 [E + 1] instead, each expert's first row then the end (humming's expert_layout), in the same kernel."""
    nblk, e = counts.shape
    base = torch.empty_like(counts)
    offs = torch.empty(e + 1, dtype=torch.int64, device=counts.device) if layout else \
        torch.empty(e, dtype=torch.int32, device=counts.device)
    nb_pad = max(2, next_pow2(nblk))
    _plan_kernel[(1,)](counts, base, offs, nblk, E=e, E_PAD=next_pow2(e), NB_PAD=nb_pad, LAYOUT=layout,
                       num_warps=max(4, min(16, nb_pad // 8)))
    return base, offs


@triton.jit
def _copy_row(src_ptr, dst_ptr, t, stride, H, pos, mk, BLOCK_H: tl.constexpr):
    """Token t's row of src (H wide) into rows `pos` (its routes, masked by mk) of dst."""
    rows = pos.to(tl.int64)[:, None] * H
    for h0 in range(0, H, BLOCK_H):
        rh = h0 + tl.arange(0, BLOCK_H)
        mh = rh < H
        v = tl.load(src_ptr + t * stride + rh, mask=mh)
        tl.store(dst_ptr + rows + rh[None, :], v[None, :], mask=mk[:, None] & mh[None, :])


@triton.jit
def _dispatch_kernel(x_ptr, ids_ptr, rank_ptr, base_ptr, inv_ptr, xs_ptr, H, stride_x, block_tokens,
                     y_ptr, ys_ptr, H2, stride_y,
                     E: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                     TWO: tl.constexpr, BLOCK_H2: tl.constexpr):
    t = tl.program_id(0)
    rk = tl.arange(0, K_PAD)
    mk = rk < K
    e = tl.load(ids_ptr + t * K + rk, mask=mk, other=0)
    pos = tl.load(base_ptr + (t // block_tokens) * E + e, mask=mk, other=0)
    pos += tl.load(rank_ptr + t * K + rk, mask=mk, other=0)
    tl.store(inv_ptr + t * K + rk, pos, mask=mk)
    _copy_row(x_ptr, xs_ptr, t, stride_x, H, pos, mk, BLOCK_H)
    if TWO:             # a second tensor's rows to the same places (e.g. x's FP8 codes and then their scales)
        _copy_row(y_ptr, ys_ptr, t, stride_y, H2, pos, mk, BLOCK_H2)


def dispatch(x: torch.Tensor, ids: torch.Tensor, rank: torch.Tensor, base: torch.Tensor, block_tokens: int,
             xs: torch.Tensor, y: torch.Tensor | None = None, ys: torch.Tensor | None = None) -> torch.Tensor:
    """Writes each token's row into the k rows of its routes (expert order) of xs [N*k, H] (and, given, the
    token's row of y into ys [N*k, H2], in the same launch); returns inv [N, k] int32, the row of each route."""
    n, h = x.shape
    k = ids.shape[1]
    inv = torch.empty_like(ids)
    two = y is not None
    h2 = y.shape[1] if two else 1
    _dispatch_kernel[(n,)](x, ids, rank, base, inv, xs, h, x.stride(0), block_tokens,
                           y if two else x, ys if two else xs, h2, y.stride(0) if two else 0,
                           E=base.shape[1], K=k, K_PAD=max(2, next_pow2(k)), BLOCK_H=min(1024, next_pow2(h)),
                           TWO=two, BLOCK_H2=min(1024, next_pow2(h2)), num_warps=4)
    return inv


@triton.jit
def _dispatch_rows_kernel(ids_ptr, rank_ptr, base_ptr, inv_ptr, src_ptr, N, block_tokens,
                          E: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rk = tl.arange(0, K_PAD)
    m = (rt < N)[:, None] & (rk < K)[None, :]
    at = rt[:, None] * K + rk[None, :]
    e = tl.load(ids_ptr + at, mask=m, other=0)
    pos = tl.load(base_ptr + (rt // block_tokens)[:, None] * E + e, mask=m, other=0)
    pos += tl.load(rank_ptr + at, mask=m, other=0)
    tl.store(inv_ptr + at, pos, mask=m)
    tl.store(src_ptr + pos, tl.broadcast_to(rt[:, None], (BLOCK_T, K_PAD)), mask=m)


def dispatch_rows(ids: torch.Tensor, rank: torch.Tensor, base: torch.Tensor, block_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`dispatch` without the copy: -> (inv [N, k] int32, the row of each route in expert order;
    src [N*k] int32, the token of each row, its inverse), for kernels that gather x rows themselves
    (gemm1.gemm1_swiglu). The routes are a permutation of the rows, so every src element is
    written once."""
    n, k = ids.shape
    inv = torch.empty_like(ids)
    src = torch.empty(n * k, dtype=torch.int32, device=ids.device)
    bt = 64
    if n:
        _dispatch_rows_kernel[(triton.cdiv(n, bt),)](ids, rank, base, inv, src, n, block_tokens, E=base.shape[1], K=k,
                                                     K_PAD=max(2, next_pow2(k)), BLOCK_T=bt, num_warps=4)
    return inv, src


# ---------------------------------------------------------------------------------- grouped path

@triton.jit
def _swiglu_kernel(h_ptr, out_ptr, I, stride_h, stride_o, BLOCK_I: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    ri = tl.program_id(2) * BLOCK_I + tl.arange(0, BLOCK_I)
    mi = ri < I
    src = h_ptr + r * stride_h + g * 2 * I
    a = tl.load(src + ri, mask=mi, other=0.0).to(tl.float32)
    b = tl.load(src + I + ri, mask=mi, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + g * I + ri, (a * (b * tl.sigmoid(b))).to(out_ptr.dtype.element_ty), mask=mi)


def swiglu(h: torch.Tensor, groups: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """[R, groups*2I] -> [R, groups*I]: per group, first half linear times SiLU of the second half.
    `out` may be given: any [R, groups*I] view with unit column stride (a micro's column block of the
    grouped path's activation buffer [R, micros*I]: written in place, no copy)."""
    r, width = h.shape
    i = width // (2 * groups)
    if out is None:
        out = torch.empty(r, groups * i, dtype=h.dtype, device=h.device)
    elif tuple(out.shape) != (r, groups * i) or (r and out.stride(1) != 1) or h.stride(1) != 1:
        raise ValueError(f"swiglu: out {tuple(out.shape)} / {out.stride()} for h {tuple(h.shape)} / {h.stride()}")
    bi = min(2048, next_pow2(i))
    if r:
        _swiglu_kernel[(r, groups, triton.cdiv(i, bi))](h, out, i, h.stride(0), out.stride(0), BLOCK_I=bi,
                                                       num_warps=4)
    return out


@triton.jit
def _finalize_kernel(p_ptr, inv_ptr, w_ptr, add_ptr, out_ptr, H,
                     K: tl.constexpr, K_PAD: tl.constexpr, HAS_ADD: tl.constexpr, IDENTITY: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = rh < H
    rk = tl.arange(0, K_PAD)
    mk = rk < K
    if IDENTITY:
        rows = t * K + rk
    else:
        rows = tl.load(inv_ptr + t * K + rk, mask=mk, other=0)
    wt = tl.load(w_ptr + t * K + rk, mask=mk, other=0.0)
    offs = rows.to(tl.int64)[:, None] * H + rh[None, :]
    # each route's row (its micros already summed by the down GEMM) times its weight, the k routes
    # summed in fp32
    y = tl.load(p_ptr + offs, mask=mk[:, None] & mh[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(y * wt[:, None], axis=0)
    if HAS_ADD:
        acc += tl.load(add_ptr + t.to(tl.int64) * H + rh, mask=mh, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + rh, acc.to(out_ptr.dtype.element_ty), mask=mh)


def finalize(partial: torch.Tensor, inv: torch.Tensor | None, w: torch.Tensor, add: torch.Tensor | None,
             out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * partial[row(t, j)] + add[t], in fp32, cast once.
    row(t, j) = inv[t, j], or t*k + j when inv is None (the partial already in route order)."""
    n, k = w.shape
    h = out.shape[1]
    bh = min(1024 if n >= 256 else 256, next_pow2(h))     # a few tokens: more programs
    if n:
        _finalize_kernel[(n, triton.cdiv(h, bh))](partial, inv if inv is not None else w, w,
                                                  add if add is not None else out, out, h, K=k,
                                                  K_PAD=max(2, next_pow2(k)), HAS_ADD=add is not None,
                                                  IDENTITY=inv is None, BLOCK_H=bh, num_warps=4)
    return out


# ----------------------------------------------------------------------------------- decode path

@triton.jit
def _decode_up_kernel(x_ptr, ids_ptr, active_ptr, w1_ptr, sw1_ptr, act_ptr, N, H, I, stride_x,
                      w1_sm, w1_se, sw1_sm, S, SLOTS, ROWS,
                      K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                      BLOCK_H: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    m = pid // SLOTS
    slot = pid % SLOTS
    rk = tl.arange(0, K_PAD)
    routed = slot < S                # a routed expert (its tokens: those that chose it), else the shared MLP
    e = tl.load(active_ptr + slot, mask=routed, other=-1)
    if routed:
        base = w1_ptr + m.to(tl.int64) * w1_sm + tl.maximum(e, 0).to(tl.int64) * w1_se
    else:
        base = sw1_ptr + m.to(tl.int64) * sw1_sm
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mi = ri < I
    # tokens in chunks of BLOCK_N: token t is row t % BLOCK_N of chunk t // BLOCK_N whatever N is, so its
    # sums (one tile shape, rows independent in the MMA) do not depend on the rest of the batch
    for t0 in range(0, N, BLOCK_N):
        rn = t0 + tl.arange(0, BLOCK_N)
        mn = rn < N
        ids = tl.load(ids_ptr + rn[:, None] * K + rk[None, :], mask=mn[:, None] & (rk[None, :] < K) & routed,
                      other=-1)
        sel = tl.where(routed, (tl.max((ids == e).to(tl.int32), axis=1) > 0) & (e >= 0), True) & mn
        if tl.max(sel.to(tl.int32), axis=0) > 0:    # a slot past the chosen experts reads no weight
            acc1 = tl.zeros((BLOCK_N, BLOCK_I), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_N, BLOCK_I), dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                rh = h0 + tl.arange(0, BLOCK_H)
                mh = rh < H
                xt = tl.load(x_ptr + rn[:, None] * stride_x + rh[None, :], mask=mn[:, None] & mh[None, :], other=0.0)
                wa = tl.load(base + ri[:, None] * H + rh[None, :], mask=mi[:, None] & mh[None, :], other=0.0)
                wb = tl.load(base + (ri + I)[:, None] * H + rh[None, :], mask=mi[:, None] & mh[None, :], other=0.0)
                acc1 = dot(xt, tl.trans(wa), acc1, UPCAST)
                acc2 = dot(xt, tl.trans(wb), acc2, UPCAST)
            act = acc1 * (acc2 * tl.sigmoid(acc2))
            dst = act_ptr + (pid.to(tl.int64) * ROWS + rn)[:, None] * I + ri[None, :]
            tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=sel[:, None] & mi[None, :])


@triton.jit
def _decode_down_kernel(act_ptr, ids_ptr, active_ptr, w2_ptr, sw2_ptr, y_ptr, ys_ptr, N, H, I,
                        w2_se, w2_sh, sw2_sh, S, SLOTS, MC, ROWS,
                        K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HO: tl.constexpr,
                        BLOCK_I: tl.constexpr, UPCAST: tl.constexpr):
    slot = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_HO + tl.arange(0, BLOCK_HO)
    mh = rh < H
    rk = tl.arange(0, K_PAD)
    routed = slot < S                # routed: y's (token, top-k slot) rows of the tokens that chose e; else ys
    e = tl.load(active_ptr + slot, mask=routed, other=-1)
    if routed:
        base = w2_ptr + tl.maximum(e, 0).to(tl.int64) * w2_se
        sh = w2_sh
    else:
        base = sw2_ptr
        sh = sw2_sh
    for t0 in range(0, N, BLOCK_N):  # token chunks, as in the up kernel
        rn = t0 + tl.arange(0, BLOCK_N)
        mn = rn < N
        ids = tl.load(ids_ptr + rn[:, None] * K + rk[None, :], mask=mn[:, None] & (rk[None, :] < K) & routed,
                      other=-1)
        hit = (ids == e) & (e >= 0)
        sel = tl.where(routed, tl.max(hit.to(tl.int32), axis=1) > 0, True) & mn
        j = tl.sum(tl.where(hit, rk[None, :], 0), axis=1)
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            acc = tl.zeros((BLOCK_N, BLOCK_HO), dtype=tl.float32)
            for m in range(MC):     # micro partials summed here, before the route weight
                src = act_ptr + ((m * SLOTS + slot).to(tl.int64) * ROWS + rn)[:, None] * I
                wm = base + I * m   # both packs are cols-packed: micro m's columns start at m * I
                for i0 in range(0, I, BLOCK_I):
                    ri = i0 + tl.arange(0, BLOCK_I)
                    mi = ri < I
                    a = tl.load(src + ri[None, :], mask=sel[:, None] & mi[None, :], other=0.0)
                    wt = tl.load(wm + rh[:, None] * sh + ri[None, :], mask=mh[:, None] & mi[None, :], other=0.0)
                    acc = dot(a, tl.trans(wt), acc, UPCAST)
            if routed:
                dst = y_ptr + (rn * K + j).to(tl.int64)[:, None] * H + rh[None, :]
            else:
                dst = ys_ptr + rn.to(tl.int64)[:, None] * H + rh[None, :]
            tl.store(dst, acc, mask=sel[:, None] & mh[None, :])


# tile sizes of the decode kernels (`python -m bench kernels-moe --tune` sweeps them)
DECODE_BLOCK_N = 16                 # token rows of one decode MMA (tl.dot's minimum); more tokens: more chunks
DECODE_UP = dict(BLOCK_I=16, BLOCK_H=128, num_warps=4, num_stages=4)
DECODE_DOWN = dict(BLOCK_HO=32, BLOCK_I=128, num_warps=4, num_stages=4)


def decode_up(x, ids, active, w1, sw1, act, slots: int, inter: int, up=None) -> None:
    """Gate/up GEMV + SwiGLU of every (micro, slot): slots < len(active) are routed experts (w1 =
    [micros, E, 2I, H] of the active micros), the slot == len(active) is the shared MLP (sw1 =
    [micros, 2I, H]). act [micros, slots, rows >= N, I] receives the rows of the
    tokens each slot serves (row t for token t)."""
    cfg = dict(DECODE_UP, **(up or {}))
    n, h = x.shape
    mc = act.shape[0]
    s = active.shape[0] if active is not None else 0
    w1_sm, w1_se = (w1.stride(0), w1.stride(1)) if w1 is not None else (0, 0)
    sw1_sm = sw1.stride(0) if sw1 is not None else 0
    if act.shape[2] < n:
        raise ValueError(f"decode_up: act has {act.shape[2]} rows a slot for {n} tokens")
    grid = (mc * slots, triton.cdiv(inter, cfg["BLOCK_I"]))
    _decode_up_kernel[grid](x, ids, active if active is not None else ids, w1 if w1 is not None else sw1,
                            sw1 if sw1 is not None else w1, act, n, h, inter, x.stride(0), w1_sm, w1_se, sw1_sm,
                            s, slots, act.shape[2], K=ids.shape[1], K_PAD=max(2, next_pow2(ids.shape[1])),
                            BLOCK_N=DECODE_BLOCK_N, UPCAST=INTERPRET, **cfg)


def decode_down(act, ids, active, w2, sw2, y, ys, slots: int, inter: int, down=None) -> None:
    """Down GEMV of every slot, micro partials summed: routed slots write y [N*k, H] fp32 at row
    t*k + j of each token t that chose the slot's expert as its j-th; the shared slot writes ys [N, H].
    Both packs are read from the first active micro's columns: w2 = expert_w2[:, :, micro_start*I:]
    ([E, H, ·]), sw2 = shared_w2[:, micro_start*I:] ([H, ·]); micro m is then at column m*I. The
    columns must be contiguous (views of the resident packs are)."""
    cfg = dict(DECODE_DOWN, **(down or {}))
    mc, _, bn, _ = act.shape
    n, k = ids.shape
    h = (y if y is not None else ys).shape[1]
    s = active.shape[0] if active is not None else 0
    for w, cols in ((w2, 3), (sw2, 2)):
        if w is not None and (w.dim() != cols or w.stride(-1) != 1 or w.shape[-1] < mc * inter):
            raise ValueError(f"decode_down: a down pack view {tuple(w.shape)} / {w.stride()} for {mc} micros of {inter}")
    w2_se, w2_sh = (w2.stride(0), w2.stride(1)) if w2 is not None else (0, 0)
    sw2_sh = sw2.stride(0) if sw2 is not None else 0
    grid = (slots, triton.cdiv(h, cfg["BLOCK_HO"]))
    _decode_down_kernel[grid](act, ids, active if active is not None else ids, w2 if w2 is not None else sw2,
                              sw2 if sw2 is not None else w2, y if y is not None else ys,
                              ys if ys is not None else y, n, h, inter, w2_se, w2_sh, sw2_sh, s, slots, mc, bn,
                              K=k, K_PAD=max(2, next_pow2(k)), BLOCK_N=DECODE_BLOCK_N, UPCAST=INTERPRET, **cfg)
