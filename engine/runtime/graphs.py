"""The engine's CUDA graphs: one owner, one key space, each key captured once for the owner's life.

A key names what a graph runs: `(phase, bucket, rows, ...)`, e.g. ("decode", 4, 8, storage) for the
batched AR decode step at the 4-row bucket of an 8-slot KV storage, ("prefill", 256, storage) for a
prompt-length bucket. The first `replay(key, forward)` warms `forward` up on a side stream, captures it
and keeps (graph, output); every later call with that key only replays. The graphs of one lane share a
memory pool: a lane runs them one after the other on one stream, and each output is read before the next
replay (a graph's output tensor stays alive with its entry, so no later capture takes its memory). The
denoise steps' graphs are a lane of their own (`lane`): the overlap step policy replays them on a second
stream beside the AR steps' (engine/runtime/lanes.py), where a shared pool would let one overwrite the
other's intermediates.

A graph replays the kernels it recorded on the tensors it recorded: whatever a step varies (its
inputs, per-request tables) lives in static buffers that the caller fills before each replay. The
buffers a key's step reads are kept here with its graph (`buffers(key, make)`), so every request of
that key fills the same ones and the graph outlives the request that captured it.

A capture that fails raises `GraphCaptureError` naming the key. On CUDA the graph IS how the step runs
(an eager decode step costs thousands of launches from Python, about 10x the replay); falling back
silently would hide that behind a correct result. Whether a step CAN be captured (every collective on
NCCL or of size one) is the caller's decision, made before asking for a graph.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Hashable, TypeVar

import torch

T = TypeVar("T")


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured; the message names its key."""


def lane(key: Hashable) -> str:
    """The lane whose memory pool a key's graph takes: "image" for the denoise steps, "ar" for the rest."""
    return "image" if isinstance(key, tuple) and key[:1] == ("denoise",) else "ar"


class Graphs:
    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.captures: collections.Counter = collections.Counter()   # key -> how often it was captured (tests)
        self._pools: dict[str, Any] = {}                              # lane -> its graphs' memory pool
        self._buffers: dict[Hashable, Any] = {}
        self._recent: collections.OrderedDict[tuple, None] = collections.OrderedDict()   # least recent first

    def capturable(self, model: Any) -> bool:
        """Whether this model's steps can be captured: on CUDA in bf16. In fp32/fp16 the `moe` op runs its
        reference, whose torch._grouped_mm copies to the host (not capturable), so those steps run eagerly:
        decided up front, not by a failed capture. `model`: a HunyuanImage3 (its device and dtype)."""
        return model.device.type == "cuda" and model.dtype == torch.bfloat16

    def buffers(self, key: Hashable, make: Callable[[], T]) -> T:
        """The static buffers `key`'s graph reads (made by `make()` at the first call, outside any capture),
        kept and dropped with its graph."""
        if key not in self._buffers:
            self._buffers[key] = make()
        return self._buffers[key]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def replay(self, key: Hashable, forward: Callable[[], Any], warmup: int = 1, shared: bool = True) -> Any:
        """Run `forward`'s graph for `key` (captured at the first call) and return its output buffers.
        `shared=False`: a memory pool of its own, freed with the graph (one dropped after its request)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._capture(key, forward, warmup, shared)
        entry[0].replay()          # capture records the kernels; only a replay runs them
        return entry[1]

    def _capture(self, key: Hashable, forward: Callable[[], Any], warmup: int,
                 shared: bool) -> tuple[torch.cuda.CUDAGraph, Any]:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):          # lazy initialisations (kernel autotuning, workspaces) first
                for _ in range(warmup):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            if shared and lane(key) not in self._pools:
                self._pools[lane(key)] = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: the capture forbids unsafe CUDA calls in this thread only. In the default ("global")
            # mode a call such as an event's synchronize or query in ANY thread of the process invalidates the
            # capture, and the worker's sender thread waits on the events of earlier requests' pixels and
            # timings (engine/serve/worker.py `Sender`, images.HostPixels, span.py) while the loop captures a
            # graph for a new key (PyTorch's NCCL watchdog hit the same: pytorch/pytorch#104487)
            with torch.cuda.graph(graph, pool=self._pools[lane(key)] if shared else None,
                                  capture_error_mode="thread_local"):
                out = forward()
        except Exception as e:  # noqa: BLE001 - whatever failed, the key says which graph
            raise GraphCaptureError(f"CUDA-graph capture of {key} failed: {type(e).__name__}: {e}") from e
        self.captures[key] += 1
        return graph, out

    def graph(self, key: Hashable) -> torch.cuda.CUDAGraph:
        """The captured graph of `key` (to replay it alone, e.g. under a profiler)."""
        return self._entries[key][0]

    def drop(self, keep: Callable[[Hashable], bool]) -> None:
        """Forget the graphs whose key `keep` refuses (their storage was replaced, or their request ended)."""
        for key in [k for k in {**self._buffers, **self._entries} if not keep(k)]:
            self._entries.pop(key, None)
            self._buffers.pop(key, None)

    @property
    def recent(self) -> list[tuple]:
        """The keys given to `keep_recent` whose graphs are kept, least recently used first."""
        return list(self._recent)

    def keep_recent(self, key: tuple, n: int) -> None:
        """`key` was used now: of the keys given here, the `n` most recently used keep their graphs and
        buffers, with every key that extends one (a step key's batched keys); an older one's are dropped."""
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > n:
            old, _ = self._recent.popitem(last=False)
            self.drop(lambda k: k[:len(old)] != old)
