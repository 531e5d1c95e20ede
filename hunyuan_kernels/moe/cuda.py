"""The CUDA pipelines of the `moe` op (definition and reference: `reference.py`), built from the Triton
kernels of `triton_kernels.py` and `gemm1.py` and `torch._grouped_mm`. Each is a variant of the op in the
registry, preferred in this order (the order they are registered below):

  decode (N <= DECODE_MAX_TOKENS, 32): reads only the chosen experts' weights of the active micros; five
      launches, no host sync, no data-dependent allocation: CUDA-graph capturable; batch invariant (a
      token's output is bitwise the same alone or with up to 31 others).
  fused (denoise, prefill): one routing pass for every micro, a stable counting sort on the device that
      gives each route its row in expert order (no x rows copied), ONE kernel (gemm1.py) doing every
      active micro's GEMM1 + SwiGLU on the x rows it gathers itself into its column block of one
      activation buffer [R, micro_count * I], then ONE grouped down GEMM over K = micro_count * I on the
      active micros' columns of the cols-packed w2 [E, H, micros * I] (a strided view, no weight copy),
      the shared MLP, then ONE finalize (one partial) that sums the routes per token in fp32. On the
      H200 1.33 vs 1.51 ms a hybrid4 denoise layer against `grouped` (bench gemm1 suite, 2026-12-01).
  grouped (shapes the fused GEMM1 does not take): the same with dispatch copying the x rows into xs,
      then per micro torch._grouped_mm -> [R, 2I] and SwiGLU into act's column block.

Which one runs depends on N and the packs' shapes (host-known), never on data.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import backend
from ..scratch import empty as _empty
from . import gemm1
from . import triton_kernels as tk
from .reference import check_packs

# a decode step's rows (the serving runtime batches up to 32): the decode kernels take the tokens in chunks of
# 16 at fixed rows and the router one tile for every N, so each token's output is the same in any batch
DECODE_MAX_TOKENS = tk.DECODE_ROUTER_ROWS


def available() -> bool:
    """A GPU and torch._grouped_mm (this module is imported only where Triton is)."""
    return torch.cuda.is_available() and hasattr(torch, "_grouped_mm")


def _check(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk):
    check_packs("moe", x, gate, w1.shape, w2.shape, micro_start, micro_count, topk)
    h, micros = x.shape[1], w1.shape[0]
    if not (w1.is_contiguous() and w2.is_contiguous() and gate.is_contiguous()):
        raise ValueError("moe: the expert packs and the gate must be contiguous")
    if (shared_w1 is None) != (shared_w2 is None):
        raise ValueError("moe: shared_w1 and shared_w2 come together")
    if shared_w1 is not None and (shared_w1.shape[0] != micros or shared_w1.shape[2] != h
                                  or shared_w2.shape != (h, micros * (shared_w1.shape[1] // 2))):
        raise ValueError(f"moe: shared MLP shapes {tuple(shared_w1.shape)}, {tuple(shared_w2.shape)}")


def _prepared(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, out):
    x = x.contiguous()
    _check(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk)
    return x, torch.empty_like(x) if out is None else out


def decode_fits(x, *args, **kwargs) -> bool:
    return x.shape[0] <= DECODE_MAX_TOKENS


def fused_fits(x, gate, w1, *args, **kwargs) -> bool:
    return gemm1.fits(x, w1)


@backend("moe", "decode", dtypes=(torch.bfloat16,), available=available, fits=decode_fits)
def moe_decode(x, gate, w1, w2, shared_w1, shared_w2, micro_start: int, micro_count: int, topk: int,
               norm_topk: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `decode` variant (signature: `reference.moe_reference`; `out` [N, H] x.dtype may be given)."""
    x, out = _prepared(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, out)
    if x.shape[0] == 0:
        return out
    return _decode(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)


