"""One CUDA-graph timing for the benches: the calls captured in order in one graph (after a warm-up run
on a side stream, as capture requires), the graph replayed, its GPU time measured with events. What a
decode loop pays per call: kernel time and the gaps between kernels, no host launch cost."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def graph_replay_ms(calls: Sequence[Callable[[], object]], replays: int = 11) -> float:
    """Median milliseconds of one replay of a graph holding `calls` once each, in order."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]
