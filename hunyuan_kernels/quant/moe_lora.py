"""The `moe_lora` op: the `moe` op (float packs) or `moe_quant` op (quantized packs) with each token's LoRA
adapter on the MLPs: the shared MLP's and every expert's gate_and_up_proj and down_proj.

    moe_lora(x [N, H], gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
             slot [N] int64, strength [N] (x.dtype), lora: MoeLora) -> [N, H] in x.dtype

PEFT adapts each linear as W x + scale * B (A x); for an expert the gate/up update enters before the
SwiGLU, so it cannot be added to the block's output: it is added to each route's GEMM1 output, and the
down update to its GEMM2 output, before the route weight. Every route (token t, expert e) belongs to the
group (e, slot[t]): the routes are sorted by that key (stable, so by expert, then adapter, then token),
the base GEMMs run grouped by expert over them as the `moe` op's do (the groups of one expert are
contiguous), the LoRA products grouped by (expert, adapter) on the tables flattened [E * S, ...]: no
adapter weights gathered per token, no host sync, no branch on the data (slot 0's tables are zeros: a
route without an adapter adds exact zeros). The shared MLP likewise over the tokens sorted by slot.
The adapter's scale is folded into B; `strength` (the request's lora_scale) scales A x per token.

Routing, the micro layout and the finalize (fp32, the routes of a token summed in a fixed order) are
the `moe` op's (moe/reference.py); the GEMMs on either kind of pack are moe.py's (`moe_quant`'s). This is a PyTorch op on every device: its GEMMs are torch._grouped_mm
and, for quantized packs, the registry's grouped GEMMs of their format (quant/linear.py `qgrouped`), the
CUDA variants where they are registered.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..moe.reference import finalize_routes, group_ends, grouped_mm, route, swiglu_halves
from ..registry import reference
from .formats import QWeight
from .linear import qgrouped
from .moe import _expert_cols, _linear, _micro_cols, _micro_rows


class MoeLora(NamedTuple):
    """One MoE layer's LoRA tables on one rank, every adapter slot S (slot 0 none: zeros), the adapter's
    scale folded into B, rank R (a lower rank zero-padded), sharded like the packs (engine/model/moe.py):
      a1 [E, S, R, H]               the experts' gate_and_up_proj A (whole: column-parallel)
      b1 [micros, E, S, 2*I, R]     ... its B, rows of each micro as the w1 pack holds them ([x1 ; x2])
      a2 [E, S, R, micros*I]        the experts' down_proj A, the micros' input columns side by side
      b2 [E, S, H, R]               ... its B (whole: row-parallel, a partial sum like the pack's)
      sa1, sb1, sa2, sb2            the shared MLP's, the same without E: [S, R, H], [micros, S, 2*Is, R],
                                    [S, R, micros*Is], [S, H, R]; None for a layer without a shared MLP"""
    a1: torch.Tensor
    b1: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    sa1: torch.Tensor | None
    sb1: torch.Tensor | None
    sa2: torch.Tensor | None
    sb2: torch.Tensor | None

    def slot(self, s: int) -> list[torch.Tensor]:
        """Slot s's part of every table (views; the shared MLP's only where there is one)."""
        views = [self.a1[:, s], self.b1[:, :, s], self.a2[:, s], self.b2[:, s]]
        if self.sa1 is not None:
            views += [self.sa1[s], self.sb1[:, s], self.sa2[s], self.sb2[s]]
        return views


def _grouped(x: torch.Tensor, w, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group times W[g]^T for a [G, N, K] pack, float or quantized."""
    return qgrouped(x, w, offs) if isinstance(w, QWeight) else grouped_mm(x, w.transpose(1, 2), offs)


def _low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
              offs: torch.Tensor) -> torch.Tensor:
    """scale * B[g] (A[g] x) for rows sorted by group: a [G, R, K], b [G, N, R], scale [rows, 1]."""
    return grouped_mm(grouped_mm(x, a.transpose(1, 2), offs) * scale, b.transpose(1, 2), offs)


def _shared(x, shared_w1, shared_w2, micro_start: int, micro_count: int, slot, strength,
            lora: MoeLora) -> torch.Tensor:
    """The shared MLP with each token's adapter, [N, H] in x.dtype: the tokens sorted by slot."""
    n = x.shape[0]
    s, is_micro = lora.sa1.shape[0], shared_w1.shape[1] // 2
    order = slot.argsort(stable=True)
    offs = group_ends(slot, s)
    xs = x.index_select(0, order)
    st = strength.index_select(0, order).view(-1, 1)
    u = grouped_mm(xs, lora.sa1.transpose(1, 2), offs) * st
    h = _linear(xs, _micro_rows(shared_w1, micro_start, micro_count)).view(n, micro_count, 2 * is_micro)
    h = h + torch.stack([grouped_mm(u, lora.sb1[m].transpose(1, 2), offs)
                         for m in range(micro_start, micro_start + micro_count)], dim=1)
    act = swiglu_halves(h).reshape(n, -1)
    cols = slice(micro_start * is_micro, (micro_start + micro_count) * is_micro)
    y = _linear(act, _micro_cols(shared_w2, micro_start, micro_count, is_micro))
    y = y + _low_rank(act, lora.sa2[..., cols], lora.sb2, st, offs)
    return torch.empty_like(y).index_copy_(0, order, y)


@reference("moe_lora")
def moe_lora_reference(x: torch.Tensor, gate: torch.Tensor, w1, w2, shared_w1, shared_w2, micro_start: int,
                       micro_count: int, topk: int, norm_topk: bool, slot: torch.Tensor, strength: torch.Tensor,
                       lora: MoeLora) -> torch.Tensor:
    e, s = lora.a1.shape[:2]
    inter = w1.shape[2] // 2
    w, idx = route(x, gate, topk, norm_topk)
    key = (idx * s + slot.view(-1, 1)).reshape(-1)          # route r = t*k + j -> its group (expert, slot)
    order = key.argsort(stable=True)                        # by expert, then adapter, then token
    tok = order // topk
    xs = x.index_select(0, tok)
    st = strength.index_select(0, tok).view(-1, 1)
    offs_es = group_ends(key, e * s)                        # the (expert, slot) groups ...
    offs_e = offs_es.view(e, s)[:, -1].contiguous()         # ... and each expert's, which they split
    u = grouped_mm(xs, lora.a1.flatten(0, 1).transpose(1, 2), offs_es) * st
    act = torch.cat([swiglu_halves(_grouped(xs, w1[m], offs_e)
                                   + grouped_mm(u, lora.b1[m].flatten(0, 1).transpose(1, 2), offs_es))
                     for m in range(micro_start, micro_start + micro_count)], dim=-1)
    cols = slice(micro_start * inter, (micro_start + micro_count) * inter)
    down = _expert_cols(w2, micro_start, micro_count, inter) if isinstance(w2, QWeight) else w2[:, :, cols]
    y = _grouped(act, down, offs_e)
    y = y + _low_rank(act, lora.a2[..., cols].flatten(0, 1), lora.b2.flatten(0, 1), st, offs_es)
    out = finalize_routes(y, order, w)
    if shared_w1 is not None:
        out = out + _shared(x, shared_w1, shared_w2, micro_start, micro_count, slot, strength, lora).float()
    return out.to(x.dtype)
