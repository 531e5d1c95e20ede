"""Where the rest of a quantized decode token goes (issue 17: MXFP4 Distil at tp1, one H200):

    python bench/bench_decode_parts.py [--sections sample,topk,moe]

sample: the `sample` op on the 133120 logits (temperature 0.6, top-k 1024, top-p 0.95, the engine's
    defaults) as a decode step pays it, outside the graph: wall time per call with its one host read,
    its parts (torch.topk(1024) over the vocabulary, a two-stage top-k over 2048-wide slices, the
    noise), and a profile of a few calls.
topk: kernels.sampling.topk_desc (the Triton radix-select top-k of sample_device) against torch.topk at
    V = 133120, k 1024 / 4096: a check on fresh random, tie-heavy (bf16-rounded) and -inf-padded logits
    (outputs poisoned first), GPU us by do_bench and per call inside a CUDA graph of 20 calls (no host
    launch cost), a sweep of the chunk per program, and the whole `sample` op + int() on each top-k.
moe: one MoE layer's decode (`moe_quant`, MXFP4 experts + MXFP8 shared MLP, tp1, 1 token) x 32 layers
    (distinct weights, so L2 holds none of them), captured as ONE CUDA graph as the decode step is, for
    a few GEMV tiles of quant_gemv.DECODE_UP / DECODE_DOWN: microseconds per layer and GB/s of the weight
    bytes read (8 chosen experts + the shared MLP). Also with the shared MLP on the main stream.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                   # noqa: E402
import kernels.quant as kq                       # noqa: E402
from kernels import moe_quant, quant_gemv as qg  # noqa: E402
from graph_timing import graph_replay_ms         # noqa: E402

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


def _graph_us(fn, calls: int = 20) -> float:
    """GPU microseconds per call of fn, captured `calls` times in one CUDA graph (no host launch cost)."""
    return graph_replay_ms([fn] * calls) * 1e3 / calls


def _topk_logits(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    rnd = torch.randn(V, generator=g, device="cuda") * 3
    ties = (torch.randn(V, generator=g, device="cuda") * 2.5).bfloat16().float() / 0.6
    padded = ties.clone()
    padded[127000:] = float("-inf")                # the vocabulary past the tokenizer, as the engine pads it
    few = torch.tensor([-1.0, 0.0, 0.5, 2.0], device="cuda")[torch.randint(0, 4, (V,), generator=g, device="cuda")]
    return {"random": rnd, "bf16 ties": ties, "-inf padded": padded, "4 levels": few}


def _topk_ok(x: torch.Tensor, k: int, vals: torch.Tensor, idx: torch.Tensor) -> bool:
    ref = x.topk(k).values
    return (torch.equal(vals, ref) and bool(((idx >= 0) & (idx < x.numel())).all())
            and idx.unique().numel() == k and torch.equal(x[idx], vals))


def topk_section() -> None:
    from triton.testing import do_bench

    from kernels import sampling
    print("\ntop-k of the V = 133120 logits: kernels.sampling.topk_desc (Triton radix select) vs torch.topk")
    details: dict = {"check": {}, "us": {}}
    bad = 0
    for seed in range(3):
        for name, x in _topk_logits(seed).items():
            for k in (1024, 4096, 1):
                junk = [torch.full((k,), float("nan"), device="cuda"), torch.full((k,), -1, device="cuda"),
                        torch.full((4, 33, 256), -1, dtype=torch.int32, device="cuda")]
                del junk                                   # the outputs reuse these NaN / -1 blocks
                for chunk in ((2048, 4096, 8192) if k == 1024 else (sampling.TOPK_CHUNK,)):
                    ok = _topk_ok(x, k, *sampling.topk_desc(x, k, chunk=chunk))
                    details["check"][f"{name} k={k} chunk={chunk} seed={seed}"] = ok
                    bad += not ok
    print(f"  check (values == torch.topk's, ids distinct and giving them): "
          f"{len(details['check']) - bad}/{len(details['check'])} ok")
    x = _topk_logits(9)["-inf padded"]
    rows = []
    for k in (1024, 4096):
        for label, fn in ((f"torch.topk k={k}", lambda k=k: x.topk(k)),
                          *((f"topk_desc k={k} chunk={c}", (lambda c=c, k=k: sampling.topk_desc(x, k, chunk=c)))
                            for c in (2048, 4096, 8192))):
            bench_us = do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
            try:
                graph_us = _graph_us(fn)
            except Exception as e:                         # noqa: BLE001  report, keep benching
                graph_us = float("nan")
                print(f"  {label}: graph capture failed: {type(e).__name__}: {e}")
            rows.append((label, bench_us, graph_us))
            details["us"][label] = {"do_bench": bench_us, "graph": graph_us}
    g = torch.Generator("cuda").manual_seed(0)
    wall = {}
    for impl in ("torch", "triton"):
        sampling.TOPK = impl
        try:
            wall[impl] = wall_ms(lambda: int(kernels.call("sample", x, 0.6, 1024, 0.95, g, False, None)), n=50)
            wall[impl + " gpu"] = do_bench(lambda: sampling.sample_device(x / 0.6, 1024, 0.95, g),
                                           warmup=10, rep=50, return_mode="median") * 1e3
        finally:
            sampling.TOPK = "triton"
    details["sample"] = wall
    # bytes: 4 digit passes + the compact pass read x (L2-resident in decode); the histograms are extra
    nbytes = 5 * V * 4
    print(f"\n  {'GPU us per call':<34}{'do_bench':>10}{'in graph':>10}{'GB/s (5 reads of x, graph)':>30}")
    for label, bench_us, graph_us in rows:
        rate = "" if "torch" in label else f"{nbytes / (graph_us * 1e-6) / 1e9:12.0f}"
        print(f"  {label:<34}{bench_us:10.1f}{graph_us:10.1f}{rate:>30}")
    print(f"  sample op + int() (wall ms), top-k by torch: {wall['torch']:.3f}, by Triton: {wall['triton']:.3f}; "
          f"sample_device GPU us (do_bench) {wall['torch gpu']:.1f} -> {wall['triton gpu']:.1f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "topk.json").write_text(json.dumps(details, indent=1))
    assert bad == 0, [c for c, ok in details["check"].items() if not ok]


def moe_section() -> None:
    gen = torch.Generator("cuda").manual_seed(1)
    layers = []
    for i in range(LAYERS):
        w1 = kq.random_qweight("mxfp4", (1, E, 2 * I, H), H ** -0.5, "cuda", gen)
        w2 = kq.random_qweight("mxfp4", (E, H, I), I ** -0.5, "cuda", gen)
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
        ms = graph_replay_ms([step])
        us = ms * 1e3 / LAYERS
        print(f"  {label:<44}{us:8.1f} us/layer {nbytes / (us * 1e-6) / 1e9:7.0f} GB/s", flush=True)

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
        {"sample": sample_section, "topk": topk_section, "moe": moe_section}[s]()


if __name__ == "__main__":
    main()
