"""Mixture of experts: fp32 softmax router with renormalised top-k, routed experts computing
`down(x1 * silu(x2))` with no token dropping, plus an ungated shared MLP. The computation is the
`moe` kernel op (kernels/moe.py: its PyTorch reference and the CUDA paths); this module owns the
resident weights and how they are read from the checkpoint.

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
from torch import nn

import kernels

from engine.model.packed import dense, read_cols, read_gate_up
from engine.parallel.layout import PhaseView, ShardLayout
from engine.spec.checkpoint import Checkpoint


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
        """Read the router (fp32, never quantized), this shard's slices of every expert and of the shared
        MLP (dequantized to the parameters' dtype when the checkpoint is quantized)."""
        self.gate.copy_(ckpt.read(prefix + "gate.wg.weight"))
        dt, dev = self.w1.dtype, self.w1.device
        if self.shared_w1 is not None:
            self.shared_w1.copy_(dense(read_gate_up(ckpt, prefix + "shared_mlp.gate_and_up_proj", self.shared_inter,
                                                    layout), dt, dev))
            self.shared_w2.copy_(dense(read_cols(ckpt, prefix + "shared_mlp.down_proj", self.shared_inter, layout),
                                       dt, dev))
        for e in range(self.experts):
            p = f"{prefix}experts.{e}."
            self.w1[:, e].copy_(dense(read_gate_up(ckpt, p + "gate_and_up_proj", self.inter, layout), dt, dev))
            down = dense(read_cols(ckpt, p + "down_proj", self.inter, layout), dt, dev)     # [H, micros * I_micro]
            self.w2[:, e].copy_(down.view(down.shape[0], self.micros, -1).transpose(0, 1))

    def forward(self, x: torch.Tensor, view: PhaseView) -> torch.Tensor:
        """This rank's partial sum of the routed experts and the shared MLP over the active micros (the
        caller all-reduces it over the TP group): the `moe` kernel op (kernels/moe.py)."""
        shape = x.shape
        out = kernels.call("moe", x.reshape(-1, shape[-1]), self.gate, self.w1, self.w2, self.shared_w1,
                           self.shared_w2, view.micro_start, view.micro_count, self.topk, self.norm_topk)
        return out.view(shape)
