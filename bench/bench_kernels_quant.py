"""The quantized GEMMs and the quantized MoE op at the real per-rank shapes of HunyuanImage-3.0 (H 4096,
E 64, top-8; I_micro 3072 at tp1, 768 for a TP4 micro; N = 1, 8, 1024, 8194 tokens), every fast path
checked against its reference on fresh random inputs (outputs poisoned with NaN), then timed (median of
triton.testing.do_bench) next to the bf16 path of the same shape.

    python bench/bench_kernels_quant.py [--quick] [--tune [--tune-formats mxfp8,mxfp4,nvfp4]]
    python bench/bench_kernels_quant.py --decode [--sweep] [--sections kernels,linear,moe]

--decode runs only the decode rows, the tile kernels of quant_triton.py ("old") against the GEMVs of
quant_gemv.py ("new"), every format, each checked first (scratch poisoned): the routed gate/up and down
kernels alone (tp1, one token), the dense qkv / o linears at 1 token (qkv also at 8), and one MoE layer's
whole decode (`moe_quant`, CUDA graph) at tp1 / tp4 with 1 and 8 tokens (8: both DECODE_TB). The
switches it informs: kernels.moe_quant.DECODE_KERNELS, kernels.quant.GEMV_LINEAR / quant_gemv.LINEAR_MAX_M,
quant_gemv.DECODE_TB, quant_gemv.DECODE_UP / DECODE_DOWN / LINEAR (--sweep: a few tiles of each).

Rows: the dense linear (qkv 6144 x 4096), the grouped expert GEMMs on permuted rows (GEMM1 2I x H and
GEMM2 H x I, uniform random routing), the whole `moe_quant` op (decode: only the chosen experts' bytes,
eager and as a CUDA graph; denoise: the grouped path) against the bf16 `moe` op. Each row gives ms,
the rate (TFLOP/s when the floor is compute, GB/s when it is memory) and the fraction of the floor:
max(FLOPs / peak, bytes / 4.3 TB/s), with peak 790 TFLOP/s for bf16 MMA (the weight-only kernels run
bf16 MMA) and 1267 for FP8. Details go to $OUT/bench_kernels_quant.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                       # noqa: E402
import kernels.quant as kq                           # noqa: E402
from kernels import moe_fast, quant_triton as qt     # noqa: E402
from kernels.moe_quant import moe_quant_cuda         # noqa: E402

H, E, K = 4096, 64, 8
PEAK = {"bf16": 790e12, "fp8": 1267e12}
PEAK_BW = 4.3e12
FMTS = ("mxfp8", "mxfp4", "nvfp4", "fp8")
BITS = {"bf16": 16, "mxfp8": 8 + 8 / 32, "mxfp4": 4 + 8 / 32, "nvfp4": 4 + 8 / 16, "fp8": 8}
BF16 = torch.bfloat16


def gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=40, return_mode="median")


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tol(fmt):
    return 3e-2 if fmt == "fp8" else 1e-2


def row(rows, case, n, path, ms, flops, nbytes, peak, err=""):
    t_floor = max(flops / peak, nbytes / PEAK_BW)
    compute = flops / peak >= nbytes / PEAK_BW
    rate = f"{flops / ms / 1e9:.0f} TFLOP/s" if compute else f"{nbytes / ms / 1e6:.0f} GB/s"
    rows.append(dict(case=case, n=n, path=path, ms=ms, rate=rate, floor=f"{t_floor * 1e3 / ms:.0%}", err=err,
                     flops=flops, bytes=nbytes))


def qweight(fmt, shape, std, seed, gscale_dims=0):
    return kq.random_qweight(fmt, shape, std, "cuda", gen(seed), inverse=fmt == "nvfp4", gscale_dims=gscale_dims)


# ------------------------------------------------------------------------------------ dense linear

def linear_cases(rows, quick):
    n_out, k = 6144, H
    ok = True
    wb = (torch.randn(n_out, k, generator=gen(1), device="cuda") * k ** -0.5).to(BF16)
    ws = {f: qweight(f, (n_out, k), k ** -0.5, 2) for f in FMTS}
    for m in ((1, 8, 1024) if quick else (1, 8, 1024, 8194)):
        x = torch.randn(m, k, generator=gen(m), device="cuda").to(BF16)
        flops = 2 * m * n_out * k
        act = 2 * m * (k + n_out)
        row(rows, "linear 6144x4096", m, "bf16 F.linear", bench(lambda: F.linear(x, wb)), flops,
            n_out * k * 2 + act, PEAK["bf16"])
        for f in FMTS:
            w = ws[f]
            x2 = torch.randn(m, k, generator=gen(m + 1), device="cuda").to(BF16)
            good, err = _checked_fast_ref(lambda: kq.qlinear(x2, w), f)
            ok &= good
            row(rows, "linear 6144x4096", m, f, bench(lambda: kq.qlinear(x, w)), flops,
                n_out * k * BITS[f] / 8 + act, PEAK["fp8" if f == "fp8" else "bf16"], err)
    return ok


def _checked_moe(args, fmt):
    """The CUDA op (scratch poisoned) against the `moe_quant` reference on the same inputs."""
    with moe_fast.poisoned():
        got = moe_quant_cuda(*args)
    with kernels.allowed():
        want = kernels.call("moe_quant", *args)
    err = rel_err(got, want)
    good = bool(not got.isnan().any() and err < tol(fmt))
    return good, f"{err:.1e}" + ("" if good else " FAIL")


def _checked_fast_ref(fast, fmt):
    with moe_fast.poisoned():
        got = fast()
    with kernels.allowed():
        want = fast()
    err = rel_err(got, want)
    good = bool(not got.isnan().any() and err < tol(fmt))
    return good, f"{err:.1e}" + ("" if good else " FAIL")


# ------------------------------------------------------------------------------------ grouped GEMMs

def grouped_cases(rows, quick):
    ok = True
    for name, inter, n in (("tp1", 3072, 8194), ("tp4", 768, 8194)) + (() if quick else (("tp1", 3072, 1024),)):
        r = n * K
        ids = torch.randint(0, E, (r,), generator=gen(3), device="cuda")
        offs = torch.bincount(ids, minlength=E).cumsum(0).int()
        x1 = torch.randn(r, H, generator=gen(4), device="cuda").to(BF16)
        x2 = torch.randn(r, inter, generator=gen(5), device="cuda").to(BF16)
        shapes = (("GEMM1", x1, 2 * inter, H), ("GEMM2", x2, H, inter))
        for gname, x, n_out, k in shapes:
            case = f"grouped {gname} {name}"
            flops = 2 * r * n_out * k
            act = 2 * r * (k + n_out)
            wb = (torch.randn(E, n_out, k, generator=gen(6), device="cuda") * k ** -0.5).to(BF16)
            row(rows, case, n, "bf16 _grouped_mm", bench(lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs)),
                flops, E * n_out * k * 2 + act, PEAK["bf16"])
            del wb
            for f in FMTS:
                w = qweight(f, (E, n_out, k), k ** -0.5, 7, gscale_dims=1)
                good, err = _checked_fast_ref(lambda: kq.qgrouped(x, w, offs), f)
                ok &= good
                row(rows, case, n, f, bench(lambda: kq.qgrouped(x, w, offs)), flops,
                    E * n_out * k * BITS[f] / 8 + act, PEAK["fp8" if f == "fp8" else "bf16"], err)
                if f == "fp8":      # the GEMM alone, on rows quantized once (the MoE shares them by micro)
                    xq, xs = qt.quantize_rows(x)
                    for fast in (False, True):          # cuBLAS / CUTLASS FP8 fast accumulation off and on
                        kq.FP8_FAST_ACCUM = fast
                        row(rows, case, n, f"fp8 GEMM only{' fast-accum' if fast else ''}",
                            bench(lambda: kq.scaled_grouped(xq, xs, w.codes, w.scales, offs, BF16)), flops,
                            E * n_out * k + r * (k + 2 * n_out), PEAK["fp8"])
                    kq.FP8_FAST_ACCUM = False
                    row(rows, case, n, "fp8 row quantizer only", bench(lambda: qt.quantize_rows(x)), 0,
                        r * k * 3 + r * 4, PEAK["fp8"])
                del w
    return ok


# ------------------------------------------------------------------------------------ the MoE op

def moe_weights(fmt, inter, micros, seed):
    if fmt == "bf16":
        def rnd(*shape, std):
            return (torch.randn(*shape, generator=gen(seed), device="cuda") * std).to(BF16)
        return dict(w1=rnd(micros, E, 2 * inter, H, std=H ** -0.5), w2=rnd(E, H, micros * inter, std=inter ** -0.5),
                    shared_w1=rnd(micros, 2 * inter, H, std=H ** -0.5), shared_w2=rnd(H, micros * inter, std=inter ** -0.5))
    shared = "mxfp8" if fmt == "mxfp4" else fmt          # the MXFP4-mixed build keeps the shared MLP in MXFP8
    return dict(w1=qweight(fmt, (micros, E, 2 * inter, H), H ** -0.5, seed, 1),
                w2=qweight(fmt, (E, H, micros * inter), inter ** -0.5, seed + 1, 1),
                shared_w1=qweight(shared, (micros, 2 * inter, H), H ** -0.5, seed + 2),
                shared_w2=qweight(shared, (H, micros * inter), inter ** -0.5, seed + 3))


def moe_args(x, gate, w, ms, mc):
    return (x, gate, w["w1"], w["w2"], w["shared_w1"], w["shared_w2"], ms, mc, K, True)


def run_op(fmt):
    return moe_fast.moe_cuda if fmt == "bf16" else moe_quant_cuda


def decode_bytes(x, gate, fmt, inter, mc):
    """Bytes the decode path must read: the chosen experts' and the shared MLP's weights of the active
    micros, the router, the tokens."""
    _, idx = kernels.moe.route(x, gate, K, True)
    shared = "mxfp8" if fmt == "mxfp4" else fmt
    per = 3 * inter * H * mc
    return (idx.unique().numel() * per * BITS[fmt] + per * BITS[shared]) / 8 + E * H * 4 + 4 * x.numel()


def moe_cases(rows, quick):
    ok = True
    gate = torch.randn(E, H, generator=gen(8), device="cuda") * H ** -0.5
    for name, inter, micros, ms, mc in (("tp4", 768, 1, 0, 1), ("tp1", 3072, 1, 0, 1)):
        for n in (1, 8):
            case = f"moe decode {name}"
            for f in ("bf16",) + FMTS:
                w = moe_weights(f, inter, micros, 9)
                xs = [torch.randn(n, H, generator=gen(20 + i), device="cuda").to(BF16) for i in range(4)]
                err = ""
                if f != "bf16":
                    good, err = _checked_moe(moe_args(xs[0], gate, w, ms, mc), f)
                    ok &= good
                nbytes = sum(decode_bytes(x, gate, f, inter, mc) for x in xs) / len(xs)
                fn = run_op(f)

                def run_all():
                    for x in xs:
                        fn(*moe_args(x, gate, w, ms, mc))
                flops = 2 * n * (K + 1) * 3 * inter * H * mc
                row(rows, case, n, f"{f} eager", bench(run_all) / len(xs), flops, nbytes, PEAK["bf16"], err)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    run_all()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run_all()
                row(rows, case, n, f"{f} graph", bench(graph.replay) / len(xs), flops, nbytes, PEAK["bf16"])
                del w, graph
    cases = (("hybrid4", 768, 2, 0, 2, 2 * 2049), ("tp1", 3072, 1, 0, 1, 8194))
    for name, inter, micros, ms, mc, n in cases[:1] if quick else cases:
        case = f"moe denoise {name}"
        x = torch.randn(n, H, generator=gen(30), device="cuda").to(BF16)
        flops = 6 * n * (K + 1) * mc * H * inter
        for f in ("bf16",) + FMTS:
            w = moe_weights(f, inter, micros, 10)
            args = moe_args(x, gate, w, ms, mc)
            err = ""
            if f != "bf16":
                good, err = _checked_moe(args, f)
                ok &= good
            wbytes = 3 * E * inter * H * mc * BITS[f] / 8
            row(rows, case, n, f, bench(lambda: run_op(f)(*args)), flops, wbytes + 4 * n * K * H * 2,
                PEAK["fp8" if f == "fp8" else "bf16"], err)
            if f == "fp8":
                kq.FP8_FAST_ACCUM = True
                row(rows, case, n, "fp8 fast-accum", bench(lambda: run_op(f)(*args)), flops,
                    wbytes + 4 * n * K * H * 2, PEAK["fp8"])
                kq.FP8_FAST_ACCUM = False
            del w, args
    return ok


# ------------------------------------------------------------------------------------ decode: old vs new

def _set_decode(kind):
    import kernels.moe_quant as mq
    mq.DECODE_KERNELS = kind


def _timed_graph(fn):
    """Median ms of `fn` replayed as a CUDA graph (captured after one warm-up run on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = bench(graph.replay)
    del graph
    return ms


def decode_op_cases(rows):
    """One MoE layer's decode (`moe_quant`, routed top-8 + shared MLP) at the tp1 and tp4 shapes, 1 and 8
    tokens, the tile kernels (old) against the GEMVs (new), checked against the reference."""
    from kernels import quant_gemv as qg
    ok = True
    tb0 = qg.DECODE_TB
    gate = torch.randn(E, H, generator=gen(8), device="cuda") * H ** -0.5
    for name, inter in (("tp1", 3072), ("tp4", 768)):
        for f in FMTS:
            w = moe_weights(f, inter, 1, 9)
            for n in (1, 8):
                xs = [torch.randn(n, H, generator=gen(20 + i), device="cuda").to(BF16) for i in range(4)]
                nbytes = sum(decode_bytes(x, gate, f, inter, 1) for x in xs) / len(xs)
                flops = 2 * n * (K + 1) * 3 * inter * H
                # the GEMVs' tokens per pass (quant_gemv.DECODE_TB) matter from 3 tokens on: both at 8
                for kind, tb in (("tile", None),) + ((("gemv", 2), ("gemv", 4)) if n > 2 else (("gemv", None),)):
                    _set_decode(kind)
                    if tb is not None:
                        qg.DECODE_TB = tb
                    good, err = _checked_moe(moe_args(xs[1], gate, w, 0, 1), f)
                    ok &= good

                    def run_all():
                        for x in xs:
                            moe_quant_cuda(*moe_args(x, gate, w, 0, 1))
                    label = (f"{f}{'+mxfp8 shared' if f == 'mxfp4' else ''} "
                             f"{'old tile' if kind == 'tile' else 'new gemv'}{f' DECODE_TB={tb}' if tb else ''}")
                    row(rows, f"moe decode {name}", n, label, _timed_graph(run_all) / len(xs), flops, nbytes,
                        PEAK["bf16"], err)
                    qg.DECODE_TB = tb0
            del w
            torch.cuda.empty_cache()
    _set_decode("gemv")
    return ok


def _routing(n, seed):
    from kernels import moe_triton as tk
    gate = torch.randn(E, H, generator=gen(seed), device="cuda") * H ** -0.5
    x = torch.randn(n, H, generator=gen(seed + 1), device="cuda").to(BF16)
    _, ids, active = tk.router_select(tk.router_logits(x, gate), K, True, plan=False)
    return x, ids, active


def decode_kernel_cases(rows, sweep):
    """The routed gate/up and down kernels alone (tp1, 1 token, the 8 chosen experts), old vs new, and
    (sweep) a few tile configs of the new ones: which kernel and tile win, in GB/s of expert weights."""
    from kernels import quant_gemv as qg
    inter = 3072
    x, ids, active = _routing(1, 50)
    s = active.shape[0]
    ok = True
    for f in ("mxfp4", "mxfp8", "nvfp4"):
        w1 = qweight(f, (1, E, 2 * inter, H), H ** -0.5, 51, 1)
        w2 = qweight(f, (E, H, inter), inter ** -0.5, 52, 1)          # one micro: the whole row
        up_bytes = K * 2 * inter * H * BITS[f] / 8
        down_bytes = K * H * inter * BITS[f] / 8
        # reference: the dequantized experts of the chosen ones
        e = active.long()
        d1 = w1[0].dequantize(BF16)[e]                       # [8, 2I, H]
        h = torch.einsum("h,eoh->eo", x[0].float(), d1.float())
        want_act = (h[:, :inter] * F.silu(h[:, inter:])).to(BF16)
        d2 = w2.dequantize(BF16)[e]
        want_y = torch.einsum("ei,ehi->eh", want_act.float(), d2.float())
        act_old = torch.empty(1, s, 16, inter, dtype=BF16, device="cuda")
        y = torch.empty(K, H, dtype=torch.float32, device="cuda")
        args1 = (ids, active, f, w1.codes, w1.scales, w1.gscale, w1.inverse)
        args2 = (ids, active, f, w2.codes, w2.scales, w2.gscale, w2.inverse)
        row(rows, "routed up tp1", 1, f"{f} old tile",
            bench(lambda: qt.decode_up(x, *args1, act_old, s, inter)), 0, up_bytes, PEAK["bf16"])
        row(rows, "routed down tp1", 1, f"{f} old tile",
            bench(lambda: qt.decode_down(act_old, *args2, y, s, inter)), 0, down_bytes, PEAK["bf16"])
        ph = qg.act_ph(f)
        xp = qg.prep(x, f)
        row(rows, "prep x", 1, f"{f}", bench(lambda: qg.prep(x, f)), 0, H * 6, PEAK["bf16"])
        ups = [dict(qg.DECODE_UP, **qg.DECODE_UP_FMT.get(f, {}))]
        downs = [dict(qg.DECODE_DOWN, **qg.DECODE_DOWN_FMT.get(f, {}))]
        if sweep:
            ups += [dict(BI=bi, G=g, num_warps=nw) for bi, g, nw in ((16, 32, 8), (4, 32, 4), (8, 32, 4), (16, 32, 4),
                                                                        (8, 16, 4), (32, 32, 8))]
            downs += [dict(R=r, G=g, num_warps=nw) for r, g, nw in ((32, 32, 8), (8, 32, 4), (16, 32, 4), (32, 32, 4),
                                                                       (16, 16, 8), (64, 32, 8))]
        for i, cfg in enumerate(ups):
            act = torch.full((1, s, 1, inter), float("nan"), device="cuda")
            qg.decode_up(xp, *args1, act, s, inter, cfg, x_prepared=True, act_prep=ph)
            got = _unprep(act[0, :, 0], f) if ph else act[0, :, 0]
            err = rel_err(got.float(), want_act.float())
            good = bool(not got.isnan().any() and err < 1e-2)
            ok &= good
            row(rows, "routed up tp1", 1, f"{f} new gemv{' ' + _cfg(cfg) if i else ''}",
                bench(lambda: qg.decode_up(xp, *args1, act, s, inter, cfg, x_prepared=True, act_prep=ph)), 0, up_bytes,
                PEAK["bf16"], f"{err:.1e}" + ("" if good else " FAIL"))
        act_in = _prep_rows(want_act, f).reshape(1, s, 1, inter) if ph else want_act.reshape(1, s, 1, inter)
        for i, cfg in enumerate(downs):
            y.fill_(float("nan"))
            qg.decode_down(act_in, *args2, y, s, inter, down=cfg, act_prepared=bool(ph))
            got = y.view(1, K, H)[0]
            # y row j is the token's j-th choice; active is ascending: map expert order to route order
            order = _route_order(ids, active)
            err = rel_err(got, want_y[order])
            good = bool(not got.isnan().any() and err < 1e-2)
            ok &= good
            row(rows, "routed down tp1", 1, f"{f} new gemv{' ' + _cfg(cfg) if i else ''}",
                bench(lambda: qg.decode_down(act_in, *args2, y, s, inter, down=cfg, act_prepared=bool(ph))), 0,
                down_bytes, PEAK["bf16"], f"{err:.1e}" + ("" if good else " FAIL"))
        del w1, w2, d1, d2
        torch.cuda.empty_cache()
    return ok


def _cfg(cfg):
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def _unprep(a, fmt):
    """Prepared rows (fp32, phase-major, times 2^64) back to the natural order."""
    from kernels import quant_gemv as qg
    ph = qg.PH[fmt]
    r, k = a.shape
    return (a.view(r, ph, k // ph).transpose(1, 2).reshape(r, k) / qg.XSCALE)


def _prep_rows(a, fmt):
    from kernels import quant_gemv as qg
    return qg.prep(a, fmt)


def _route_order(ids, active):
    """For 1 token: the slot of each of its K choices (y's rows are in choice order)."""
    return torch.searchsorted(active[active >= 0].contiguous(), ids[0].contiguous())


def decode_linear_cases(rows, sweep):
    """The dense linears of one token (qkv 6144 x 4096, o 4096 x 4096; 8 tokens for qkv): the split-K
    tile path (old) against the GEMV (new), every format, checked against the dequantized reference."""
    from kernels import quant_gemv as qg
    ok = True
    for name, n_out, m in (("qkv 6144x4096", 6144, 1), ("o 4096x4096", 4096, 1), ("qkv 6144x4096", 6144, 8)):
        x = torch.randn(m, H, generator=gen(60 + m), device="cuda").to(BF16)
        for f in FMTS:
            w = qweight(f, (n_out, H), H ** -0.5, 61)
            want = F.linear(x, w.dequantize(BF16))
            nbytes = n_out * H * BITS[f] / 8 + 2 * m * (H + n_out)
            cfgs = [dict(qg.LINEAR)]
            if sweep and m == 1:
                cfgs += [dict(R=r, G=32, num_warps=nw, PREP=p) for r, nw, p in
                         ((8, 4, True), (16, 4, True), (32, 8, True), (16, 8, False), (8, 8, True))]
            with moe_fast.poisoned():
                got = qt.linear(x, f, w.codes, w.scales, w.gscale, w.inverse)
            err = rel_err(got, want)
            good = bool(not got.isnan().any() and err < tol(f))
            ok &= good
            row(rows, f"linear {name}", m, f"{f} old split-K tile",
                bench(lambda: qt.linear(x, f, w.codes, w.scales, w.gscale, w.inverse)), 0, nbytes, PEAK["bf16"],
                f"{err:.1e}" + ("" if good else " FAIL"))
            for i, cfg in enumerate(cfgs):
                with moe_fast.poisoned():
                    got = qg.linear(x, f, w.codes, w.scales, w.gscale, w.inverse, cfg=cfg)
                err = rel_err(got, want)
                good = bool(not got.isnan().any() and err < tol(f))
                ok &= good
                row(rows, f"linear {name}", m, f"{f} new gemv{' ' + _cfg(cfg) if i else ''}",
                    bench(lambda: qg.linear(x, f, w.codes, w.scales, w.gscale, w.inverse, cfg=cfg)), 0, nbytes,
                    PEAK["bf16"], f"{err:.1e}" + ("" if good else " FAIL"))
            if f == "fp8":
                row(rows, f"linear {name}", m, "fp8 scaled_mm (W8A8)", bench(lambda: kq.qlinear(x, w)), 0, nbytes,
                    PEAK["fp8"])
            del w
    return ok


# ------------------------------------------------------------------------------------ tuning

def _sweep(label, configs, run, work, unit):
    """Times `run(cfg)` for each config (a config that does not compile is skipped); prints the best."""
    res = []
    for cfg in configs:
        try:
            res.append((bench(lambda: run(cfg)), cfg))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
            print(f"tune {label} {cfg}: {type(e).__name__}")
    ms, cfg = min(res, key=lambda r: r[0])
    rate = work / ms / (1e9 if unit == "TFLOP/s" else 1e6)         # work per ms -> TFLOP/s or GB/s
    print(f"tune {label}: best {ms * 1e3:.1f} us ({rate:.0f} {unit}) with {cfg}", flush=True)
    return dict(kernel=label, results=res)


def tune(rows, fmts):
    """Sweeps the tiles of every quantized kernel at one real shape each, per format; prints the best
    (paste into quant_triton.py's config dicts: LINEAR_*, GROUPED / GROUPED_FMT, DECODE_*_FMT)."""
    out = []
    x = torch.randn(8194, H, generator=gen(40), device="cuda").to(BF16)
    x1 = x[:1].contiguous()
    r = 8194 * K
    ids = torch.randint(0, E, (r,), generator=gen(43), device="cuda")
    offs = torch.bincount(ids, minlength=E).cumsum(0).int()
    xr = torch.randn(r, H, generator=gen(44), device="cuda").to(BF16)
    gate = torch.randn(E, H, generator=gen(45), device="cuda") * H ** -0.5
    tiles = [dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=w, num_stages=st)
             for bm, bn, bk, w, st in ((128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 32, 8, 3),
                                       (64, 128, 64, 8, 4), (128, 64, 64, 4, 3), (128, 256, 32, 8, 3))]
    for f in fmts:
        w = qweight(f, (6144, H), H ** -0.5, 41)

        def lin(cfg, xx):
            return qt.linear(xx, f, w.codes, w.scales, w.gscale, w.inverse, cfg=cfg)
        out.append(_sweep(f"linear {f} M=8194", tiles, lambda c: lin(c, x), 2 * 8194 * 6144 * H, "TFLOP/s"))
        small = [dict(BM=16, BN=bn, BK=bk, GROUP_M=1, num_warps=wp, num_stages=3)
                 for bn, bk, wp in ((32, 256, 8), (16, 256, 4), (32, 128, 4), (64, 128, 8), (32, 512, 8))]
        out.append(_sweep(f"linear {f} M=1", small, lambda c: lin(c, x1), 6144 * H * BITS[f] / 8, "GB/s"))
        del w
        pack = qweight(f, (E, 2 * 3072, H), H ** -0.5, 46, gscale_dims=1)
        out.append(_sweep(f"grouped {f} tp1 GEMM1", tiles,
                          lambda c: qt.grouped(xr, f, pack.codes, pack.scales, offs, pack.gscale, pack.inverse, cfg=c),
                          2 * r * 2 * 3072 * H, "TFLOP/s"))
        del pack
        wts = moe_weights(f, 768, 1, 47)
        xs = [torch.randn(1, H, generator=gen(48 + i), device="cuda").to(BF16) for i in range(4)]
        nbytes = sum(decode_bytes(t, gate, f, 768, 1) for t in xs) / len(xs)
        base_up, base_down = dict(qt.DECODE_UP_FMT.get(f, {})), dict(qt.DECODE_DOWN_FMT.get(f, {}))
        ups = [dict(BLOCK_I=bi, BLOCK_H=bh, num_warps=wp) for bi, bh, wp in
               ((16, 128, 8), (16, 256, 8), (16, 64, 4), (32, 128, 8), (16, 512, 8))]
        downs = [dict(BLOCK_HO=bho, BLOCK_I=bi, num_warps=wp) for bho, bi, wp in
                 ((32, 128, 8), (32, 256, 8), (16, 128, 4), (64, 128, 8), (32, 64, 4))]

        def dec(up=None, down=None):
            if up is not None:
                qt.DECODE_UP_FMT[f] = up
            if down is not None:
                qt.DECODE_DOWN_FMT[f] = down
            for t in xs:
                moe_quant_cuda(*moe_args(t, gate, wts, 0, 1))
        out.append(_sweep(f"decode up {f} tp4 N=1 (whole op)", ups, lambda c: dec(up=c), nbytes * 4, "GB/s"))
        qt.DECODE_UP_FMT[f] = base_up
        out.append(_sweep(f"decode down {f} tp4 N=1 (whole op)", downs, lambda c: dec(down=c), nbytes * 4, "GB/s"))
        qt.DECODE_DOWN_FMT[f] = base_down
        del wts
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true", help="sweep kernel tiles first")
    ap.add_argument("--tune-formats", default="mxfp8,mxfp4,nvfp4", help="the formats --tune sweeps")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--decode", action="store_true", help="only the decode rows: old tile kernels vs new GEMVs")
    ap.add_argument("--sweep", action="store_true", help="with --decode: a few tile configs of the new kernels")
    ap.add_argument("--sections", default="kernels,linear,moe", help="with --decode: which of kernels,linear,moe")
    args = ap.parse_args()
    if args.decode:
        return decode_main(args.sweep, args.sections.split(","))
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    chosen = {op: kernels.chosen(op, "cuda", BF16) for op in ("linear_mxfp4", "grouped_mm_nvfp4", "linear_fp8",
                                                              "grouped_mm_fp8", "moe_quant")}
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  backends: {chosen}", flush=True)
    ok = chosen == {"linear_mxfp4": "triton", "grouped_mm_nvfp4": "triton", "linear_fp8": "scaled_mm",
                    "grouped_mm_fp8": "scaled_mm", "moe_quant": "triton"}
    rows: list[dict] = []
    tuned = tune(rows, args.tune_formats.split(",")) if args.tune else None
    for name, fn in (("linear", linear_cases), ("grouped", grouped_cases), ("moe", moe_cases)):
        ok &= fn(rows, args.quick)
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_kernels_quant.json").write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, tune=tuned), indent=1))
    print(f"\n{'case':<22} {'N':>5}  {'path':<27} {'ms':>8}  {'rate':>14}  {'of floor':>8}  {'rel err':>8}")
    for r in rows:
        print(f"{r['case']:<22} {r['n']:>5}  {r['path']:<27} {r['ms']:>8.3f}  {r['rate']:>14}  {r['floor']:>8}  "
              f"{r['err']:>8}")
    print(f"checks: {'all passed' if ok else 'FAILED'}  ({time.time() - t0:.0f} s)")
    sys.exit(0 if ok else 1)


def _print(rows):
    print(f"\n{'case':<24} {'N':>3}  {'path':<48} {'ms':>8}  {'rate':>11}  {'of floor':>8}  {'rel err':>8}")
    for r in rows:
        print(f"{r['case']:<24} {r['n']:>3}  {r['path']:<48} {r['ms']:>8.4f}  {r['rate']:>11}  {r['floor']:>8}  "
              f"{r['err']:>8}")


def decode_main(sweep: bool, sections: list[str]) -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  moe_quant backend: "
          f"{kernels.chosen('moe_quant', 'cuda', BF16)}", flush=True)
    ok = kernels.chosen("moe_quant", "cuda", BF16) == "triton"
    rows: list[dict] = []
    for name, fn in (("kernels", lambda r: decode_kernel_cases(r, sweep)), ("linear", lambda r: decode_linear_cases(r, sweep)),
                     ("moe", decode_op_cases)):
        if name not in sections:
            continue
        ok &= fn(rows)
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_kernels_quant_decode.json").write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))
    _print(rows)
    print(f"checks: {'all passed' if ok else 'FAILED'}  ({time.time() - t0:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
