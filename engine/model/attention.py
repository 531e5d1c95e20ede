"""Self-attention with the fused per-KV-group QKV, 2D RoPE then q/k RMSNorm, GQA, a static KV cache
and the generalised causal mask (causal + full-attention blocks).

Resident layout (see `parallel.py`): `qkv` is [micros, rows, H], each micro holding whole KV groups
([group q heads, k, v] x head_dim rows per KV head, as in the checkpoint), so a micro view and the
all-micro view are both contiguous. `o_proj` is [H, micros * cols] with the micros' input columns
side by side; a micro view is a column block. Either may stay quantized (engine/model/packed.py:
codes and scales in the same packing).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import hunyuan_kernels as kernels
from engine.model.layers import RMSNorm
from engine.model.packed import (PackFormat, linear, micro_cols, micro_rows, packed_param, read_cols, read_rows,
                                 store)
from engine.parallel.layout import PhaseView, ShardLayout
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.names import LayerNames

if TYPE_CHECKING:
    from engine.model.lora import LoraRows


class KVCache:
    """Static per-layer K/V buffers [B, kv_heads, max_len, head_dim], written at sequence indices."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k, self.v = k, v

    @classmethod
    def allocate(cls, layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        def buf() -> torch.Tensor:
            return torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        return cls([buf() for _ in range(layers)], [buf() for _ in range(layers)])

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def rows(self, batch: slice) -> "KVCache":
        """A view of some batch rows (shares storage: the AR phase writes row 0 of the denoise cache)."""
        return KVCache([t[batch] for t in self.k], [t[batch] for t in self.v])

    def grown(self, max_len: int, keep: int) -> "KVCache":
        """A longer cache holding this one's first `keep` positions."""
        out = KVCache.allocate(len(self.k), self.k[0].shape[0], self.k[0].shape[1], max_len, self.k[0].shape[3],
                               self.k[0].dtype, self.k[0].device)
        for src, dst in ((self.k, out.k), (self.v, out.v)):
            for a, b in zip(src, dst):
                b[:, :, :keep] = a[:, :, :keep]
        return out

    def prefix(self, length: int) -> "KVCache":
        """A view of the first `length` positions (shares storage)."""
        return KVCache([t[:, :, :length] for t in self.k], [t[:, :, :length] for t in self.v])

    def heads(self, heads: slice) -> "KVCache":
        """A view of some KV heads (the AR micro's heads and the denoise heads of one allocation)."""
        return KVCache([t[:, heads] for t in self.k], [t[:, heads] for t in self.v])

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(2, index, k)
        self.v[layer].index_copy_(2, index, v)

    def write_chunks(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [n, B, heads, T, D] (what a heads exchange returns): chunk r at sequence indices
        index[r*T:(r+1)*T], written as they are (no reassembled [B, heads, n*T, D] copy first)."""
        T = k.shape[3]
        for r in range(k.shape[0]):
            self.write(layer, index[r * T:(r + 1) * T], k[r], v[r])


@dataclass
class AttnBatch:
    """Per-forward attention inputs shared by all layers.

    index: [T] sequence (= cache) indices of this rank's tokens, the same for every batch row; or [B, T]
      (a batched decode step, `HunyuanImage3.row_batch`): row b's own indices, each row its own sequence.
    cos, sin: [T, head_dim] fp32 RoPE tables for those tokens ([B, T, head_dim] with per-row indices).
    kv_len: keys [0, kv_len) of the cache are attended to.
    mask: [Q, kv_len] bool (True = attend) or None when every query sees every key (on CUDA the same
      mask in additive form, 0 / -inf in the compute dtype, made once for all layers); Q = T, or S for
      Ulysses, whose attention runs on the whole sequence for a slice of the heads. With `masked_rows`
      it holds only those leading rows.
    gathered: [S] indices of the tokens of all sequence-parallel ranks, in SP rank order (SP only).
    masked_rows: when set, only the first `masked_rows` query rows need the mask and every later row sees
      all kv_len keys, or those of `key_mask` (a denoise step: the meta tokens are causal, the image
      tokens see everything before the image's end); those rows run on the fastest attention kernel.
    kv_len_dev: when set (a decode step, no sequence parallelism), a device int64 tensor [1] holding
      the number of valid keys, or [B] (per-row indices: each row's own count); attention reads only keys
      [0, kv_len_dev) of each row through the `decode_attention` op, the queries being the last T of them
      (causal among themselves), and `kv_len` is only the cache's static bound. No host read of it, so
      one captured graph serves every position.
    key_mask: [B or 1, 1, 1, kv_len] bool (True = attend; on CUDA additive) or None: the keys EVERY query
      row may see, the others hidden from all rows (a denoise step whose kv_len is its step key's bound:
      the keys between the request's prefix and the step's own tokens are not its own). `mask`, where
      set, already hides them too.
    lora: the LoRA adapter of each batch row (engine/model/lora.py), added to qkv_proj and o_proj; None
      when the engine has no adapter tables.
    """
    index: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None
    gathered: torch.Tensor | None = None
    masked_rows: int | None = None
    kv_len_dev: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    lora: "LoraRows | None" = None


def sdpa_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as SDPA takes it best: on CUDA additive (0 / -inf in the compute dtype),
    made once for all layers (SDPA turns a bool mask into an additive one at every call: three kernels
    and ~80 us of host time a layer); on the CPU as it is."""
    if mask.device.type != "cuda":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attention_mask(index: torch.Tensor, blocks: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Generalised causal mask [..., Q, kv_len] for queries at sequence indices `index` [Q]: key j is
    visible to query i if j <= i, or if both lie in the same full-attention block (blocks [..., L]:
    block id per token, -1 for causal tokens; leading batch dims are kept)."""
    keys = torch.arange(kv_len, device=index.device)
    qb = blocks[..., index].unsqueeze(-1)
    kb = blocks[..., :kv_len].unsqueeze(-2)
    return (keys[None, :] <= index[:, None]) | ((qb == kb) & (qb >= 0))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 micros: int, storage_size: int, dtype=None, device=None,
                 formats: dict[str, PackFormat | None] | None = None):
        super().__init__()
        ranks = micros * storage_size
        if kv_heads % ranks:
            raise ValueError(f"{kv_heads} KV heads are not divisible by {ranks} tensor-parallel micro shards")
        self.group = heads // kv_heads          # query heads per KV head
        self.kv_per_micro = kv_heads // ranks
        self.head_dim = head_dim
        rows = self.kv_per_micro * (self.group + 2) * head_dim
        cols = self.kv_per_micro * self.group * head_dim
        f = formats or {}            # "qkv" / "o_proj": kept quantized in that format (else float)
        self.qkv = packed_param((micros, rows, hidden), f.get("qkv"), dtype, device)
        self.o_proj = packed_param((hidden, micros * cols), f.get("o_proj"), dtype, device)
        self.q_norm = RMSNorm(head_dim, eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(head_dim, eps, dtype=dtype, device=device)
        self.micros = micros

    def load(self, ckpt: Checkpoint, names: LayerNames, layout: ShardLayout) -> None:
        """Read this shard's slices of the layer's `qkv_proj`, `o_proj` (dequantized to the parameters' dtype
        when the checkpoint is quantized, unless they stay quantized) and the q/k norms."""
        n = layout.logical_size
        layer = names.qkv_proj
        store(self.qkv, read_rows(ckpt, layer, self.qkv.shape[1] * n, layout, self.qkv.device), layer,
              micro_rows=self.micros)
        layer = names.o_proj
        store(self.o_proj, read_cols(ckpt, layer, self.o_proj.shape[1] // self.micros * n, layout, self.o_proj.device),
              layer)
        self.q_norm.weight.copy_(ckpt.read(names.query_layernorm))
        self.k_norm.weight.copy_(ckpt.read(names.key_layernorm))

    def forward(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache, layer: int, view: PhaseView) -> torch.Tensor:
        B, T, H = x.shape
        D, g = self.head_dim, self.group
        kv = self.kv_per_micro * view.micro_count
        qkv = linear(x, micro_rows(self.qkv, view))
        if batch.lora is not None:
            batch.lora.add_qkv(qkv, x, layer, view)
        qkv = qkv.view(B, T, kv, g + 2, D)
        # RoPE first, then the per-head RMSNorm, both in fp32 (official order), then back to the dtype
        norms = (batch.cos, batch.sin, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        sp = view.sp
        if sp.size == 1:         # one pass: q out, k and v straight into the cache
            q = kernels.call("rope_qk_norm_cache", qkv, *norms, cache.k[layer], cache.v[layer], batch.index)
        elif view.sp_kind == "ulysses":
            # sequence shards -> head shards: this rank attends for 1/sp of the heads over the whole
            # sequence. RoPE writes the exchange's send layout [sp, B, h/sp, T, D]; what comes back is
            # chunk r = SP rank r's tokens: q is put together once, k and v go chunk by chunk to the cache
            q, k, v = (sp.all_to_all(t) for t in kernels.call("rope_qk_norm", qkv, *norms, parts=sp.size))
            q = torch.cat(q.unbind(0), dim=2)
            cache.write_chunks(layer, batch.gathered, k, v)
        else:
            # KV all-gather: local queries, the whole sequence's keys and values (cache replicated over SP)
            q, k, v = kernels.call("rope_qk_norm", qkv, *norms)
            cache.write(layer, batch.gathered, sp.all_gather(k, dim=2), sp.all_gather(v, dim=2))
        m = batch.masked_rows
        if batch.kv_len_dev is not None:
            # the valid prefix of the static cache, its length on the device (a graph-captured decode step)
            if sp.size > 1 or m is not None or batch.mask is not None:
                raise ValueError("a device KV length is for an unmasked step without sequence parallelism")
            out = kernels.call("decode_attention", q, cache.k[layer], cache.v[layer], batch.kv_len_dev)
        else:
            out = self._attend(q, cache.k[layer][:, :, :batch.kv_len], cache.v[layer][:, :, :batch.kv_len], batch)
        if sp.size > 1 and view.sp_kind == "ulysses":
            flat = _heads_to_tokens(out, sp)
        else:
            flat = out.transpose(1, 2).reshape(B, T, kv * g * D)
        out = linear(flat, micro_cols(self.o_proj, view, self.micros))
        if batch.lora is not None:
            batch.lora.add_o(out, flat, layer, view)
        return out

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: AttnBatch) -> torch.Tensor:
        """SDPA of q over the cache's first kv_len keys, under the batch's mask."""
        gqa, m = self.group > 1, batch.masked_rows
        if m is None and (batch.mask is not None or batch.key_mask is None):     # one mask for every row
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=gqa)
        # every row on the fastest path (unmasked: flash; under a key mask: the query heads of a KV head
        # folded into its sequence, which every masked SDPA kernel takes), then the m causal rows again
        # with their mask, written over the first m rows: no slice of q, no concatenated copy of the output
        if batch.key_mask is None:
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)
        else:
            B, h, T, D = q.shape
            kv = keys.shape[1]
            # reshape, not view: CUDA's fp32 masked kernel returns its output strided (tokens outermost)
            out = F.scaled_dot_product_attention(q.reshape(B, kv, h // kv * T, D), keys, values,
                                                 attn_mask=batch.key_mask).reshape(B, h, T, D)
        if m:        # (m: None with a key mask alone)
            head = F.scaled_dot_product_attention(q[:, :, :m], keys, values, attn_mask=batch.mask, enable_gqa=gqa)
            if torch.is_grad_enabled():         # autograd keeps SDPA's output: never written in place
                out = torch.cat([head, out[:, :, m:]], dim=2)
            else:
                out[:, :, :m] = head
        return out


def _heads_to_tokens(t: torch.Tensor, sp) -> torch.Tensor:
    """Inverse of the heads exchange of q/k/v, straight into the o_proj's input: [B, h/sp, sp*T, D] (all tokens, my
    head chunk) -> [B, T, h*D] (my tokens, every head; one copy after the exchange)."""
    B, hc, S, D = t.shape
    T = S // sp.size
    x = sp.all_to_all(t.reshape(B, hc, sp.size, T, D).permute(2, 0, 1, 3, 4))     # [sp, B, hc, T, D]
    return x.permute(1, 3, 0, 2, 4).reshape(B, T, sp.size * hc * D)
