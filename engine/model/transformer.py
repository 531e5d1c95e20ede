"""The MoE decoder backbone (official `model.*` + `lm_head`): pre-norm layers of attention and MoE,
`ln_f` + `lm_head` for text. The image head reads the last layer's output WITHOUT `ln_f`."""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

import hunyuan_kernels as kernels

from engine.model.attention import Attention, AttnBatch, KVCache
from engine.model.layers import RMSNorm
from engine.model.moe import MoE
from engine.model.packed import PackFormat, dense, micro_rows, read_rows
from engine.parallel.layout import PhaseView, ShardLayout
from engine.checkpoint import names
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.names import DOWN_PROJ, GATE_AND_UP_PROJ, LayerNames


Resident = Mapping[str, PackFormat]   # pack name -> the format it stays quantized in (engine/model/weights.py)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, layout: ShardLayout, dtype=None, device=None,
                 resident: Resident | None = None):
        super().__init__()
        kw = dict(micros=layout.micros, storage_size=layout.storage_size, dtype=dtype, device=device)
        r, n = resident or {}, names.layer(i)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                   **kw, formats={"qkv": r.get(n.qkv_proj), "o_proj": r.get(n.o_proj)})
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        moe = {"w1": n.experts_pack(GATE_AND_UP_PROJ), "w2": n.experts_pack(DOWN_PROJ),
               "shared_w1": n.shared(GATE_AND_UP_PROJ), "shared_w2": n.shared(DOWN_PROJ)}
        self.mlp = MoE(cfg.hidden_size, cfg.num_experts[i], cfg.moe_topk[i], cfg.moe_intermediate_size[i],
                       cfg.shared_intermediate(i), cfg.norm_topk_prob, **kw,
                       formats={k: r.get(pack) for k, pack in moe.items()})

    def load(self, ckpt: Checkpoint, n: LayerNames, layout: ShardLayout) -> None:
        """Read this layer's norms and this shard's slices of its attention and MoE (`n`: its checkpoint names)."""
        self.input_layernorm.weight.copy_(ckpt.read(n.input_layernorm))
        self.post_attention_layernorm.weight.copy_(ckpt.read(n.post_attention_layernorm))
        self.self_attn.load(ckpt, n, layout)
        self.mlp.load(ckpt, n, layout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: AttnBatch, cache: KVCache, layer: int,
                view: PhaseView) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer on the residual stream, with each residual add fused into the next norm
        (`add_rms_norm`). x is the previous layer's MLP output not yet added (the embeddings, with
        residual None, for layer 0); returns this layer's MLP output and the stream it adds to."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self._add_norm(x, residual, self.input_layernorm)
        a = view.tp.all_reduce_(self.self_attn(h, batch, cache, layer, view))
        h, residual = self._add_norm(a, residual, self.post_attention_layernorm)
        return view.tp.all_reduce_(self.mlp(h, view, batch.lora, layer)), residual

    @staticmethod
    def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.call("add_rms_norm", x, residual, norm.weight, norm.eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout, dtype=None, device=None,
                 resident: Resident | None = None):
        super().__init__()
        self.cfg = cfg
        vocab_micro = layout.split(cfg.vocab_size, "vocab_size")
        self.wte = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, layout, dtype, device, resident)
                                    for i in range(cfg.num_layers))
        self.ln_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = nn.Parameter(torch.empty(layout.micros, vocab_micro, cfg.hidden_size, dtype=dtype,
                                                device=device))

    def load_ends(self, ckpt: Checkpoint, layout: ShardLayout) -> None:
        """The embedding table, the final norm and this shard's vocabulary rows of the LM head."""
        self.wte.copy_(ckpt.read(names.WTE))
        self.ln_f.weight.copy_(ckpt.read(names.LN_F))
        head = read_rows(ckpt, names.LM_HEAD, self.cfg.vocab_size, layout)   # always high precision (the plan checks)
        self.lm_head.copy_(dense(head, self.lm_head.dtype, self.lm_head.device).view(self.lm_head.shape))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.wte)

    def forward(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache, view: PhaseView,
                layers: range | None = None) -> torch.Tensor:
        """The residual stream after `layers` (default: all) for the stream x entering the first of them
        (the denoise step cache runs the first blocks, then maybe the rest)."""
        residual = None
        for i in range(len(self.layers)) if layers is None else layers:
            x, residual = self.layers[i](x, residual, batch, cache, i, view)
        return x + residual

    def logits(self, x: torch.Tensor, view: PhaseView) -> torch.Tensor:
        """fp32 logits over the whole vocabulary (gathered over the AR group in logical order)."""
        local = F.linear(self.ln_f(x), micro_rows(self.lm_head, view))
        return view.tp.all_gather(local, dim=-1).float()
