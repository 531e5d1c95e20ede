"""One decode step of the AR phase: a token at a sequence index -> next-token logits.

On the CPU it attends to the cache up to the token. On CUDA the step runs over static buffers (token,
index, length = index + 1) so that it can be captured as a CUDA graph, once per pipeline over its KV pool
(engine/runtime/kv_pool.py): a token then costs one graph replay instead of thousands of kernel launches
from Python. Its attention reads only
the valid prefix of the static cache, the `decode_attention` op taking the length from the device
buffer (under sequence parallelism, which the AR phase does not use, it attends to the whole static
cache under a mask instead). The eager CUDA step (graphs off, or a group that cannot be captured) runs
the very same kernels, so graph and eager decode give the same tokens. Collectives stay inside the
graph when every group is NCCL (or of size one); otherwise the step runs eagerly.
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
        self.static = dev.type == "cuda"        # the position-independent step (graph or not)
        # the static step's attention: the valid prefix, its length on the device (else the masked whole cache)
        self.device_length = view.sp.size == 1
        # token, index and length = index + 1 (keys [0, index + 1)) side by side: on CUDA one copy from
        # pinned host memory sets all three (one transfer per token instead of three fill kernels)
        self._slots = torch.tensor([0, 0, 1], dtype=torch.long, device=dev)
        self.token, self.index, self.length = self._slots[0:1].view(1, 1), self._slots[1:2], self._slots[2:3]
        cuda = dev.type == "cuda"
        self._host = torch.zeros(3, dtype=torch.long, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _forward(self, kv_len: int, masked: bool, length: torch.Tensor | None = None) -> torch.Tensor:
        m = self.model
        h = m.backbone(m.transformer.embed(self.token), self.index, self.pos, self.blocks, self.cache, kv_len,
                       self.view, masked=masked, kv_len_dev=length)
        return m.transformer.logits(h[:, -1], self.view)[0]

    def _static_forward(self) -> torch.Tensor:
        """The step that depends on the position only through the static buffers."""
        if self.device_length:
            return self._forward(self.cache.max_len, masked=False, length=self.length)
        return self._forward(self.cache.max_len, masked=True)

    def __call__(self, token: int, index: int) -> torch.Tensor:
        if self._copied is None:
            self._slots.copy_(torch.tensor([token, index, index + 1]))
        else:
            self._copied.synchronize()      # the previous copy has read the pinned buffer (it has, by now)
            self._host[0], self._host[1], self._host[2] = token, index, index + 1
            self._slots.copy_(self._host, non_blocking=True)
            self._copied.record()
        if self.use_graph and self.graph is None:
            self._capture()
        if self.use_graph:
            self.graph.replay()        # capture records the kernels; only a replay runs them
            return self.logits
        if self.static:
            return self._static_forward()
        return self._forward(index + 1, masked=False)

    def _capture(self) -> None:
        """Warm up on a side stream, then capture (the caller replays). On any failure the request decodes
        eagerly: capture is an optimisation, never a reason to fail a request."""
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.logits = self._static_forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._static_forward()
            self.graph = graph
        except Exception as e:  # noqa: BLE001
            print(f"engine: CUDA-graph decode unavailable ({type(e).__name__}: {e}); decoding eagerly",
                  file=sys.stderr)
            self.use_graph, self.graph = False, None
