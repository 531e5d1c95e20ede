"""Mixture of experts: fp32 softmax router with renormalised top-k, routed experts computing
`down(x1 * silu(x2))` with no token dropping, plus an ungated shared MLP.

Resident layout, micro-major (see `parallel.py`):
  w1 [micros, E, 2*I_micro, H]  rows of a micro = [x1 block ; x2 block] of that micro's slice of I
  w2 [micros, E, H, I_micro]
  shared_w1 [micros, 2*Is_micro, H], shared_w2 [H, micros * Is_micro]
AR uses one micro; denoise uses all micros of the storage shard with ONE routing pass shared by
every micro and one weighted finalize (the micro partials are summed before the route weight).
The output is this rank's partial sum; the caller all-reduces over the active TP group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.packed import micro_cols, micro_rows, read_cols, read_gate_up
from engine.parallel.layout import PhaseView, ShardLayout
from engine.spec.checkpoint import Checkpoint


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group times w[g] ([G, K, N]); offs = int32 cumulative end rows per group.

    `torch._grouped_mm` is not on autocast's cast lists, so under autocast (training) its operands are
    cast here to the autocast dtype, as autocast would cast a matmul's."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dt = torch.get_autocast_dtype(kind)
        x, w = x.to(dt), w.to(dt)
    return torch._grouped_mm(x, w, offs=offs)


def swiglu_halves(h: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: first half linear, second half through SiLU (official convention)."""
    x1, x2 = h.chunk(2, dim=-1)
    return x1 * F.silu(x2)


class MoE(nn.Module):
    def __init__(self, hidden: int, experts: int, topk: int, inter: int, shared_inter: int, norm_topk: bool,
                 micros: int, storage_size: int, dtype=None, device=None):
        super().__init__()
        ranks = micros * storage_size
        for n, what in ((inter, "expert intermediate size"), (shared_inter, "shared MLP intermediate size")):
            if n % ranks:
                raise ValueError(f"{what} {n} is not divisible by {ranks} tensor-parallel micro shards")
        self.topk, self.norm_topk, self.experts = topk, norm_topk, experts
        self.inter_micro = inter // ranks
        self.shared_micro = shared_inter // ranks
        self.gate = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32, device=device))
        self.w1 = nn.Parameter(torch.empty(micros, experts, 2 * self.inter_micro, hidden, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(micros, experts, hidden, self.inter_micro, dtype=dtype, device=device))
        self.shared_w1 = (nn.Parameter(torch.empty(micros, 2 * self.shared_micro, hidden, dtype=dtype, device=device))
                          if shared_inter else None)
        self.shared_w2 = (nn.Parameter(torch.empty(hidden, micros * self.shared_micro, dtype=dtype, device=device))
                          if shared_inter else None)
        self.micros, self.inter, self.shared_inter = micros, inter, shared_inter

    def load(self, ckpt: Checkpoint, prefix: str, layout: ShardLayout) -> None:
        """Read the router, this shard's slices of every expert and of the shared MLP."""
        self.gate.copy_(ckpt.read(prefix + "gate.wg.weight"))
        if self.shared_w1 is not None:
            self.shared_w1.copy_(read_gate_up(ckpt, prefix + "shared_mlp.gate_and_up_proj.weight",
                                              self.shared_inter, layout))
            self.shared_w2.copy_(read_cols(ckpt, prefix + "shared_mlp.down_proj.weight", self.shared_inter, layout))
        for e in range(self.experts):
            p = f"{prefix}experts.{e}."
            self.w1[:, e].copy_(read_gate_up(ckpt, p + "gate_and_up_proj.weight", self.inter, layout))
            down = read_cols(ckpt, p + "down_proj.weight", self.inter, layout)      # [H, micros * I_micro]
            self.w2[:, e].copy_(down.view(down.shape[0], self.micros, -1).transpose(0, 1))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (weights [N, k] fp32, expert ids [N, k])."""
        probs = F.linear(x.float(), self.gate).softmax(dim=-1)
        w, idx = probs.topk(self.topk, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-8)
        return w, idx

    def forward(self, x: torch.Tensor, view: PhaseView) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.route(x)
        out = self._experts(x, w, idx, view)
        if self.shared_w1 is not None:
            h = F.linear(x, micro_rows(self.shared_w1, view)).view(x.shape[0], view.micro_count, 2 * self.shared_micro)
            act = swiglu_halves(h).reshape(x.shape[0], -1)
            out = out + F.linear(act, micro_cols(self.shared_w2, view, self.micros))
        return out.view(shape)

    def _experts(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, view: PhaseView) -> torch.Tensor:
        n, k = idx.shape
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)             # routes grouped by expert
        token = order // k
        xs = x.index_select(0, token)
        # Cumulative end offsets per expert without a host sync (bincount would read the max back).
        counts = torch.zeros(self.experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        partial = None
        for m in range(view.micro_start, view.micro_start + view.micro_count):
            h = grouped_mm(xs, self.w1[m].transpose(1, 2), offs)
            y = grouped_mm(swiglu_halves(h), self.w2[m].transpose(1, 2), offs)
            partial = y if partial is None else partial + y
        scale = w.reshape(-1)[order].unsqueeze(1)
        routed = (partial.float() * scale).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, routed)
