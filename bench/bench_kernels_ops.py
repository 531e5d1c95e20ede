"""The small fused ops of the hot loops at the real shapes: reference (plain PyTorch on the GPU, today's
engine code) vs the Triton path, each fast path checked against its reference on fresh random inputs
first (outputs drawn from NaN-filled memory, so an unwritten element fails the check).

    python bench/bench_kernels_ops.py            # one H200: well under a minute
    python bench/bench_kernels_ops.py --dry      # CPU, Triton interpreter, tiny shapes: the script runs

Times are medians (CUDA events around back-to-back eager calls, launch cost included); `graph` is the
same call replayed from a CUDA graph (what the decode loop pays). GB/s counts the bytes each op must
move at least (inputs read once, outputs written once) at the better of the two times, and `floor`
its fraction of the ~4.3 TB/s copy rate (meaningful for the denoise sizes; the decode sizes are
latency, their inputs sit in L2).
`launches` counts the CUDA kernels of one call (torch.profiler). Details go to $OUT/ if set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before Triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                      # noqa: E402
from kernels import norm, rope, sampling            # noqa: E402

FLOOR_GBS = 4300.0
EPS = 1e-5
HIDDEN, HEAD_DIM, GROUP, VOCAB = 4096, 128, 4, 133120


def cuda_us(fn, trials: int = 7) -> float:
    """Median us per call over `trials` groups of back-to-back calls between two CUDA events (eager
    calls: a launch-bound op is timed at its launch rate, as the engine's eager loop sees it)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    n = max(5, min(2000, int(3e3 / max(start.elapsed_time(end) / 5 * 1e3, 1e-3))))   # ~3 ms per group
    times = []
    for _ in range(trials):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(times)


def timer(dev: str):
    if dev == "cuda":
        return cuda_us

    def t_cpu(fn) -> float:
        fn()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)
    return t_cpu


