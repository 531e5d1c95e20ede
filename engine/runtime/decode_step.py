"""One decode step of the AR phase: a token at a sequence index -> next-token logits.

On the CPU it attends to the cache up to the token. On CUDA the step attends to the whole static
cache under a mask, over static buffers (token, index), so that it can be captured once per request
as a CUDA graph: a token then costs one graph replay instead of thousands of kernel launches from
Python. The eager CUDA step (graphs off, or a group that cannot be captured) runs the very same
kernels, so graph and eager decode give the same tokens. Collectives stay inside the graph when every
group is NCCL (or of size one); otherwise the step runs eagerly.
"""
from __future__ import annotations

import sys

import torch

from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.parallel.layout import PhaseView, graph_safe


class DecodeStep:
    def __init__(self, model: HunyuanImage3, pos: torch.Tensor, blocks: torch.Tensor, cache: KVCache,
                 view: PhaseView, use_graph: bool = False):
        self.model, self.pos, self.blocks, self.cache, self.view = model, pos, blocks, cache, view
        dev = model.device
        self.use_graph = use_graph and dev.type == "cuda" and graph_safe(view.tp, view.sp)
        self.static = dev.type == "cuda"        # the masked whole-cache step (graph or not)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.index = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _forward(self, kv_len: int, masked: bool) -> torch.Tensor:
        m = self.model
        h = m.backbone(m.transformer.embed(self.token), self.index, self.pos, self.blocks, self.cache, kv_len,
                       self.view, masked=masked)
        return m.transformer.logits(h[:, -1], self.view)[0]

    def __call__(self, token: int, index: int) -> torch.Tensor:
        self.token.fill_(token)
        self.index.fill_(index)
        if self.use_graph and self.graph is None:
            self._capture()
        if self.use_graph:
            self.graph.replay()        # capture records the kernels; only a replay runs them
            return self.logits
        if self.static:
            return self._forward(self.cache.max_len, masked=True)
        return self._forward(index + 1, masked=False)

    def _capture(self) -> None:
        """Warm up on a side stream, then capture (the caller replays). On any failure the request decodes
        eagerly: capture is an optimisation, never a reason to fail a request."""
        full = self.cache.max_len
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.logits = self._forward(full, masked=True)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._forward(full, masked=True)
            self.graph = graph
        except Exception as e:  # noqa: BLE001
            print(f"engine: CUDA-graph decode unavailable ({type(e).__name__}: {e}); decoding eagerly",
                  file=sys.stderr)
            self.use_graph, self.graph = False, None
