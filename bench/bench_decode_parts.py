"""Where the rest of a quantized decode token goes (issue 17: MXFP4 Distil at tp1, one H200):

    python bench/bench_decode_parts.py [--sections sample,moe]

sample: the `sample` op on the 133120 logits (temperature 0.6, top-k 1024, top-p 0.95, the engine's
    defaults) as a decode step pays it, outside the graph: wall time per call with its one host read,
    its parts (torch.topk(1024) over the vocabulary, a two-stage top-k over 2048-wide slices, the
    noise), and a profile of a few calls.
moe: one MoE layer's decode (`moe_quant`, MXFP4 experts + MXFP8 shared MLP, tp1, 1 token) x 32 layers
    (distinct weights, so L2 holds none of them), captured as ONE CUDA graph as the decode step is, for
    a few GEMV tiles of quant_gemv.DECODE_UP / DECODE_DOWN: microseconds per layer and GB/s of the weight
    bytes read (8 chosen experts + the shared MLP). Also with the shared MLP on the main stream.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                   # noqa: E402
import kernels.quant as kq                       # noqa: E402
from kernels import moe_quant, quant_gemv as qg  # noqa: E402

V, H, E, K, I = 133120, 4096, 64, 8, 3072
LAYERS = 32


def wall_ms(fn, n: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[n // 2]


def sample_section() -> None:
    from triton.testing import do_bench
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(V, device="cuda") * 3
    print("\nsample op, V = 133120 (wall ms per call incl. the host read | GPU ms by do_bench)")
    full = lambda: int(kernels.call("sample", x, 0.6, 1024, 0.95, g, False, None))    # noqa: E731
    print(f"  sample + int()            {wall_ms(full):8.3f}")
    parts = {
        "x / temperature": lambda: x / 0.6,
        "torch.topk(1024)": lambda: x.topk(1024),
        "two-stage topk (65x2048)": lambda: _two_stage(x, 1024),
        "exponential_ noise": lambda: torch.empty_like(x).exponential_(1, generator=g),
    }
    for name, fn in parts.items():
        print(f"  {name:<26}{wall_ms(fn):8.3f} | {do_bench(fn, warmup=5, rep=30, return_mode='median'):.4f}")
    a, b = x.topk(1024), _two_stage(x, 1024)
    print(f"  two-stage topk equals torch.topk (values): {torch.equal(a.values, b[0])}, "
          f"ids give the values: {torch.equal(x[b[1]], b[0])}")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            full()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=50))
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=50))


def _two_stage(x: torch.Tensor, k: int):
    w = 2048
    n = -(-x.numel() // w)
    pad = torch.full((n * w,), float("-inf"), device=x.device)
    pad[: x.numel()] = x
    v1, i1 = pad.view(n, w).topk(k, dim=1)
    v2, i2 = v1.flatten().topk(k)
    base = (torch.arange(n, device=x.device) * w)[:, None]
    return v2, (i1 + base).flatten()[i2]


def moe_section() -> None:
    gen = torch.Generator("cuda").manual_seed(1)
    layers = []
    for i in range(LAYERS):
        w1 = kq.random_qweight("mxfp4", (1, E, 2 * I, H), H ** -0.5, "cuda", gen)
        w2 = kq.random_qweight("mxfp4", (1, E, H, I), I ** -0.5, "cuda", gen)
        s1 = kq.random_qweight("mxfp8", (1, 2 * I, H), H ** -0.5, "cuda", gen)
        s2 = kq.random_qweight("mxfp8", (H, I), I ** -0.5, "cuda", gen)
        gate = torch.randn(E, H, device="cuda", generator=gen) * H ** -0.5
        layers.append((gate, w1, w2, s1, s2))
    x = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    nbytes = (K * (2 * I * H + H * I) * (4 + 8 / 32) + (2 * I * H + H * I) * (8 + 8 / 32)) / 8

    def step():
        y = x
        for gate, w1, w2, s1, s2 in layers:
            y = moe_quant.moe_quant_cuda(x, gate, w1, w2, s1, s2, 0, 1, K, True) + y
        return y

    def timed(label: str) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[5]
        us = ms * 1e3 / LAYERS
        print(f"  {label:<44}{us:8.1f} us/layer {nbytes / (us * 1e-6) / 1e9:7.0f} GB/s", flush=True)
        del graph

    print(f"\nMoE decode layer (MXFP4 experts + MXFP8 shared, tp1, 1 token) x {LAYERS} in one graph, "
          f"{nbytes / 1e6:.0f} MB of weights a layer")
    up0, down0 = dict(qg.DECODE_UP), dict(qg.DECODE_DOWN)
    timed(f"default up {up0} down {down0}")
    side = moe_quant._side_stream
    moe_quant._side_stream = lambda dev: None      # noqa: E731  no side stream: the shared MLP runs serially
    try:
        timed("shared MLP on the main stream (no side branch)")
    finally:
        moe_quant._side_stream = side
    for up in (dict(BI=16, G=32, num_warps=8), dict(BI=4, G=32, num_warps=4), dict(BI=8, G=32, num_warps=4),
               dict(BI=16, G=32, num_warps=4), dict(BI=8, G=16, num_warps=4)):
        qg.DECODE_UP.clear()
        qg.DECODE_UP.update(up)
        timed(f"up {up}")
    qg.DECODE_UP.clear()
    qg.DECODE_UP.update(up0)
    for down in (dict(R=32, G=32, num_warps=8), dict(R=8, G=32, num_warps=4), dict(R=16, G=32, num_warps=4),
                 dict(R=32, G=32, num_warps=4), dict(R=16, G=16, num_warps=8)):
        qg.DECODE_DOWN.clear()
        qg.DECODE_DOWN.update(down)
        timed(f"down {down}")
    qg.DECODE_DOWN.clear()
    qg.DECODE_DOWN.update(down0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="sample,moe")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for s in args.sections.split(","):
        {"sample": sample_section, "moe": moe_section}[s]()


if __name__ == "__main__":
    main()
