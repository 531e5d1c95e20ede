"""Programmatic dependent launch (PDL) on a decode-like chain of kernels: does it work here, and what does
it save a kernel?

    python -m bench pdl [--kernels 64] [--side 4096]

A decode token is ~450 small kernels one after another (5.0 ms a token, ~11 us a kernel, MXFP4 Distil on
one H200): each pays its launch, its blocks' ramp-up and its tail before the next starts. With PDL
(Hopper; Triton's `launch_pdl=True`, `tl.extra.cuda.gdc_launch_dependents` / `gdc_wait`) a kernel lets its
successor launch early; the successor loads what does not depend on its predecessor (a GEMV's first weight
tile) and waits (`gdc_wait`) before it reads its predecessor's output. The probe: a chain of GEMVs
y_{i+1} = tanh(W_i y_i) / 4, each W_i its own FP8 [side, side] matrix (the chain's weights far beyond L2,
as a token's layers are), x in fp32; the chain run eagerly and as one CUDA graph, without and with PDL:
whether it compiles and captures, the same outputs bit for bit, us a kernel and the bytes floor (W_i's
bytes at 4.3 TB/s). The engine's kernels use no PDL yet: this measures whether they should.
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ..report import Col, Output
from ..timing import time_ms

DRY = False
BYTES_PER_S = 4.3e12            # the H200's reachable HBM bandwidth (METHOD.md)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--kernels", type=int, default=64, help="GEMVs in the chain (distinct weights)")
    ap.add_argument("--side", type=int, default=4096, help="each weight's rows = columns")


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rows = w_ptr + rn.to(tl.int64)[:, None] * K
    w = tl.load(rows + rk[None, :]).to(tl.float32)     # the first weight tile: never the predecessor's
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()          # the successor may launch and prefetch now
        tl.extra.cuda.gdc_wait()                       # x is the predecessor's output
    acc = tl.sum(w * tl.load(x_ptr + rk)[None, :], axis=1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w = tl.load(rows + (k0 + rk)[None, :]).to(tl.float32)
        acc += tl.sum(w * tl.load(x_ptr + k0 + rk)[None, :], axis=1)
    e = tl.exp(-2.0 * tl.abs(acc))                     # tanh, by hand (no libdevice call)
    t = (1.0 - e) / (1.0 + e)
    tl.store(y_ptr + rn, tl.where(acc < 0, -t, t) * 0.25)


def chain(ws: list[torch.Tensor], xs: list[torch.Tensor], pdl: bool) -> None:
    side = ws[0].shape[0]
    for i, w in enumerate(ws):
        kw = dict(launch_pdl=True) if pdl else {}
        _gemv_kernel[(side // 16,)](w, xs[i], xs[i + 1], side, BLOCK_N=16, BLOCK_K=256, USE_GDC=pdl,
                                    num_warps=4, **kw)


def run(args: argparse.Namespace, out: Output) -> bool:
    n, side = args.kernels, args.side
    g = torch.Generator("cuda").manual_seed(0)
    ws = [(torch.randn(side, side, generator=g, device="cuda") * side ** -0.5 * 64).to(torch.float8_e4m3fn)
          for _ in range(n)]
    xs = [torch.randn(side, generator=g, device="cuda")] + [torch.empty(side, device="cuda") for _ in range(n)]
    floor_us = side * side / BYTES_PER_S * 1e6
    rows, outs, ok = [], {}, True
    for pdl in (False, True):
        name = "PDL" if pdl else "plain"
        try:
            chain(ws, xs, pdl)
            torch.cuda.synchronize()
            outs[name] = xs[-1].clone()
            eager = time_ms(lambda: chain(ws, xs, pdl), "events", n=9) * 1e3 / n
            graph = time_ms(lambda: chain(ws, xs, pdl), "graph", n=9) * 1e3 / n
            chain(ws, xs, pdl)
            torch.cuda.synchronize()
            same = torch.equal(xs[-1], outs[name])
        except Exception as e:  # noqa: BLE001 - the probe's answer is whether it works at all
            out.say(f"{name}: failed: {type(e).__name__}: {e}")
            ok = ok and pdl                      # PDL failing is an answer; the plain chain failing is not
            continue
        rows.append(dict(chain=name, eager_us=eager, graph_us=graph, x_floor=graph / floor_us, repeat_same=same))
    if "PDL" in outs and "plain" in outs:
        out.say(f"PDL gives the plain chain's output bit for bit: {torch.equal(outs['PDL'], outs['plain'])}")
        ok = ok and torch.equal(outs["PDL"], outs["plain"])
    out.table(rows, [Col("chain", "chain"), Col("eager us a kernel", "eager_us", ".2f"),
                     Col("graph us a kernel", "graph_us", ".2f"), Col("graph x floor", "x_floor", ".2f"),
                     Col("same output again", "repeat_same")],
              f"{n} GEMVs of FP8 [{side}, {side}] in a chain, floor {floor_us:.2f} us a kernel at 4.3 TB/s "
              f"(triton {triton.__version__})")
    out.data.update(rows=rows, floor_us=floor_us)
    return ok
