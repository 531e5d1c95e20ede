"""The AR decode step's attention at the real shapes: the `decode_attention` op (Triton split-KV, the
length on the device) vs what the engine ran before it (SDPA over the whole static cache under a bool
mask, position-independent for the CUDA graph) and vs unmasked SDPA on the exact valid slice (what a
host-known length would allow; not graph-capturable across positions).

    python -m bench decode-attention          # one H200: well under a minute
    python -m bench decode-attention --dry    # CPU, Triton interpreter, tiny shapes, the checks only

q [1, 32, 1, 128], cache [1, 8, L, 128] bf16 (tp1; Hq 8 / Hkv 2 for tp4), L in (2017, 8192), valid
lengths 1251 and 2000. Each shape is first checked against an fp32 softmax on the valid slice at lengths
1, 1251, 2000 and the whole cache, the op's output drawn from NaN-filled memory. Times are medians of
triton.testing.do_bench (L2 flushed between calls: the cache is read from HBM, as in decode where 32
layers' caches do not fit L2); `graph` is the op replayed from a CUDA graph of 32 calls on 32 distinct
layer caches, per call (what the decode loop pays, launch gaps included). GB/s counts the floor, K and
V of the valid prefix read once (2 * Hkv * length * D * 2 bytes), and `floor` its fraction of the
~4.3 TB/s copy rate. A chunk sweep shows the split size's effect (the module's CHUNK is the default).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from hunyuan_kernels import decode_attention as da

from .. import variants
from ..checks import nan_blocks
from ..report import Col, Output
from ..timing import time_ms

DRY = True
FLOOR_GBS = 4300.0
D = 128


def add_arguments(ap: argparse.ArgumentParser) -> None:
    pass


def naive(q, k, v, n):
    """fp32 softmax attention on keys [0, n) (T = 1), GQA by repeat."""
    G = q.shape[1] // k.shape[1]
    kk = k[:, :, :n].float().repeat_interleave(G, 1)
    vv = v[:, :, :n].float().repeat_interleave(G, 1)
    return ((q.float() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])).softmax(-1) @ vv


def check(Hq: int, Hkv: int, L: int, n: int, dt: torch.dtype, device: str, seed: int) -> dict:
    g = torch.Generator(device).manual_seed(seed)
    q = torch.randn(1, Hq, 1, D, generator=g, device=device).to(dt)
    k = torch.randn(1, Hkv, L, D, generator=g, device=device).to(dt)
    v = torch.randn(1, Hkv, L, D, generator=g, device=device).to(dt)
    want = naive(q, k, v, n)
    splits = L // da.CHUNK + 1
    nan_blocks(device, ((1, Hq, 1, D), dt), ((Hkv, splits, Hq // Hkv, D), torch.float32))
    out = variants.run("decode_attention", "triton", q, k, v, torch.tensor([n], device=device))
    err = (out.float() - want).abs().max().item()
    return dict(Hq=Hq, Hkv=Hkv, L=L, length=n, max_abs_err=err, ok=bool(torch.isfinite(out).all()) and err < 2e-2)


def time_shape(Hq: int, Hkv: int, L: int, dt: torch.dtype, layers: int = 32) -> list[dict]:
    """The three attentions at one shape and the lengths 1251 / 2000, plus the op's chunk sweep."""
    ks = [torch.randn(1, Hkv, L, D, device="cuda", dtype=dt) for _ in range(layers)]
    vs = [torch.randn(1, Hkv, L, D, device="cuda", dtype=dt) for _ in range(layers)]
    q = torch.randn(1, Hq, 1, D, device="cuda", dtype=dt)
    rows = []
    for n in (1251, 2000):
        length = torch.tensor([n], device="cuda")
        mask = torch.arange(L, device="cuda")[None, :] < n          # [1, L]: the decode mask before the op
        floor_bytes = 2 * Hkv * n * D * 2
        forms = {
            "triton": lambda i: variants.runner("decode_attention", "triton", q, ks[i], vs[i], length),
            "sdpa_masked_whole": lambda i: (lambda: F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=mask,
                                                                                    enable_gqa=True)),
            "sdpa_slice": lambda i: (lambda: F.scaled_dot_product_attention(q, ks[i][:, :, :n], vs[i][:, :, :n],
                                                                             enable_gqa=True)),
        }

        def row(impl: str, us: float, graph_us: float | None) -> dict:
            return dict(Hq=Hq, Hkv=Hkv, L=L, length=n, impl=impl, us=us, graph_us=graph_us,
                        GBs=floor_bytes / us / 1e3, floor=floor_bytes / us / 1e3 / FLOOR_GBS)
        for name, make in forms.items():
            calls = [make(i) for i in range(layers)]
            rows.append(row(name, time_ms(calls[0], "bench") * 1e3,
                            time_ms(lambda: [c() for c in calls], "graph", per=layers) * 1e3))
        for chunk in (32, 128, 256):
            rows.append(row(f"triton chunk {chunk}",
                            time_ms(lambda c=chunk: da.launch(q, ks[0], vs[0], length, chunk=c), "bench") * 1e3, None))
    return rows


def run(args: argparse.Namespace, out: Output) -> bool:
    dev = "cpu" if args.dry else "cuda"
    dt = torch.bfloat16
    if not args.dry:
        out.say(f"the registry's first decode_attention variant on CUDA: {variants.first('decode_attention', dev, dt)}")
    shapes = [(8, 2, 130, (1, 77, 130))] if args.dry else [
        (Hq, Hkv, L, (1, 1251, 2000, L)) for Hq, Hkv in ((32, 8), (8, 2)) for L in (2017, 8192)]
    checks = [check(Hq, Hkv, L, n, dt, dev, seed=1000 * i + n)
              for i, (Hq, Hkv, L, lengths) in enumerate(shapes) for n in lengths]
    for c in checks:
        out.say(f"check Hq {c['Hq']:2d} Hkv {c['Hkv']} L {c['L']:5d} length {c['length']:5d}: "
                f"max |err| {c['max_abs_err']:.2e} {'ok' if c['ok'] else 'FAIL'}")
    rows = [] if args.dry else [r for Hq, Hkv in ((32, 8), (8, 2)) for L in (2017, 8192)
                                for r in time_shape(Hq, Hkv, L, dt)]
    out.data.update(checks=checks, rows=rows)
    if rows:
        out.table(rows, [Col("Hq/Hkv", lambda r: f"{r['Hq']}/{r['Hkv']}"), Col("L", "L"), Col("len", "length"),
                         Col("impl", "impl"), Col("us", "us", ".1f"), Col("graph us", "graph_us", ".1f"),
                         Col("GB/s", "GBs", ".0f"), Col("floor", "floor", ".1%")])
    bad = [c for c in checks if not c["ok"]]
    out.say(f"{len(checks) - len(bad)}/{len(checks)} checks ok")
    return not bad
