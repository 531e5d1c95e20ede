"""The small fused ops of the hot loops at the real shapes: the reference (plain PyTorch on the GPU) vs
the Triton variant the registry picks, each variant checked against its reference on fresh random inputs
first (outputs drawn from NaN-filled memory, so an unwritten element fails the check).

    python -m bench kernels-ops            # one H200: well under a minute
    python -m bench kernels-ops --dry      # CPU, Triton interpreter, tiny shapes: the suite runs

Times are medians (CUDA events around back-to-back eager calls, launch cost included); `graph` is the
same call replayed from a CUDA graph of 20 calls (what the decode loop pays). GB/s counts the bytes each
op must move at least (inputs read once, outputs written once) at the better of the two times, and
`floor` its fraction of the ~4.3 TB/s copy rate (meaningful for the denoise sizes; the decode sizes are
latency, their inputs sit in L2). `launches` counts the CUDA kernels of one call (torch.profiler).
Also the sampler the `sample` op replaced (a full sort) and torch.topk(1024) alone, for scale.
"""
from __future__ import annotations

import argparse

import torch

from hunyuan_kernels import norm, rope, sampling

from .. import variants
from ..checks import nan_blocks
from ..report import Col, Output
from ..timing import time_ms

DRY = True
FLOOR_GBS = 4300.0
EPS = 1e-5
HIDDEN, HEAD_DIM, GROUP, VOCAB = 4096, 128, 4, 133120
OPS = ("rms_norm", "add_rms_norm", "rope_qk_norm", "rope_qk_norm_cache")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    pass


def us(fn, how: str) -> float | None:
    """Microseconds of one call (events) or of one of 20 calls in a CUDA graph (None off CUDA or where
    the capture fails: reported, the suite goes on). Off CUDA (--dry) one call: it shows the call runs."""
    if not torch.cuda.is_available():
        return None if how == "graph" else time_ms(fn, "wall", n=1, warmup=0) * 1e3
    if how == "graph":
        try:
            return time_ms(lambda: [fn() for _ in range(20)], "graph", per=20) * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"graph capture failed: {type(e).__name__}: {e}")
            return None
    return time_ms(fn, how) * 1e3


def launches(fn) -> int | None:
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def verdict(got, want, dtype) -> str:
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


def row(rows: list, op: str, shape: str, nbytes: int, ref, fast, status: str, graph: bool = True) -> None:
    r = dict(op=op, shape=shape, status=status, bytes=nbytes, ref_us=us(ref, "events"), fast_us=us(fast, "events"),
             ref_graph_us=us(ref, "graph") if graph else None, graph_us=us(fast, "graph") if graph else None,
             launches_ref=launches(ref), launches_fast=launches(fast))
    best = min(t for t in (r["fast_us"], r["graph_us"]) if t is not None)
    r["gbs"] = nbytes / best / 1e3
    r["speedup"] = r["ref_us"] / r["fast_us"]
    r["floor"] = r["gbs"] / FLOOR_GBS
    rows.append(r)


def norms(rows: list, dev: str, dt: torch.dtype, H: int, sizes: tuple, g: torch.Generator) -> None:
    """rms_norm and add_rms_norm on [rows, H]."""
    w = (torch.randn(H, generator=g, device=dev) * 0.2 + 1).to(dt)
    for n in sizes:
        x = torch.randn(n, H, generator=g, device=dev).to(dt)
        r = torch.randn(n, H, generator=g, device=dev).to(dt)
        fast = variants.runner("rms_norm", "triton", x, w, EPS)      # (runs once: poison after it)
        nan_blocks(dev, ((n, H), dt))
        st = verdict(fast(), norm.rms_norm_ref(x, w, EPS), dt)
        row(rows, "rms_norm", f"{n}x{H}", 2 * n * H * 2 + H * 2, lambda: norm.rms_norm_ref(x, w, EPS), fast, st)
        fast = variants.runner("add_rms_norm", "triton", x, r, w, EPS)
        nan_blocks(dev, ((n, H), dt), ((n, H), dt))
        got, want = fast(), norm.add_rms_norm_ref(x, r, w, EPS)
        st = verdict(got, want, dt)
        if st == "ok" and not torch.equal(got[1], want[1]):
            st = "FAIL (residual sum differs)"
        row(rows, "add_rms_norm", f"{n}x{H}", 4 * n * H * 2 + H * 2, lambda: norm.add_rms_norm_ref(x, r, w, EPS),
            fast, st)


