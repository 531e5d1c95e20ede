"""The AR prefill: the prompt's forward -> the logits of its last token.

A short prompt's prefill is host-bound on a GPU: a T2I prompt of ~1250 tokens needs ~25 ms of kernels
but ~30-60 ms to issue them from Python (32 layers of norms, RoPE, routing, grouped GEMMs). On CUDA a
prompt of at most GRAPH_MAX tokens therefore runs padded to a length bucket (a multiple of GRAIN) over
static buffers, and with graphs on each bucket is captured once and replayed: the prefill then costs
its kernels' time. Padding rows sit after the prompt, are causal (block -1) and so invisible to every
prompt row; they write K/V at positions [L, bucket), which the decode steps overwrite before any query
reads them (each step writes its own position first). The eager CUDA prefill of such a prompt runs the
very same padded forward, so graph and eager give the same tokens. Longer prompts (a TI2I prompt with
reference images: GPU-bound) and the CPU run the plain forward of exactly the prompt.

Its graphs live with the engine's other graphs (engine/runtime/graphs.py, key ("prefill", bucket, ...)):
captured once per bucket, a failed capture an error that names the bucket.
"""
from __future__ import annotations

import torch

from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.model.lora import LoraRows, RowAdapters, lora_key, mode_of
from engine.parallel.layout import PhaseView, graph_safe
from engine.runtime.graphs import Graphs

GRAIN = 128            # bucket lengths: multiples of this (at most GRAIN - 1 padding rows)
GRAPH_MAX = 2048       # longer prompts are GPU-bound (their kernels outlast issuing them): no padding


class PrefillStep:
    def __init__(self, model: HunyuanImage3, cache: KVCache, view: PhaseView, use_graph: bool = False,
                 padded: bool | None = None, graphs: Graphs | None = None, key: tuple = (),
                 adapters: RowAdapters | None = None):
        """`padded`: run short prompts at their bucket (default: on CUDA; tests set it on the CPU).
        `graphs`: the engine's graph owner (else one of its own); `key` names the cache in its keys.
        `adapters`: the cache row's LoRA adapter (one row of static buffers the pool sets before each
        prefill; a graph per LoRA mode: none, or one adapter)."""
        self.model, self.cache, self.view, self.adapters = model, cache, view, adapters
        dev = model.device
        self.padded = dev.type == "cuda" if padded is None else padded
        self.use_graph = use_graph and dev.type == "cuda" and self.padded and graph_safe(view.tp, view.sp)
        self.graphs = graphs if graphs is not None else Graphs()
        self.key = key
        if self.padded:
            n = min(GRAPH_MAX, cache.max_len)
            self.emb = torch.zeros(1, n, model.cfg.hidden_size, dtype=model.dtype, device=dev)
            self.pos = torch.zeros(n, 2, dtype=torch.long, device=dev)
            self.blocks = torch.full((n,), -1, dtype=torch.long, device=dev)
            self.index = torch.arange(n, device=dev)
            self.last = torch.zeros(1, dtype=torch.long, device=dev)

    def bucket(self, length: int) -> int | None:
        """The padded length a prompt of `length` tokens runs at, or None for the plain forward."""
        if not self.padded or length > GRAPH_MAX:
            return None
        b = -(-length // GRAIN) * GRAIN
        return b if b <= self.emb.shape[1] else None

    def __call__(self, embeds: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """embeds [1, L, H] of the prompt at sequence indices [0, L); pos [>=L, 2] and blocks [>=L] describe
        the sequence. Writes the prompt's K/V at [0, L) of the cache; returns fp32 logits [vocab]."""
        L = embeds.shape[1]
        b = self.bucket(L)
        if b is None:
            m = self.model
            batch = m.attn_batch(torch.arange(L, device=embeds.device), pos, blocks, L, self.view, lora=self._lora())
            h = m.backbone(embeds, batch, self.cache, self.view)
            return m.transformer.logits(h[:, -1], self.view)[0]
        self.emb[:, :L].copy_(embeds)
        self.emb[:, L:b].zero_()
        self.pos[:L].copy_(pos[:L])
        self.blocks[:L].copy_(blocks[:L])
        self.blocks[L:b].fill_(-1)            # padding is causal: no prompt row sees it
        self.last.fill_(L - 1)
        return self._run(b)

    def buckets(self) -> tuple[int, ...]:
        """The padded lengths this step runs at (none: the plain forward only, e.g. on the CPU)."""
        return tuple(range(GRAIN, self.emb.shape[1] + 1, GRAIN)) if self.padded else ()

    def warm(self, bucket: int) -> None:
        """The forward of bucket `bucket` over padding alone (it writes only the staging row's K/V, which
        the next prefill overwrites): on CUDA its graph is captured here, at start (engine/runtime/warmup.py)."""
        if bucket not in self.buckets():
            raise ValueError(f"no prefill bucket {bucket} (buckets: {self.buckets()})")
        self.emb[:, :bucket].zero_()
        self.pos[:bucket].zero_()
        self.blocks[:bucket].fill_(-1)
        self.last.fill_(bucket - 1)
        self._run(bucket)

    def _run(self, b: int) -> torch.Tensor:
        """The bucket's forward as its graph's replay (captured at the first call) or eagerly."""
        if self.use_graph:
            return self.graphs.replay(("prefill", b) + self.key + lora_key(mode_of(self.adapters)),
                                      lambda: self._forward(b))
        return self._forward(b)

    def _lora(self) -> LoraRows | None:
        """The row's adapter in its current mode (set before each prefill): none, or one adapter."""
        return None if self.adapters is None else self.adapters.rows(slice(0, 1))

    def _forward(self, b: int) -> torch.Tensor:
        """The bucket's forward over the static buffers (what a graph captures)."""
        m = self.model
        batch = m.attn_batch(self.index[:b], self.pos, self.blocks, b, self.view, lora=self._lora())
        h = m.backbone(self.emb[:, :b], batch, self.cache, self.view)
        return m.transformer.logits(h.index_select(1, self.last)[:, 0], self.view)[0]