def grouped(x, gate, w1, w2, shared_w1, shared_w2, micro_start: int, micro_count: int, topk: int,
            norm_topk: bool, out: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """The grouped path: GEMM1 + SwiGLU in one kernel (`fused`) or on torch._grouped_mm."""
    x, out = _prepared(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, out)
    if x.shape[0] == 0:
        return out
    shared = shared_mlp(x, shared_w1, shared_w2, micro_start, micro_count) if shared_w1 is not None else None
    if fused:
        w, inv, src, offs = _permute_rows(x, gate, topk, norm_topk)
        return tk.finalize(_expert_mlp_fused(x, src, w1, w2, offs, micro_start, micro_count), inv, w, shared, out)
    w, inv, xs, offs = permute(x, gate, topk, norm_topk)
    return tk.finalize(expert_mlp(xs, w1, w2, offs, micro_start, micro_count), inv, w, shared, out)


@backend("moe", "fused", dtypes=(torch.bfloat16,), available=available, fits=fused_fits)
def moe_fused(*args, **kwargs) -> torch.Tensor:
    return grouped(*args, **kwargs, fused=True)


@backend("moe", "grouped", dtypes=(torch.bfloat16,), available=available)
def moe_grouped(*args, **kwargs) -> torch.Tensor:
    return grouped(*args, **kwargs)


# ---------------------------------------------------------------------------------- grouped path

def shared_mlp(x, shared_w1, shared_w2, micro_start: int, micro_count: int) -> torch.Tensor:
    """The ungated shared MLP over the active micros, [N, H] in x.dtype."""
    n, h = x.shape
    is_micro = shared_w1.shape[1] // 2
    s1 = shared_w1[micro_start:micro_start + micro_count].reshape(-1, h)     # a view: micros are contiguous
    act = tk.swiglu(F.linear(x, s1), groups=micro_count)
    return F.linear(act, shared_w2[:, micro_start * is_micro:(micro_start + micro_count) * is_micro])


def _plan(x, gate, topk, norm_topk, layout: bool = False):
    """Routing and the expert-order plan of the grouped paths: weights, ids, each route's rank in its
    expert, the plan's bases and end offsets (`layout`: as humming's int64 expert layout, tk.route_plan), and
    the tokens per counting block."""
    w, ids, (rank, counts, block_tokens) = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=True)
    base, offs = tk.route_plan(counts, layout)
    return w, ids, rank, base, offs, block_tokens


def permute(x, gate, topk, norm_topk):
    """One routing pass: weights, the row of every route in expert order (inv), the permuted rows
    of x, and the expert end offsets for torch._grouped_mm."""
    w, inv, (xs,), offs = permute_rows(x, gate, topk, norm_topk, x)
    return w, inv, xs, offs