def ropes(rows: list, dev: str, dt: torch.dtype, D: int, shapes: list, g: torch.Generator) -> None:
    """RoPE + q/k norm (+ the cache write) on qkv [B, T, kv, group + 2, D]."""
    for B, T, kv in shapes:
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
        want = rope.rope_qk_norm_ref(qkv, cos, sin, qw, kw, EPS)
        fast = variants.runner("rope_qk_norm", "triton", qkv, cos, sin, qw, kw, EPS)
        nan_blocks(dev, ((B, kv * GROUP, T, D), dt), ((B, kv, T, D), dt), ((B, kv, T, D), dt))
        st = verdict(fast(), want, dt)
        nbytes = 2 * qkv.numel() * 2 + 2 * T * D * 4 + 2 * D * 2
        shape = f"B{B} T{T} kv{kv}"
        row(rows, "rope_qk_norm", shape, nbytes, lambda: rope.rope_qk_norm_ref(qkv, cos, sin, qw, kw, EPS), fast, st)
        fast = variants.runner("rope_qk_norm_cache", "triton", qkv, cos, sin, qw, kw, EPS, ck, cv, index)
        ck.fill_(float("nan"))               # the runner's own call wrote the cache: NaN again before the check
        cv.fill_(float("nan"))
        nan_blocks(dev, ((B, kv * GROUP, T, D), dt))
        q = fast()
        st = verdict((q, ck[:, :, index], cv[:, :, index]), want, dt)
        rest = torch.ones(max_len, dtype=torch.bool, device=dev)
        rest[index] = False
        if st == "ok" and not (ck[:, :, rest].isnan().all() and cv[:, :, rest].isnan().all()):
            st = "FAIL (wrote outside index)"
        row(rows, "rope_qk_norm_cache", shape, nbytes + T * 8,
            lambda: rope.rope_qk_norm_cache_ref(qkv, cos, sin, qw, kw, EPS, ck, cv, index), fast, st)


def sample_before(x, temperature, top_k, top_p, generator):
    """The sampler before the `sample` op: top-k threshold, a full sort for top-p, multinomial."""
    x = x / temperature
    x = x.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
    sorted_x, order = x.sort(descending=False)
    drop = sorted_x.softmax(-1).cumsum(-1) <= (1 - top_p)
    drop[-1] = False
    x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)[0]


def samples(rows: list, dev: str, V: int, k: int, seeds: int, g: torch.Generator) -> None:
    """The `sample` op on V fp32 logits with the engine's defaults (top-k k); the same generator state gives
    the same noise, so the tokens agree unless two scores round differently (one miss in 20 allowed)."""
    logits = (torch.randn(V, generator=g, device=dev) * 2.5).bfloat16().float()   # bf16 values: ties
    gen = torch.Generator(dev).manual_seed(1)
    for p in (0.95, 1.0):
        misses = sum(int(variants.run("sample", "triton", logits, 0.6, k, p, torch.Generator(dev).manual_seed(seed))
                         != sampling.sample_ref(logits, 0.6, k, p, torch.Generator(dev).manual_seed(seed)))
                     for seed in range(seeds))
        st = "ok" if misses <= seeds // 20 else f"FAIL ({misses}/{seeds} tokens differ)"
        row(rows, "sample", f"V{V} k{k} p{p}", V * 4 * 2, lambda: sampling.sample_ref(logits, 0.6, k, p, gen),
            variants.runner("sample", "triton", logits, 0.6, k, p, gen), st, graph=False)
    for name, fn in (("sampler before", lambda: sample_before(logits, 0.6, k, 0.95, gen)),
                     ("torch.topk alone", lambda: logits.topk(k))):
        rows.append(dict(op=name, shape=f"V{V} k{k} p0.95", status="-", bytes=V * 8, ref_us=us(fn, "events"),
                         launches_ref=launches(fn)))


def run(args: argparse.Namespace, out: Output) -> bool:
    dev = "cpu" if args.dry else "cuda"
    dt = torch.bfloat16
    H, D, V = (256, 16, 3000) if args.dry else (HIDDEN, HEAD_DIM, VOCAB)
    if dev == "cuda":
        first = {op: variants.first(op, dev, dt) for op in OPS} | {"sample": variants.first("sample", dev, torch.float32)}
        out.say(f"the registry's first variants on CUDA: {first}")
        out.data["first"] = first
    g = torch.Generator(dev).manual_seed(0)
    rows: list[dict] = []
    norms(rows, dev, dt, H, (1, 5) if args.dry else (1, 4098, 8196), g)
    ropes(rows, dev, dt, D, [(1, 1, 2), (2, 3, 2)] if args.dry else
          [(1, 1, 2), (1, 1, 4), (1, 1, 8), (2, 2049, 2), (2, 4098, 2), (2, 4098, 8)], g)
    samples(rows, dev, V, 64 if args.dry else 1024, 3 if args.dry else 20, g)    # (the interpreter: small k)
    out.data["rows"] = rows
    out.table(rows, [Col("op", "op"), Col("shape", "shape"), Col("ref us", "ref_us", ".1f"),
                     Col("fast us", "fast_us", ".1f"), Col("ref graph", "ref_graph_us", ".1f"),
                     Col("fast graph", "graph_us", ".1f"), Col("x", "speedup", ".1f"), Col("GB/s", "gbs", ".0f"),
                     Col("floor", "floor", ".0%"),
                     Col("launches", lambda r: f"{r.get('launches_ref') or '-'}/{r.get('launches_fast') or '-'}"),
                     Col("check", "status")])
    bad = [r for r in rows if r["status"].startswith("FAIL")]
    if bad:
        out.say(f"{len(bad)} fast path(s) differ from the reference")
    return not bad
