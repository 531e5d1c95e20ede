"""Mixture of experts: fp32 softmax router with renormalised top-k, routed experts computing
`down(x1 * silu(x2))` with no token dropping, plus an ungated shared MLP. The computation is the
`moe` kernel op (hunyuan_kernels/moe/: its PyTorch reference and the CUDA paths); this module owns the
resident weights and how they are read from the checkpoint.

Resident layout (see engine/model/packed.py): the gate/up packs micro-major, the down packs with the
micros' input columns side by side (cols-packed):
  w1 [micros, E, 2*I_micro, H]  rows of a micro = [x1 block ; x2 block] of that micro's slice of I
  w2 [E, H, micros * I_micro]   micro m of expert e = w2[e, :, m*I_micro:(m+1)*I_micro]
  shared_w1 [micros, 2*Is_micro, H], shared_w2 [H, micros * Is_micro]
AR uses one micro; denoise uses all micros of the storage shard with ONE routing pass shared by
every micro, ONE down GEMM over the active micros' columns (K = micro_count * I_micro: the micro
partials are summed in its fp32 accumulation, before the route weight) and one weighted finalize.
The packs may stay quantized in the same packing (engine/model/packed.py `QuantPack`, codes and scales
along K; an NVFP4 pack has one global scale per expert; a micro's column block must be whole scale
blocks of the format); the forward then runs the `moe_quant` op.
With LoRA adapters of the MLPs in the forward's rows (engine/model/lora.py, mode "+mlp") the forward runs
the `moe_lora` op instead (hunyuan_kernels/quant/moe_lora.py: the same block with each token's adapter
added inside its experts and the shared MLP, on either kind of pack).
The output is this rank's partial sum; the caller all-reduces over the active TP group.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import hunyuan_kernels as kernels

from engine.model.packed import (PackFormat, QuantPack, check_micro_cols, packed_param, read_cols, read_gate_up, store,
                                 value)
from engine.parallel.layout import PhaseView, ShardLayout
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.names import DOWN_PROJ, GATE_AND_UP_PROJ, LayerNames

if TYPE_CHECKING:
    from engine.model.lora import LoraRows


class MoE(nn.Module):
    def __init__(self, hidden: int, experts: int, topk: int, inter: int, shared_inter: int, norm_topk: bool,
                 micros: int, storage_size: int, dtype=None, device=None,
                 formats: dict[str, PackFormat | None] | None = None):
        super().__init__()
        ranks = micros * storage_size
        for n, what in ((inter, "expert intermediate size"), (shared_inter, "shared MLP intermediate size")):
            if n % ranks:
                raise ValueError(f"{what} {n} is not divisible by {ranks} tensor-parallel micro shards")
        self.topk, self.norm_topk, self.experts = topk, norm_topk, experts
        self.inter_micro = inter // ranks
        self.shared_micro = shared_inter // ranks
        f = dict(formats or {})      # "w1" / "w2" / "shared_w1" / "shared_w2": kept quantized in that format
        if (f.get("w1") is None) != (f.get("w2") is None):
            raise ValueError("the two expert packs are either both quantized or both float")
        if f.get("w1") is None:       # the quantized op needs quantized experts; a lone shared MLP stays float
            f = {}
        self.gate = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32, device=device))
        self.w1 = packed_param((micros, experts, 2 * self.inter_micro, hidden), f.get("w1"), dtype, device, (experts,))
        check_micro_cols(f.get("w2"), self.inter_micro, "the expert down pack")
        self.w2 = packed_param((experts, hidden, micros * self.inter_micro), f.get("w2"), dtype, device, (experts,))
        self.shared_w1 = (packed_param((micros, 2 * self.shared_micro, hidden), f.get("shared_w1"), dtype, device)
                          if shared_inter else None)
        self.shared_w2 = (packed_param((hidden, micros * self.shared_micro), f.get("shared_w2"), dtype, device)
                          if shared_inter else None)
        self.micros, self.inter, self.shared_inter = micros, inter, shared_inter

    def load(self, ckpt: Checkpoint, names: LayerNames, layout: ShardLayout) -> None:
        """Read the router (fp32, never quantized), this shard's slices of every expert and of the shared
        MLP (dequantized to the parameters' dtype when the checkpoint is quantized, unless they stay
        quantized)."""
        self.gate.copy_(ckpt.read(names.router))
        dev = self.gate.device
        if self.shared_w1 is not None:
            layer = names.shared(GATE_AND_UP_PROJ)
            store(self.shared_w1, read_gate_up(ckpt, layer, self.shared_inter, layout, dev), layer)
            layer = names.shared(DOWN_PROJ)
            store(self.shared_w2, read_cols(ckpt, layer, self.shared_inter, layout, dev), layer)
        for e in range(self.experts):
            layer = names.expert(e, GATE_AND_UP_PROJ)
            store(self.w1, read_gate_up(ckpt, layer, self.inter, layout, dev), layer, (slice(None), e), e)
            layer = names.expert(e, DOWN_PROJ)                # read as [H, micros * I_micro]: stored as is
            store(self.w2, read_cols(ckpt, layer, self.inter, layout, dev), layer, e, e)

    def forward(self, x: torch.Tensor, view: PhaseView, lora: "LoraRows | None" = None,
                layer: int = 0) -> torch.Tensor:
        """This rank's partial sum of the routed experts and the shared MLP over the active micros (the
        caller all-reduces it over the TP group): the `moe` kernel op (hunyuan_kernels/moe/), or, when the
        rows' adapters adapt the MLPs (`lora.mlp`; x [B, T, H], `layer` its index), the `moe_lora` op."""
        shape = x.shape
        op = "moe_quant" if isinstance(self.w1, QuantPack) else "moe"     # hunyuan_kernels/quant/moe.py: quantized
        args = (x.reshape(-1, shape[-1]), self.gate, value(self.w1), value(self.w2), value(self.shared_w1),
                value(self.shared_w2), view.micro_start, view.micro_count, self.topk, self.norm_topk)
        if lora is None or not lora.mlp:
            return kernels.call(op, *args).view(shape)
        out = kernels.call("moe_lora", *args, *lora.per_token(shape[0], shape[1]), lora.tables.mlp[layer]).view(shape)
        if lora.select:      # rows mixing adapters with and without MLPs: the latter keep the base op's output
            out = torch.where(lora.adapts_mlp(), out, kernels.call(op, *args).view(shape))
        return out