def graph_time(fn, dev: str, reps: int = 20) -> float | None:
    """us per call replayed from one CUDA graph of `reps` calls (None off CUDA or if capture fails)."""
    if dev != "cuda":
        return None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        return cuda_us(g.replay) / reps
    except Exception as e:  # report, keep benching
        print(f"graph capture failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def launches(fn, dev: str) -> int | None:
    if dev != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def poison(dev: str, *sizes_dtypes) -> None:
    """NaN into the allocator's free blocks of these sizes: the next outputs of these sizes start NaN."""
    bufs = [torch.full(s, float("nan"), dtype=d, device=dev) for s, d in sizes_dtypes]
    del bufs


def check(name: str, got, want, dtype) -> str:
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]
    for a, b in zip(got, want):
        b = b.contiguous()
        if a.shape != b.shape or not torch.isfinite(a).all():
            return "FAIL (shape or unwritten)"
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
            return f"FAIL (max err {float((a.float() - b.float()).abs().max()):.3g})"
    return "ok"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="CPU + Triton interpreter at tiny shapes")
    args = ap.parse_args()
    dev = "cpu" if args.dry else "cuda"
    if args.dry:
        from kernels._triton import prepare_interpreter
        prepare_interpreter()
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --dry)")
    H, D, V = (256, 16, 3000) if args.dry else (HIDDEN, HEAD_DIM, VOCAB)
    norm_rows = (1, 5) if args.dry else (1, 4098, 8196)
    rope_shapes = ([(1, 1, 2), (2, 3, 2)] if args.dry else
                   [(1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 2049, 2), (2, 4098, 2), (2, 4098, 8)])
    dt = torch.bfloat16
    bench = timer(dev)
    g = torch.Generator(dev).manual_seed(0)
    rows_out: list[dict] = []

    def fast(op, *a):
        return kernels.call(op, *a) if dev == "cuda" else FAST_CPU[op](*a)

    def row(op, shape, nbytes, ref_fn, fast_fn, status, graph=True):
        r = dict(op=op, shape=shape, status=status, bytes=nbytes)
        r["ref_us"], r["fast_us"] = bench(ref_fn), bench(fast_fn)
        r["ref_graph_us"] = graph_time(ref_fn, dev) if graph else None
        r["graph_us"] = graph_time(fast_fn, dev) if graph else None
        r["launches_ref"], r["launches_fast"] = launches(ref_fn, dev), launches(fast_fn, dev)
        best = min(t for t in (r["fast_us"], r["graph_us"]) if t is not None)
        r["gbs"] = nbytes / best / 1e3
        rows_out.append(r)

    if dev == "cuda":
        for op in ("rms_norm", "add_rms_norm", "rope_qk_norm", "rope_qk_norm_cache"):
            assert kernels.chosen(op, dev, dt) == "triton", op
        assert kernels.chosen("sample", dev, torch.float32) == "triton"

    # ---- norms: [rows, 4096] bf16
    w = (torch.randn(H, generator=g, device=dev) * 0.2 + 1).to(dt)
    for rows in norm_rows:
        x = torch.randn(rows, H, generator=g, device=dev).to(dt)
        r = torch.randn(rows, H, generator=g, device=dev).to(dt)
        poison(dev, ((rows, H), dt))
        st = check("rms_norm", fast("rms_norm", x, w, EPS), norm.rms_norm_ref(x, w, EPS), dt)
        row("rms_norm", f"{rows}x{H}", 2 * rows * H * 2 + H * 2,
            lambda: norm.rms_norm_ref(x, w, EPS), lambda: fast("rms_norm", x, w, EPS), st)
        poison(dev, ((rows, H), dt), ((rows, H), dt))
        got = fast("add_rms_norm", x, r, w, EPS)
        want = norm.add_rms_norm_ref(x, r, w, EPS)
        st = check("add_rms_norm", got, want, dt)
        if st == "ok" and not torch.equal(got[1], want[1]):
            st = "FAIL (residual sum differs)"
        row("add_rms_norm", f"{rows}x{H}", 4 * rows * H * 2 + H * 2,
            lambda: norm.add_rms_norm_ref(x, r, w, EPS), lambda: fast("add_rms_norm", x, r, w, EPS), st)

    # ---- RoPE + q/k norm (+ cache write): [B, T, kv, g + 2, D] bf16
    for B, T, kv in rope_shapes:
        qkv = torch.randn(B, T, kv * (GROUP + 2) * D, generator=g, device=dev).to(dt).view(B, T, kv, GROUP + 2, D)
        ang = torch.rand(T, D, generator=g, device=dev) * 6.28
        cos, sin = ang.cos(), ang.sin()
        qw = (torch.randn(D, generator=g, device=dev) * 0.2 + 1).to(dt)
        kw = (torch.randn(D, generator=g, device=dev) * 0.2 + 1).to(dt)
        max_len = T + 64
        ck = torch.full((B, kv, max_len, D), float("nan"), dtype=dt, device=dev)
        cv = torch.full_like(ck, float("nan"))
        index = torch.randperm(max_len, generator=g, device=dev)[:T] if dev == "cpu" else \
            torch.randperm(max_len, device=dev)[:T]
        poison(dev, ((B, kv * GROUP, T, D), dt), ((B, kv, T, D), dt), ((B, kv, T, D), dt))
        want = rope.rope_qk_norm_ref(qkv, cos, sin, qw, kw, EPS)
        st = check("rope", fast("rope_qk_norm", qkv, cos, sin, qw, kw, EPS), want, dt)
        nbytes = 2 * qkv.numel() * 2 + 2 * T * D * 4 + 2 * D * 2
        shape = f"B{B} T{T} kv{kv}"
        row("rope_qk_norm", shape, nbytes, lambda: rope.rope_qk_norm_ref(qkv, cos, sin, qw, kw, EPS),
            lambda: fast("rope_qk_norm", qkv, cos, sin, qw, kw, EPS), st)
        q = fast("rope_qk_norm_cache", qkv, cos, sin, qw, kw, EPS, ck, cv, index)
        st = check("rope_cache", (q, ck[:, :, index], cv[:, :, index]), want, dt)
        rest = torch.ones(max_len, dtype=torch.bool, device=dev)
        rest[index] = False
        if st == "ok" and not (ck[:, :, rest].isnan().all() and cv[:, :, rest].isnan().all()):
            st = "FAIL (wrote outside index)"
        row("rope_qk_norm_cache", shape, nbytes + T * 8,
            lambda: rope.rope_qk_norm_cache_ref(qkv, cos, sin, qw, kw, EPS, ck, cv, index),
            lambda: fast("rope_qk_norm_cache", qkv, cos, sin, qw, kw, EPS, ck, cv, index), st)

    # ---- sampling: V = 133120 fp32, the engine's defaults; plus the sampler before the op (a full sort)
    def choose_before(x, temperature, top_k, top_p, generator):
        x = x / temperature
        x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
        sorted_x, order = x.sort(descending=False)
        drop = sorted_x.softmax(-1).cumsum(-1) <= (1 - top_p)
        drop[-1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        return torch.multinomial(x.softmax(-1), 1, generator=generator)[0]
    logits = (torch.randn(V, generator=g, device=dev) * 2.5).bfloat16().float()   # bf16 values: ties
    gen = torch.Generator(dev).manual_seed(1)
    for k, p in ((1024, 0.95), (1024, 1.0)):
        # same generator state -> same noise: the tokens agree unless two scores round differently
        misses = sum(int(fast("sample", logits, 0.6, k, p, torch.Generator(dev).manual_seed(seed))
                         != sampling.sample_ref(logits, 0.6, k, p, torch.Generator(dev).manual_seed(seed)))
                     for seed in range(20))
        st = "ok" if misses <= 1 else f"FAIL ({misses}/20 tokens differ)"
        row("sample", f"V{V} k{k} p{p}", V * 4 * 2, lambda: sampling.sample_ref(logits, 0.6, k, p, gen),
            lambda: fast("sample", logits, 0.6, k, p, gen), st, graph=False)
    for name, fn in (("sampler before", lambda: choose_before(logits, 0.6, 1024, 0.95, gen)),
                     ("torch.topk alone", lambda: logits.topk(1024))):
        rows_out.append(dict(op=name, shape=f"V{V} k1024 p0.95", status="-", bytes=V * 8, ref_us=bench(fn),
                             fast_us=None, graph_us=None, ref_graph_us=None, launches_ref=launches(fn, dev),
                             launches_fast=None, gbs=None))

    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "bench_kernels_ops.json").write_text(json.dumps(dict(
            device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry)", rows=rows_out), indent=1))

    def f(v, spec="8.1f"):
        return format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))
    print(f"\n{'op':<20}{'shape':<18}{'ref us':>9}{'fast us':>9}{'ref gr':>9}{'fast gr':>9}{'x':>6}"
          f"{'GB/s':>8}{'floor':>7}{'launch':>8}  check")
    for r in rows_out:
        sp = r["ref_us"] / r["fast_us"] if r["fast_us"] else None
        frac = r["gbs"] / FLOOR_GBS if r["gbs"] else None
        la = f"{r['launches_ref'] or '-'}/{r['launches_fast'] or '-'}" if dev == "cuda" else "-"
        print(f"{r['op']:<20}{r['shape']:<18}{f(r['ref_us'], '9.1f')}{f(r['fast_us'], '9.1f')}{f(r['ref_graph_us'], '9.1f')}"
              f"{f(r['graph_us'], '9.1f')}{f(sp, '6.1f')}{f(r['gbs'], '8.0f')}{f(frac, '7.0%') if frac else '      -'}"
              f"{la:>8}  {r['status']}")
    bad = [r for r in rows_out if r["status"].startswith("FAIL")]
    if bad:
        sys.exit(f"{len(bad)} fast path(s) differ from the reference")


# the Triton functions themselves, for --dry (the registry picks them only on CUDA)
FAST_CPU = {"rms_norm": norm.rms_norm_triton, "add_rms_norm": norm.add_rms_norm_triton,
            "rope_qk_norm": rope.rope_qk_norm_triton, "rope_qk_norm_cache": rope.rope_qk_norm_cache_triton,
            "sample": sampling.sample_triton}

if __name__ == "__main__":
    main()
