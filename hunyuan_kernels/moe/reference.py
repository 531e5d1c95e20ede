"""The `moe` op: the whole routed + shared mixture-of-experts block of one rank, on raw tensors.

    moe(x [N, H], gate [E, H] fp32, w1 [micros, E, 2*I, H], w2 [E, H, micros*I],
        shared_w1 [micros, 2*Is, H] | None, shared_w2 [H, micros*Is] | None,
        micro_start, micro_count, topk, norm_topk) -> [N, H] in x.dtype

The weights are the engine's resident packs (engine/model/moe.py): gate/up micro-major, the down
packs cols-packed (micro m of expert e = w2[e, :, m*I:(m+1)*I]); the op uses micros
[micro_start, micro_start + micro_count): one in AR, every micro of the storage shard in denoise.

  router   fp32 softmax over F.linear(x.float(), gate), top-k, renormalised (clamp_min 1e-8) when
           norm_topk;
  experts  per route (token t, expert e): the SwiGLU activations of every active micro side by side,
           a_m = swiglu(x_t @ w1[m, e]^T), swiglu(h) = h[:, :I] * silu(h[:, I:]) (first half linear,
           second half through SiLU), then ONE down GEMM y = [a_ms .. a_ms+mc-1] @ w2[e, :, active
           micro columns]^T over K = micro_count * I: the micro partials are summed in its fp32
           accumulation, BEFORE the route weight is applied;
  finalize the k routes of each token gathered and summed in fp32 with their weights, then the
           shared MLP (same SwiGLU per micro, then @ shared_w2[:, active micro columns]^T) added,
           cast to x.dtype once. No atomics: the result is bitwise reproducible, and each token's
           result does not depend on which other tokens share its batch.

The result is this rank's partial sum; the caller all-reduces over the active TP group.
The reference is this file (every device; the CPU path); the CUDA variants are `cuda.py`'s, declared in
`__init__.py`.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..registry import reference


def route(x: torch.Tensor, gate: torch.Tensor, topk: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (weights [N, k] fp32, expert ids [N, k]), top-k in descending weight."""
    probs = F.linear(x.float(), gate).softmax(dim=-1)
    w, idx = probs.topk(topk, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-8)
    return w, idx


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group times w[g] ([G, K, N]); offs = int32 cumulative end rows per group.
    `torch._grouped_mm` is not on autocast's cast lists, so under autocast (training) its operands are
    cast here to the autocast dtype, as autocast casts a matmul's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dt = torch.get_autocast_dtype(kind)
        x, w = x.to(dt), w.to(dt)
    return torch._grouped_mm(x, w, offs=offs)


def swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: first half linear, second half through SiLU (the official convention)."""
    x1, x2 = h.chunk(2, dim=-1)
    return x1 * F.silu(x2)


def shared_mlp_reference(x, shared_w1, shared_w2, micro_start: int, micro_count: int) -> torch.Tensor:
    n, hidden = x.shape
    is_micro = shared_w1.shape[1] // 2
    s1 = shared_w1[micro_start:micro_start + micro_count].reshape(-1, hidden)
    act = swiglu_halves(F.linear(x, s1).view(n, micro_count, 2 * is_micro)).reshape(n, -1)
    return F.linear(act, shared_w2[:, micro_start * is_micro:(micro_start + micro_count) * is_micro])


def group_ends(key: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 cumulative end row of each group for rows sorted by `key` (torch._grouped_mm's offs), without a
    host sync (bincount would read the max back)."""
    counts = torch.zeros(groups, dtype=torch.int32, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return counts.cumsum(0, dtype=torch.int32)


def finalize_routes(partial: torch.Tensor, order: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[N, H] fp32: the routes' rows (in `order`, the sorted routes) back through the inverse permutation, the
    k routes of each token weighted by w [N, k] and summed in fp32."""
    n, topk = w.shape
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return (partial.float()[inv.view(n, topk)] * w.unsqueeze(-1)).sum(dim=1)


def routed_reference(x: torch.Tensor, gate: torch.Tensor, topk: int, norm_topk: bool,
                     expert_mlp: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The routed part of the op in fp32 [N, H]: routing, the rows grouped by expert, `expert_mlp(xs,
    offs)` on them (the whole routed row of every active micro: GEMM1 + SwiGLU per micro, one GEMM2 over
    all of them), then the weighted finalize. Shared by the bf16 and the quantized references
    (quant/moe.py)."""
    w, idx = route(x, gate, topk, norm_topk)
    flat = idx.reshape(-1)                                  # route r = t*k + j
    order = flat.argsort(stable=True)                       # rows grouped by expert, token order inside
    xs = x.index_select(0, order // topk)
    return finalize_routes(expert_mlp(xs, group_ends(flat, gate.shape[0])), order, w)


def check_packs(op: str, x, gate, w1_shape, w2_shape, micro_start: int, micro_count: int, topk: int) -> None:
    """The expert packs' shapes against x and the gate, the micro range and top-k (the `moe` and
    `moe_quant` ops' common checks)."""
    n, h = x.shape
    micros, e, two_i, h1 = w1_shape
    if tuple(gate.shape) != (e, h) or h1 != h or tuple(w2_shape) != (e, h, micros * (two_i // 2)):
        raise ValueError(f"{op}: shapes x {tuple(x.shape)}, gate {tuple(gate.shape)}, w1 {tuple(w1_shape)}, "
                         f"w2 {tuple(w2_shape)} do not fit together")
    if not (0 <= micro_start and micro_count >= 1 and micro_start + micro_count <= micros):
        raise ValueError(f"{op}: micros [{micro_start}, {micro_start + micro_count}) outside 0..{micros}")
    if not 1 <= topk <= e:
        raise ValueError(f"{op}: top-k {topk} with {e} experts")


@reference("moe")
def moe_reference(x: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  shared_w1: torch.Tensor | None, shared_w2: torch.Tensor | None,
                  micro_start: int, micro_count: int, topk: int, norm_topk: bool) -> torch.Tensor:
    inter = w1.shape[2] // 2

    def expert_mlp(xs, offs):
        act = torch.cat([swiglu_halves(grouped_mm(xs, w1[m].transpose(1, 2), offs))
                         for m in range(micro_start, micro_start + micro_count)], dim=-1)
        w2a = w2[:, :, micro_start * inter:(micro_start + micro_count) * inter]
        return grouped_mm(act, w2a.transpose(1, 2), offs)

    out = routed_reference(x, gate, topk, norm_topk, expert_mlp)
    if shared_w1 is not None:
        out = out + shared_mlp_reference(x, shared_w1, shared_w2, micro_start, micro_count).float()
    return out.to(x.dtype)