def permute_rows(x, gate, topk, norm_topk, *rows: torch.Tensor, outs: tuple | None = None, layout: bool = False):
    """`permute` routing on x but permuting `rows` (one or two tensors of x's N rows; bits copied: any dtype),
    e.g. x's FP8 codes and per-row scales, quantized once a token instead of once a route, in one launch: ->
    (weights, inv, the permuted rows of each, offsets). `outs`: where to write each ([N*k, ·] of its dtype;
    None: made here); `layout`: the offsets as humming's int64 expert layout [E + 1] (tk.route_plan)."""
    if not 1 <= len(rows) <= 2:
        raise ValueError(f"permute_rows moves one or two row tensors in its launch, not {len(rows)}")
    n = x.shape[0]
    w, ids, rank, base, offs, block_tokens = _plan(x, gate, topk, norm_topk, layout)
    out = [outs[i] if outs is not None and outs[i] is not None else
           _empty(n * topk, r.shape[1], dtype=r.dtype, device=r.device) for i, r in enumerate(rows)]
    second = (_bits(rows[1]), _bits(out[1])) if len(rows) == 2 else (None, None)
    inv = tk.dispatch(_bits(rows[0]), ids, rank, base, block_tokens, _bits(out[0]), *second)
    return w, inv, tuple(out), offs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as the integers that carry its bits (a row copy moves bits, whatever they mean); 2-byte
    floats as they are (the dispatch kernel copies bf16 / fp16 rows)."""
    return t.view(_BITS[t.element_size()]) if t.dtype.is_floating_point and t.element_size() != 2 else t


# the integer dtype whose elements carry another dtype's bits
_BITS = {1: torch.uint8, 4: torch.int32, 8: torch.int64}


def _permute_rows(x, gate, topk, norm_topk):
    """`permute` for the fused GEMM1: the token of each permuted row (src [N*k] int32) instead of the
    rows themselves."""
    w, ids, rank, base, offs, block_tokens = _plan(x, gate, topk, norm_topk)
    inv, src = tk.dispatch_rows(ids, rank, base, block_tokens)
    return w, inv, src, offs


def _down_cols(w2: torch.Tensor, micro_start: int, micro_count: int, inter: int) -> torch.Tensor:
    """The active micros' down weights as torch._grouped_mm's [E, K, H] operand: the column block
    w2[:, :, ms*I:(ms+mc)*I] transposed, a view (strides (H*micros*I, 1, micros*I): the column-major
    operand cuBLAS / CUTLASS take with its leading dimension micros*I; its start must be 16-byte
    aligned, true when I * element size is a multiple of 16, as every real shape is)."""
    return w2[:, :, micro_start * inter:(micro_start + micro_count) * inter].transpose(1, 2)


def expert_mlp(xs, w1, w2, offs, micro_start: int, micro_count: int) -> torch.Tensor:
    """Micros [micro_start, +micro_count) of every expert on the permuted rows, [R, H] x.dtype: GEMM1 +
    SwiGLU per micro into its column block of one activation buffer, then one GEMM2 over all of them."""
    inter = w1.shape[2] // 2
    act = _empty(xs.shape[0], micro_count * inter, dtype=xs.dtype, device=xs.device)
    for i in range(micro_count):
        hmid = torch._grouped_mm(xs, w1[micro_start + i].transpose(1, 2), offs=offs)
        tk.swiglu(hmid, out=act[:, i * inter:(i + 1) * inter])
    return torch._grouped_mm(act, _down_cols(w2, micro_start, micro_count, inter), offs=offs)


def _expert_mlp_fused(x, src, w1, w2, offs, micro_start: int, micro_count: int) -> torch.Tensor:
    """`expert_mlp` with GEMM1 + SwiGLU of every micro in one kernel reading x[src] directly."""
    inter = w1.shape[2] // 2
    act = _empty(src.shape[0], micro_count * inter, dtype=x.dtype, device=x.device)
    gemm1.gemm1_swiglu(x, src, offs, w1, micro_start, micro_count, act)
    return torch._grouped_mm(act, _down_cols(w2, micro_start, micro_count, inter), offs=offs)


# ----------------------------------------------------------------------------------- decode path

def _decode(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
            out) -> torch.Tensor:
    n, h = x.shape
    inter = w1.shape[2] // 2
    mc = micro_count
    dev = x.device
    w, ids, active = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=False)
    s = active.shape[0]
    bn = n                                            # act rows of a slot: row t for token t
    w1a = w1[micro_start:micro_start + mc]
    w2a = w2[:, :, micro_start * inter:]              # micro m of the active ones at column m * I
    y = _empty(n * topk, h, dtype=torch.float32, device=dev)
    ys = None
    if shared_w1 is None:
        act = _empty(mc, s, bn, inter, dtype=x.dtype, device=dev)
        tk.decode_up(x, ids, active, w1a, None, act, s, inter)
        tk.decode_down(act, ids, active, w2a, None, y, None, s, inter)
    else:
        is_micro = shared_w1.shape[1] // 2
        sw1 = shared_w1[micro_start:micro_start + mc]
        sw2 = shared_w2[:, micro_start * is_micro:]
        ys = _empty(n, h, dtype=torch.float32, device=dev)
        if is_micro == inter:                         # the shared MLP rides along as one more slot
            act = _empty(mc, s + 1, bn, inter, dtype=x.dtype, device=dev)
            tk.decode_up(x, ids, active, w1a, sw1, act, s + 1, inter)
            tk.decode_down(act, ids, active, w2a, sw2, y, ys, s + 1, inter)
        else:
            act = _empty(mc, s, bn, inter, dtype=x.dtype, device=dev)
            act_s = _empty(mc, 1, bn, is_micro, dtype=x.dtype, device=dev)
            tk.decode_up(x, ids, active, w1a, None, act, s, inter)
            tk.decode_up(x, ids, None, None, sw1, act_s, 1, is_micro)
            tk.decode_down(act, ids, active, w2a, None, y, None, s, inter)
            tk.decode_down(act_s, ids, None, None, sw2, None, ys, 1, is_micro)
    return tk.finalize(y, None, w, ys, out)
