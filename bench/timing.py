"""How every suite times: `time_ms(fn, how=...)`, the median milliseconds of one call, and `Stages`, the
wall-clock marks of one chained run (a whole request).

The ways of timing a call (on the CPU, in --dry runs, each is the host's wall time):

  wall    perf_counter around a call with the device synced before and after: what a caller waits for,
          host work and launches included (a decode token with its host read, a prefill, a DiT step)
  host    perf_counter around the call alone, the device synced before and after but not waited on
          inside: the host time to issue it (a host-bound prefill). `setup` runs untimed before each call
          (queue GPU work ahead so that nothing in the call waits on the GPU)
  events  CUDA events around groups of back-to-back calls (~3 ms a group): an op's eager time at its
          launch rate, as an eager loop sees it
  bench   triton.testing.do_bench: L2 flushed between calls (weights read from HBM, as in a model whose
          layers do not fit L2), the median
  graph   fn captured once in a CUDA graph (after a warm-up run on a side stream, as capture requires),
          the graph replayed, its GPU time by events: what a captured loop pays, kernel time and the gaps
          between kernels, no host launch cost. fn may run several calls (layers with their own weights);
          `per` divides the time among them.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

HOW = ("wall", "host", "events", "bench", "graph")


def _cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], how: str = "bench", n: int = 7, warmup: int = 1, per: int = 1,
            setup: Callable[[], object] | None = None) -> float:
    """Median milliseconds of one call of `fn` (of one of `per` calls fn makes), measured `how`; `n` timed
    runs (trials for events and graph, calls for wall and host; do_bench picks its own count) after
    `warmup` untimed ones."""
    if how not in HOW:
        raise ValueError(f"how={how!r}: one of {HOW}")
    if not _cuda() or how in ("wall", "host"):
        return _host_ms(fn, n, warmup, setup, wait=how != "host" or not _cuda()) / per
    if how == "bench":
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=60, return_mode="median") / per
    if how == "events":
        return _events_ms(fn, n) / per
    return _graph_ms(fn, n) / per


def _host_ms(fn, n: int, warmup: int, setup, wait: bool) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        sync()
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if wait:
            sync()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def _events_ms(fn, trials: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    group = max(1, min(2000, int(3.0 / max(start.elapsed_time(end), 1e-6))))     # ~3 ms of calls a group
    times = []
    for _ in range(trials):
        start.record()
        for _ in range(group):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / group)
    return statistics.median(times)


def _graph_ms(fn, replays: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    try:
        return _events_ms(graph.replay, replays)
    finally:
        del graph


class Stages:
    """Wall-clock seconds of the stages of one run, timed once in order (`with clock("prefill"): ...`),
    the device synced at each stage's end: a request chained stage by stage."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> "Stages":
        self._name = name
        return self

    def __enter__(self) -> "Stages":
        sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync()
        self.seconds[self._name] = time.perf_counter() - self._t0

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
