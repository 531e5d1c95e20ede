"""The KV cache of a pipeline's requests, allocated once and reused, with the AR decode step bound to it.

A request takes a view of the pool (its rows: branches x images; its positions: its budget). The AR
decode step (engine/runtime/decode_step.py) attends through device-side lengths and so does not depend
on the request's position or budget: bound to the pool's storage and to static position buffers, its
CUDA graph is captured at the first request's first token and replayed by every later request. The
pool grows (and the step is made, and captured, again) only when a request needs more rows or positions
than it holds; it never shrinks.

Nothing a request reads is left over from an earlier one: every phase writes the positions it then
attends to (the prefill its prompt, each decode step its token, the denoise prefill the uncached
prefix, each step its image tokens), as with a freshly zeroed cache.
"""
from __future__ import annotations

import torch

from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.parallel.layout import PhaseView
from engine.runtime.decode_step import DecodeStep
from engine.runtime.prefill_step import PrefillStep

GRAIN = 1024            # positions are allocated in multiples of this (fewer regrowths, fewer captures)


class KVPool:
    def __init__(self, model: HunyuanImage3, heads: int, limit: int):
        self.model, self.heads, self.limit = model, heads, limit   # limit: the model's positions
        self.cache: KVCache | None = None
        self.pos: torch.Tensor | None = None          # [length, 2] positions the decode step reads
        self.blocks: torch.Tensor | None = None       # [length] full-attention block ids (masked steps)
        self.steps: dict[tuple, DecodeStep | PrefillStep] = {}
        self.allocations = 0                          # how often storage was (re)allocated (tests)

    @property
    def rows(self) -> int:
        return 0 if self.cache is None else self.cache.k[0].shape[0]

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.max_len

    def take(self, rows: int, length: int) -> KVCache:
        """A request's cache: `rows` batch rows of `length` positions (views of the pool's storage)."""
        if rows > self.rows or length > self.length:
            self._allocate(max(rows, self.rows), max(length, self.length))
        return self.cache.rows(slice(0, rows)).prefix(length)

    def _allocate(self, rows: int, length: int) -> None:
        m, cfg = self.model, self.model.cfg
        length = max(length, min(-(-length // GRAIN) * GRAIN, self.limit))   # whole grains, up to the limit
        self.cache, self.steps = None, {}             # the old storage (and its graphs) go before the new is made
        self.cache = KVCache.allocate(cfg.num_layers, rows, self.heads, length, cfg.head_dim, m.dtype, m.device)
        self.pos = torch.zeros(length, 2, dtype=torch.long, device=m.device)
        self.blocks = torch.full((length,), -1, dtype=torch.long, device=m.device)
        self.allocations += 1

    def decode_step(self, ar_heads: slice, pos: torch.Tensor, blocks: torch.Tensor, view: PhaseView,
                    use_graph: bool) -> DecodeStep:
        """The AR decode step over row 0's `ar_heads`, made once per pool storage, after copying this
        request's positions and blocks ([n, 2], [n], n <= the pool's length) into its static buffers."""
        n = pos.shape[0]
        self.pos[:n].copy_(pos)
        self.blocks[:n].copy_(blocks)
        key = (ar_heads.start, ar_heads.stop, id(view), use_graph)
        if key not in self.steps:
            self.steps[key] = DecodeStep(self.model, self.pos, self.blocks,
                                         self.cache.rows(slice(0, 1)).heads(ar_heads), view, use_graph)
        return self.steps[key]

    def prefill_step(self, ar_heads: slice, view: PhaseView, use_graph: bool) -> PrefillStep:
        """The AR prefill over row 0's `ar_heads`, made once per pool storage (its graphs per bucket)."""
        key = ("prefill", ar_heads.start, ar_heads.stop, id(view), use_graph)
        if key not in self.steps:
            self.steps[key] = PrefillStep(self.model, self.cache.rows(slice(0, 1)).heads(ar_heads), view, use_graph)
        return self.steps[key]
