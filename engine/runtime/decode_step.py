"""The batched AR decode step: one forward for every request in its decode stage.

Batch row s is AR slot s of the KV pool (engine/runtime/kv_pool.py): the slot's cache row, its own
position table, its own token at its own sequence index, its own valid length (index + 1). A step runs
the rows [0, bucket) of the smallest bucket (1, 2, 4, 8, 16, 32, ..., slots) that holds every active
slot; the other rows of the bucket are idle: token 0 at the storage's scratch position (the last one,
which no request ever reads), attending to key 0 only, their logits ignored. Rows never mix (attention is
per row, the MoE routes each token alone), so a request's logits do not depend on its neighbours.

The step reads everything it varies from static device buffers (tokens, indices, lengths), so on CUDA
each bucket is one CUDA graph, captured once per KV storage and LoRA mode (engine/runtime/graphs.py, key
("decode", bucket, slots, storage[, ("lora", mode)]): engine/model/lora.py `RowAdapters.mode`, decided
when a request takes or leaves its slot) and replayed for every later step of every request. The eager step
(the CPU, graphs off, or groups a graph cannot hold) runs the very same forward. One copy from pinned
host memory sets the three buffers.
"""
from __future__ import annotations

import torch

from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.model.lora import RowAdapters, lora_key, mode_of
from engine.parallel.layout import PhaseView, graph_safe
from engine.runtime.graphs import Graphs

BUCKETS = (1, 2, 4, 8, 16, 32)     # batch sizes with a graph of their own (up to the pool's slots)


def buckets_for(slots: int) -> tuple[int, ...]:
    return tuple(b for b in BUCKETS if b < slots) + (slots,)


class DecodeStep:
    def __init__(self, model: HunyuanImage3, cache: KVCache, pos: torch.Tensor, view: PhaseView, graphs: Graphs,
                 key: tuple, use_graph: bool = False, adapters: RowAdapters | None = None):
        """cache: the AR slots' rows [slots, ar_heads, L, D] (L - 1 is the scratch position); pos [slots, L, 2]
        the slots' position tables; `key` names the storage in the graph keys; `adapters`: the slots' LoRA
        adapters (static buffers, set per request)."""
        self.model, self.cache, self.pos, self.view, self.graphs, self.key = model, cache, pos, view, graphs, key
        dev = model.device
        self.slots, self.scratch = cache.k[0].shape[0], cache.max_len - 1
        self.buckets = buckets_for(self.slots)
        self.use_graph = use_graph and dev.type == "cuda" and graph_safe(view.tp, view.sp)
        # token, index, length per slot side by side (and, for a step `ahead`, where its tokens go): one
        # host-to-device copy per step sets them all
        self._slots = torch.zeros(4, self.slots, dtype=torch.long, device=dev)
        cuda = dev.type == "cuda"
        self._host = torch.zeros(4, self.slots, dtype=torch.long, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        self._rows = torch.arange(self.slots, device=dev)
        self._views = {b: cache.rows(slice(0, b)) for b in self.buckets}
        self.adapters = adapters
        self.forwards = 0             # forwards run (eager) or replayed (graph): one per engine step (tests)

    def bucket(self, slots: list[int]) -> int:
        need = max(slots) + 1
        return next(b for b in self.buckets if b >= need)

    def __call__(self, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """rows: (slot, token, index) of each active request: feed `token` at sequence `index` of the slot's
        row. Returns fp32 logits [bucket, vocab], row s = slot s (the output buffer of a graph: read it
        before the next step)."""
        return self._step(self.bucket([s for s, _, _ in rows]), rows)

    def warm(self, bucket: int) -> None:
        """One step of bucket `bucket` with every row idle (each writes only its slot's scratch position,
        which no request reads): on CUDA its graph is captured here, at start (engine/runtime/warmup.py),
        not in a user's request."""
        if bucket not in self.buckets:
            raise ValueError(f"no decode bucket {bucket} (buckets: {self.buckets})")
        self._step(bucket, [])

    def ahead(self, rows: list[tuple[int, int]], tokens: torch.Tensor) -> torch.Tensor:
        """The next step launched before the host has read this step's tokens: rows (slot, index) and
        `tokens` [len(rows)] (long, on the device: the step's sampled and agreed tokens, row i's fed at its
        slot's `index`). The tokens go from device to the step's buffer, so the device runs this forward
        while the host reads them and decides whether every request goes on with its token (the scheduler
        uses the logits then, else runs its step anew: the same positions written again). Returns the
        logits as `__call__` does."""
        b = self.bucket([s for s, _ in rows])
        self._fill([(s, 0, index) for s, index in rows], dest=[s for s, _ in rows])
        # a slice of a static buffer as the index: no allocation (tokens of rows past len(rows) stay 0)
        self._slots[0].index_copy_(0, self._slots[3, :len(rows)], tokens)
        return self._replay(b)

    def _step(self, b: int, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        self._fill(rows)
        return self._replay(b)

    def _fill(self, rows: list[tuple[int, int, int]], dest: list[int] = ()) -> None:
        """The slots' buffer set from the host: each row's (slot, token, index); `dest`: the slots whose
        tokens an `ahead` step copies in (row 3)."""
        host = self._host_np
        if self._copied is not None:
            self._copied.synchronize()        # the previous copy has read the pinned buffer (it has, by now)
        host[0], host[1], host[2] = 0, self.scratch, 1           # idle rows
        for s, token, index in rows:
            host[0, s], host[1, s], host[2, s] = token, index, index + 1
        host[3, :len(dest)] = dest
        # the whole buffer (4 x slots ints): one contiguous copy, asynchronous from pinned memory
        self._slots.copy_(self._host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()

    def _replay(self, b: int) -> torch.Tensor:
        self.forwards += 1
        if self.use_graph:
            # a graph per LoRA mode of the slots (decided when a request takes or leaves its slot)
            return self.graphs.replay(("decode", b) + self.key + lora_key(mode_of(self.adapters)),
                                      lambda: self._forward(b), warmup=2)
        return self._forward(b)

    def _forward(self, b: int) -> torch.Tensor:
        m, cache = self.model, self._views[b]
        token, index, length = self._slots[0, :b].view(b, 1), self._slots[1, :b].view(b, 1), self._slots[2, :b]
        lora = None if self.adapters is None else self.adapters.rows(slice(0, b))
        batch = m.row_batch(index, self.pos, self._rows[:b], cache.max_len, length, lora)
        h = m.backbone(m.transformer.embed(token), batch, cache, self.view)
        return m.transformer.logits(h[:, -1], self.view)

