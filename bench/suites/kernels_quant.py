"""The quantized GEMMs and the quantized MoE op at the real per-rank shapes of HunyuanImage-3.0 (H 4096,
E 64, top-8; I_micro 3072 at tp1, 768 for a TP4 micro; N = 1, 8, 1024, 8194 tokens), every fast path
checked against its reference on fresh random inputs (outputs and scratch poisoned with NaN), then timed
(median of triton.testing.do_bench) next to the bf16 path of the same shape.

    python -m bench kernels-quant [--quick] [--tune [--tune-formats mxfp8,mxfp4,nvfp4]]
    python -m bench kernels-quant --decode [--sweep] [--sections kernels,linear,rows,moe]
    python -m bench kernels-quant --dry [--decode]     # CPU, Triton interpreter, tiny shapes, MX/NVFP4 only

Rows: the dense linear (qkv 6144 x 4096), the grouped expert GEMMs on permuted rows (GEMM1 2I x H and
GEMM2 H x I, uniform random routing), the whole `moe_quant` op (decode: only the chosen experts' bytes,
eager and as a CUDA graph; denoise: the grouped path) against the bf16 `moe` op; `ran` names the
registry's variant. Each row gives ms, the rate (TFLOP/s when the floor is compute, GB/s when it is
memory) and the fraction of the floor: max(FLOPs / peak, bytes / 4.3 TB/s), with peak 790 TFLOP/s for
bf16 MMA (the weight-only kernels run bf16 MMA) and 1267 for FP8 (cuBLAS's FP8 fast accumulation, the
engine's setting).

--decode: the decode GEMVs (hunyuan_kernels/quant/gemv.py), every format, each checked first: the routed gate/up
and down kernels alone (tp1, one token; --sweep: a few tiles of each), the dense qkv / o linears of one
token (qkv also at 8) on the "gemv" variant against the "triton" split-K tile variant of the same op (FP8:
cuBLAS W8A8), the qkv linear's GEMV at 1..16 rows (`rows`: past gemv.LINEAR_MAX_M, each row bitwise the one it
gives alone, against the registry's pick there), and one MoE layer's whole decode (`moe_quant` "decode", CUDA graph) at tp1 / tp4, 1 and 8
tokens. --tune: the tile kernels' configs at one real shape each (triton_kernels.py LINEAR_*, GROUPED).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import hunyuan_kernels as kernels
from hunyuan_kernels.moe import route
from hunyuan_kernels.quant import QWeight, random_qweight
from hunyuan_kernels.quant import cuda as qcuda
from hunyuan_kernels.quant import gemv as qg
from hunyuan_kernels.quant import triton_kernels as qt
from hunyuan_kernels.scratch import poisoned

from .. import variants
from ..checks import Check, compare
from ..report import Col, Output
from ..timing import time_ms

DRY = True
PEAK = {"bf16": 790e12, "fp8": 1267e12}
PEAK_BW = 4.3e12
BITS = {"bf16": 16, "mxfp8": 8 + 8 / 32, "mxfp4": 4 + 8 / 32, "nvfp4": 4 + 8 / 16, "fp8": 8}
BF16 = torch.bfloat16


class Dims:
    """The real per-rank sizes, or (--dry) tiny ones; the formats (FP8 needs cuBLAS: not in a dry run)."""

    def __init__(self, dry: bool, quick: bool):
        self.dry, self.dev = dry, "cpu" if dry else "cuda"
        if dry:
            self.H, self.E, self.K = 64, 8, 3
            self.fmts = ("mxfp8", "mxfp4", "nvfp4")
            self.linear_out, self.linear_m = 96, (1, 5, 40)
            self.grouped = (("tp1", 64, 23),)                      # (name, I, tokens)
            self.decode_moe = (("tp4", 32, 1, 0, 1),)              # (name, I, micros, start, count)
            self.denoise_moe = (("hybrid4", 32, 2, 0, 2, 37),)     # (..., tokens)
            self.decode_linear = (("qkv", 96, 1), ("qkv", 96, 5))
            self.decode_rows = (1, 8, 12)
            self.decode_inter = 64
        else:
            self.H, self.E, self.K = 4096, 64, 8
            self.fmts = ("mxfp8", "mxfp4", "nvfp4", "fp8")
            self.linear_out, self.linear_m = 6144, (1, 8, 1024) if quick else (1, 8, 1024, 8194)
            self.grouped = (("tp1", 3072, 8194), ("tp4", 768, 8194)) + (() if quick else (("tp1", 3072, 1024),))
            self.decode_moe = (("tp4", 768, 1, 0, 1), ("tp1", 3072, 1, 0, 1))
            cases = (("hybrid4", 768, 2, 0, 2, 2 * 2049), ("tp1", 3072, 1, 0, 1, 8194))
            self.denoise_moe = cases[:1] if quick else cases
            self.decode_linear = (("qkv 6144x4096", 6144, 1), ("o 4096x4096", 4096, 1), ("qkv 6144x4096", 6144, 8))
            self.decode_rows = (1, 2, 3, 4, 6, 8, 9, 12, 16)
            self.decode_inter = 3072

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.dev).manual_seed(seed)

    def randn(self, *shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen(seed), device=self.dev) * std).to(BF16)

    def qweight(self, fmt: str, shape: tuple, std: float, seed: int, gscale_dims: int = 0) -> QWeight:
        return random_qweight(fmt, shape, std, self.dev, self.gen(seed), inverse=fmt == "nvfp4",
                              gscale_dims=gscale_dims)

    def timed(self, fn, graph: bool = False, per: int = 1) -> float:
        """do_bench (or a graph's replay) on the GPU; one wall-clock call in a dry run."""
        if self.dry:
            return time_ms(fn, "wall", n=1, warmup=0) / per
        return time_ms(fn, "graph" if graph else "bench", per=per)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--tune", action="store_true", help="sweep the tile kernels' configs first")
    ap.add_argument("--tune-formats", default="mxfp8,mxfp4,nvfp4", help="the formats --tune sweeps")
    ap.add_argument("--decode", action="store_true", help="only the decode GEMVs")
    ap.add_argument("--sweep", action="store_true", help="with --decode: a few tile configs of the GEMVs")
    ap.add_argument("--sections", default="kernels,linear,rows,moe",
                    help="with --decode: which of kernels,linear,rows,moe")


def tol(fmt: str) -> float:
    return 3e-2 if fmt == "fp8" else 1e-2       # fp8: the activations' E4M3 rounding


def row(rows: list, case: str, n: int, path: str, ms: float, flops: float, nbytes: float, peak: float,
        err: Check | str | None = None, ran: str | None = None) -> None:
    t_floor = max(flops / peak, nbytes / PEAK_BW)
    compute = flops / peak >= nbytes / PEAK_BW
    rate = f"{flops / ms / 1e9:.0f} TFLOP/s" if compute else f"{nbytes / ms / 1e6:.0f} GB/s"
    rows.append(dict(case=case, n=n, path=path, ran=ran, ms=ms, rate=rate, floor=t_floor * 1e3 / ms,
                     err=None if err is None else str(err), flops=flops, bytes=nbytes))


def linear_op(x: torch.Tensor, w: QWeight) -> tuple[str, tuple]:
    """The registry op of a quantized linear and its arguments (as hunyuan_kernels.quant.qlinear calls it)."""
    if w.fmt == "nvfp4":
        return "linear_nvfp4", (x, w.codes, w.scales, w.gscale, w.inverse)
    return "linear_" + w.fmt, (x, w.codes, w.scales)


def grouped_op(x: torch.Tensor, w: QWeight, offs: torch.Tensor) -> tuple[str, tuple]:
    if w.fmt == "nvfp4":
        return "grouped_mm_nvfp4", (x, w.codes, w.scales, w.gscale, w.inverse, offs)
    return "grouped_mm_" + w.fmt, (x, w.codes, w.scales, offs)


def checked(op: str, name: str, args: tuple, fmt: str) -> tuple[Check, object]:
    """The variant (scratch poisoned) against the op's reference on the same inputs; then its timed call."""
    fn = variants.runner(op, name, *args)
    with poisoned():
        got = fn()
    return compare(got, variants.run(op, "torch", *args), tol(fmt)), fn


def engine_variant(op: str, args: tuple, dims: Dims) -> str:
    """The variant the engine runs for these arguments (on CUDA: the registry's pick, by its fits); a dry
    run names the one CUDA would pick, as the fits decide it (at most gemv.LINEAR_MAX_M rows: the GEMV)."""
    if not dims.dry:
        kernels.call(op, *args)
        return kernels.chosen(op)
    if op.startswith("linear_"):
        return "gemv" if args[0].shape[0] <= qg.LINEAR_MAX_M else "triton"
    if op.startswith("moe"):
        return "decode" if args[0].shape[0] <= 8 else ("fused" if op == "moe" else "grouped")
    return "triton"


# ------------------------------------------------------------------------------------ dense linear

def linear_cases(dims: Dims, rows: list) -> bool:
    n_out, k = dims.linear_out, dims.H
    ok = True
    wb = dims.randn(n_out, k, seed=1, std=k ** -0.5)
    ws = {f: dims.qweight(f, (n_out, k), k ** -0.5, 2) for f in dims.fmts}
    for m in dims.linear_m:
        x = dims.randn(m, k, seed=m)
        flops, act = 2 * m * n_out * k, 2 * m * (k + n_out)
        case = f"linear {n_out}x{k}"
        row(rows, case, m, "bf16 F.linear", dims.timed(lambda: F.linear(x, wb)), flops, n_out * k * 2 + act, PEAK["bf16"])
        for f in dims.fmts:
            op, args = linear_op(x, ws[f])
            name = engine_variant(op, args, dims)
            check, fn = checked(op, name, args, f)
            ok &= check.ok
            row(rows, case, m, f, dims.timed(fn), flops, n_out * k * BITS[f] / 8 + act,
                PEAK["fp8" if f == "fp8" else "bf16"], check, name)
    return ok


# ------------------------------------------------------------------------------------ grouped GEMMs

def grouped_cases(dims: Dims, rows: list) -> bool:
    H, E, K = dims.H, dims.E, dims.K
    ok = True
    for name, inter, n in dims.grouped:
        r = n * K
        ids = torch.randint(0, E, (r,), generator=dims.gen(3), device=dims.dev)
        offs = torch.bincount(ids, minlength=E).cumsum(0).int()
        for gname, x, n_out, k in (("GEMM1", dims.randn(r, H, seed=4), 2 * inter, H),
                                    ("GEMM2", dims.randn(r, inter, seed=5), H, inter)):
            case = f"grouped {gname} {name}"
            flops, act = 2 * r * n_out * k, 2 * r * (k + n_out)
            wb = dims.randn(E, n_out, k, seed=6, std=k ** -0.5)
            row(rows, case, n, "bf16 _grouped_mm", dims.timed(lambda: torch._grouped_mm(x, wb.transpose(1, 2), offs=offs)),
                flops, E * n_out * k * 2 + act, PEAK["bf16"])
            del wb
            for f in dims.fmts:
                w = dims.qweight(f, (E, n_out, k), k ** -0.5, 7, gscale_dims=1)
                op, args = grouped_op(x, w, offs)
                vname = engine_variant(op, args, dims)
                check, fn = checked(op, vname, args, f)
                ok &= check.ok
                row(rows, case, n, f, dims.timed(fn), flops, E * n_out * k * BITS[f] / 8 + act,
                    PEAK["fp8" if f == "fp8" else "bf16"], check, vname)
                if f == "fp8":      # the GEMM alone, on rows quantized once (the MoE shares them by micro)
                    xq, xs = qt.quantize_rows(x)
                    row(rows, case, n, "fp8 GEMM only",
                        dims.timed(lambda: qcuda.scaled_grouped(xq, xs, w.codes, w.scales, offs, BF16)), flops,
                        E * n_out * k + r * (k + 2 * n_out), PEAK["fp8"])
                    row(rows, case, n, "fp8 row quantizer only", dims.timed(lambda: qt.quantize_rows(x)), 0,
                        r * k * 3 + r * 4, PEAK["fp8"])
                del w
    return ok


# ------------------------------------------------------------------------------------ the MoE op

def moe_weights(dims: Dims, fmt: str, inter: int, micros: int, seed: int) -> dict:
    H, E = dims.H, dims.E
    if fmt == "bf16":
        return dict(w1=dims.randn(micros, E, 2 * inter, H, seed=seed, std=H ** -0.5),
                    w2=dims.randn(E, H, micros * inter, seed=seed, std=inter ** -0.5),
                    shared_w1=dims.randn(micros, 2 * inter, H, seed=seed, std=H ** -0.5),
                    shared_w2=dims.randn(H, micros * inter, seed=seed, std=inter ** -0.5))
    shared = "mxfp8" if fmt == "mxfp4" else fmt          # the MXFP4-mixed build keeps the shared MLP in MXFP8
    return dict(w1=dims.qweight(fmt, (micros, E, 2 * inter, H), H ** -0.5, seed, 1),
                w2=dims.qweight(fmt, (E, H, micros * inter), inter ** -0.5, seed + 1, 1),
                shared_w1=dims.qweight(shared, (micros, 2 * inter, H), H ** -0.5, seed + 2),
                shared_w2=dims.qweight(shared, (H, micros * inter), inter ** -0.5, seed + 3))


def moe_args(x, gate, w: dict, ms: int, mc: int, dims: Dims) -> tuple:
    return (x, gate, w["w1"], w["w2"], w["shared_w1"], w["shared_w2"], ms, mc, dims.K, True)


def decode_bytes(x, gate, fmt: str, inter: int, mc: int, dims: Dims) -> float:
    """Bytes the decode path must read: the chosen experts' and the shared MLP's weights of the active
    micros, the router, the tokens."""
    _, idx = route(x, gate, dims.K, True)
    shared = "mxfp8" if fmt == "mxfp4" else fmt
    per = 3 * inter * dims.H * mc
    return (idx.unique().numel() * per * BITS[fmt] + per * BITS[shared]) / 8 + dims.E * dims.H * 4 + 4 * x.numel()


def moe_decode_rows(dims: Dims, rows: list, case: str, fmt: str, w: dict, gate, n: int, inter: int, mc: int,
                    label: str) -> bool:
    """Four decode calls (distinct tokens) of the op, eager and as one CUDA graph, the first checked."""
    op = "moe" if fmt == "bf16" else "moe_quant"
    xs = [dims.randn(n, dims.H, seed=20 + i) for i in range(4)]
    fns = [variants.runner(op, "decode", *moe_args(x, gate, w, 0, mc, dims)) for x in xs]
    check = None
    if fmt != "bf16":
        check, _ = checked(op, "decode", moe_args(xs[0], gate, w, 0, mc, dims), fmt)
    nbytes = sum(decode_bytes(x, gate, fmt, inter, mc, dims) for x in xs) / len(xs)
    flops = 2 * n * (dims.K + 1) * 3 * inter * dims.H * mc
    row(rows, case, n, f"{label} eager", dims.timed(lambda: [f() for f in fns], per=len(xs)), flops, nbytes,
        PEAK["bf16"], check, "decode")
    if not dims.dry:
        row(rows, case, n, f"{label} graph", dims.timed(lambda: [f() for f in fns], graph=True, per=len(xs)),
            flops, nbytes, PEAK["bf16"], None, "decode")
    return check is None or check.ok


def moe_cases(dims: Dims, rows: list) -> bool:
    ok = True
    gate = torch.randn(dims.E, dims.H, generator=dims.gen(8), device=dims.dev) * dims.H ** -0.5
    for name, inter, micros, ms, mc in dims.decode_moe:
        for n in (1, 8):
            for f in ("bf16",) + dims.fmts:
                ok &= moe_decode_rows(dims, rows, f"moe decode {name}", f, moe_weights(dims, f, inter, micros, 9),
                                      gate, n, inter, mc, f)
    for name, inter, micros, ms, mc, n in dims.denoise_moe:
        case = f"moe denoise {name}"
        x = dims.randn(n, dims.H, seed=30)
        flops = 6 * n * (dims.K + 1) * mc * dims.H * inter
        for f in ("bf16",) + dims.fmts:
            w = moe_weights(dims, f, inter, micros, 10)
            args = moe_args(x, gate, w, ms, mc, dims)
            op = "moe" if f == "bf16" else "moe_quant"
            vname = engine_variant(op, args, dims)
            check, fn = checked(op, vname, args, f)
            ok &= check.ok
            wbytes = 3 * dims.E * inter * dims.H * mc * BITS[f] / 8
            row(rows, case, n, f, dims.timed(fn), flops, wbytes + 4 * n * dims.K * dims.H * 2,
                PEAK["fp8" if f == "fp8" else "bf16"], check if f != "bf16" else None, vname)
            del w, args
    return ok


# ------------------------------------------------------------------------------------ --decode

def _route_order(ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """For 1 token: the slot of each of its K choices (y's rows are in choice order)."""
    return torch.searchsorted(active[active >= 0].contiguous(), ids[0].contiguous())


def _unprep(a: torch.Tensor, fmt: str) -> torch.Tensor:
    """Prepared rows (fp32, phase-major, times 2^64) back to the natural order."""
    ph = qg.PH[fmt]
    r, k = a.shape
    return a.view(r, ph, k // ph).transpose(1, 2).reshape(r, k) / qg.XSCALE


def _cfg(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def decode_kernel_cases(dims: Dims, rows: list, sweep: bool) -> bool:
    """The routed gate/up and down GEMVs alone (tp1, 1 token, the 8 chosen experts), checked against the
    dequantized experts; (sweep) a few tile configs: GB/s of expert weights."""
    from hunyuan_kernels.moe import triton_kernels as tk
    H, E, K, inter = dims.H, dims.E, dims.K, dims.decode_inter
    gate = torch.randn(E, H, generator=dims.gen(50), device=dims.dev) * H ** -0.5
    x = dims.randn(1, H, seed=51)
    _, ids, active = tk.router_select(tk.router_logits(x, gate), K, True, plan=False)
    s = active.shape[0]
    ok = True
    for f in ("mxfp4", "mxfp8", "nvfp4"):
        w1 = dims.qweight(f, (1, E, 2 * inter, H), H ** -0.5, 52, 1)
        w2 = dims.qweight(f, (E, H, inter), inter ** -0.5, 53, 1)          # one micro: the whole row
        up_bytes, down_bytes = K * 2 * inter * H * BITS[f] / 8, K * H * inter * BITS[f] / 8
        e = active.long()                       # the reference: the chosen experts, dequantized
        h = torch.einsum("h,eoh->eo", x[0].float(), w1[0].dequantize(BF16)[e].float())
        want_act = (h[:, :inter] * F.silu(h[:, inter:])).to(BF16)
        want_y = torch.einsum("ei,ehi->eh", want_act.float(), w2.dequantize(BF16)[e].float())
        args1 = (ids, active, f, w1.codes, w1.scales, w1.gscale, w1.inverse)
        args2 = (ids, active, f, w2.codes, w2.scales, w2.gscale, w2.inverse)
        ph = qg.act_ph(f)
        xp = qg.prep(x, f)
        row(rows, "prep x", 1, f, dims.timed(lambda: qg.prep(x, f)), 0, H * 6, PEAK["bf16"])
        ups = [dict(qg.DECODE_UP, **qg.DECODE_UP_FMT.get(f, {}))]
        downs = [dict(qg.DECODE_DOWN, **qg.DECODE_DOWN_FMT.get(f, {}))]
        if sweep:
            ups += [dict(BI=bi, G=g, num_warps=nw) for bi, g, nw in ((16, 32, 8), (4, 32, 4), (8, 32, 4), (16, 32, 4),
                                                                        (8, 16, 4), (32, 32, 8))]
            downs += [dict(R=r, G=g, num_warps=nw) for r, g, nw in ((32, 32, 8), (8, 32, 4), (16, 32, 4), (32, 32, 4),
                                                                       (16, 16, 8), (64, 32, 8))]
        for i, cfg in enumerate(ups):
            act = torch.full((1, s, 1, inter), float("nan"), device=dims.dev)
            up = (lambda cfg=cfg, act=act: qg.decode_up(xp, *args1, act, s, inter, cfg, x_prepared=True, act_prep=ph))
            up()
            got = _unprep(act[0, :, 0], f) if ph else act[0, :, 0]
            check = compare(got.float(), want_act.float(), 1e-2)
            ok &= check.ok
            row(rows, "routed up tp1", 1, f"{f} gemv{' ' + _cfg(cfg) if i else ''}", dims.timed(up), 0, up_bytes,
                PEAK["bf16"], check)
        act_in = (qg.prep(want_act, f) if ph else want_act).reshape(1, s, 1, inter)
        y = torch.empty(K, H, dtype=torch.float32, device=dims.dev)
        for i, cfg in enumerate(downs):
            y.fill_(float("nan"))
            down = (lambda cfg=cfg: qg.decode_down(act_in, *args2, y, s, inter, down=cfg, act_prepared=bool(ph)))
            down()
            check = compare(y.view(1, K, H)[0], want_y[_route_order(ids, active)], 1e-2)
            ok &= check.ok
            row(rows, "routed down tp1", 1, f"{f} gemv{' ' + _cfg(cfg) if i else ''}", dims.timed(down), 0,
                down_bytes, PEAK["bf16"], check)
        del w1, w2
    return ok


def decode_linear_cases(dims: Dims, rows: list, sweep: bool) -> bool:
    """The dense linears of one token (8 for qkv): the op's "gemv" variant against its "triton" split-K tile
    variant (and, sweep, a few GEMV tiles); FP8: cuBLAS's W8A8 against the GEMV on rows quantized per token."""
    ok = True
    H = dims.H
    for name, n_out, m in dims.decode_linear:
        x = dims.randn(m, H, seed=60 + m)
        for f in dims.fmts:
            w = dims.qweight(f, (n_out, H), H ** -0.5, 61)
            nbytes = n_out * H * BITS[f] / 8 + 2 * m * (H + n_out)
            op, args = linear_op(x, w)
            want = variants.run(op, "torch", *args)          # (FP8: W8A8, the activations quantized per row)
            for vname in (("scaled_mm", "gemv") if f == "fp8" else ("triton", "gemv")):
                fn = variants.runner(op, vname, *args, direct=True)      # both timed alike: no dispatch
                with poisoned():
                    check = compare(fn(), want, tol(f))
                ok &= check.ok
                row(rows, f"linear {name}", m, f"{f} {vname}", dims.timed(fn), 0, nbytes, PEAK["bf16"], check, vname)
            if sweep and m == 1 and f != "fp8":
                for cfg in (dict(R=r, G=32, num_warps=nw, PREP=p) for r, nw, p in
                            ((8, 4, True), (16, 4, True), (32, 8, True), (16, 8, False), (8, 8, True))):
                    def gemv(cfg=cfg):
                        return qg.linear(x, f, w.codes, w.scales, w.gscale, w.inverse, cfg=cfg)
                    with poisoned():
                        check = compare(gemv(), want, tol(f))
                    ok &= check.ok
                    row(rows, f"linear {name}", m, f"{f} gemv {_cfg(cfg)}", dims.timed(gemv), 0, nbytes, PEAK["bf16"],
                        check)
            del w
    return ok


def decode_rows_cases(dims: Dims, rows: list) -> bool:
    """The dense qkv linear at a decode step's 1..16 rows on the GEMV, past gemv.LINEAR_MAX_M too (called directly:
    the registry's fits stop at it), against the tile variant the registry picks past it (MX/NVFP4: the triton
    tile, FP8: cuBLAS) at every N: where the two cross (gemv.LINEAR_MAX_M), and whether the GEMV can serve a
    server's --max-batch 16 (issue 42 item 5). A server batch stays batch invariant only while every linear
    stays on one kernel, so each GEMV row is also checked to be bitwise the one it gives alone (the first row
    at m rows against the same row alone)."""
    ok = True
    H = dims.H
    name, n_out, _ = dims.decode_linear[0]
    for f in dims.fmts:
        w = dims.qweight(f, (n_out, H), H ** -0.5, 61)
        x = dims.randn(max(dims.decode_rows), H, seed=70)
        gemv = ((lambda xm: qcuda.linear_fp8_gemv(xm, w.codes, w.scales)) if f == "fp8" else
                (lambda xm: qg.linear(xm, f, w.codes, w.scales, w.gscale, w.inverse)))
        alone = gemv(x[:1].contiguous())
        for m in dims.decode_rows:
            xm = x[:m].contiguous()
            op, args = linear_op(xm, w)
            want = variants.run(op, "torch", *args)
            nbytes = n_out * H * BITS[f] / 8 + 2 * m * (H + n_out)
            with poisoned():
                got = gemv(xm)
            check = compare(got, want, tol(f))
            same = torch.equal(got[:1], alone)
            ok &= check.ok and same
            row(rows, f"linear {name} rows", m, f"{f} gemv", dims.timed(lambda: gemv(xm)), 0, nbytes, PEAK["bf16"],
                check if same else f"{check}; row 0 differs from alone (batch variance)", "gemv direct")
            # the tile variant at every N (the registry's pick past LINEAR_MAX_M): where the two cross
            vname = "scaled_mm" if f == "fp8" else "triton"
            fn = variants.runner(op, vname, *args, direct=True)
            with poisoned():
                check = compare(fn(), want, tol(f))
            ok &= check.ok
            row(rows, f"linear {name} rows", m, f"{f} {vname}", dims.timed(fn), 0, nbytes, PEAK["bf16"], check, vname)
        del w
    return ok


def decode_op_cases(dims: Dims, rows: list) -> bool:
    """One MoE layer's decode (`moe_quant` "decode": routed top-8 + the shared MLP) at tp1 and tp4."""
    ok = True
    gate = torch.randn(dims.E, dims.H, generator=dims.gen(8), device=dims.dev) * dims.H ** -0.5
    for name, inter, micros, _, mc in dims.decode_moe:
        for f in dims.fmts:
            w = moe_weights(dims, f, inter, micros, 9)
            for n in (1, 8):
                ok &= moe_decode_rows(dims, rows, f"moe decode {name}", f, w, gate, n, inter, mc,
                                      f"{f}{'+mxfp8 shared' if f == 'mxfp4' else ''}")
            del w
    return ok


# ------------------------------------------------------------------------------------ --tune

def _sweep(label: str, configs: list, run, work: float, unit: str, out: Output) -> dict:
    """Times `run(cfg)` for each config (one that does not compile is skipped); prints the best."""
    res = []
    for cfg in configs:
        try:
            res.append((time_ms(lambda: run(cfg), "bench"), cfg))
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
            out.say(f"tune {label} {cfg}: {type(e).__name__}")
    ms, cfg = min(res, key=lambda r: r[0])
    rate = work / ms / (1e9 if unit == "TFLOP/s" else 1e6)         # work per ms -> TFLOP/s or GB/s
    out.say(f"tune {label}: best {ms * 1e3:.1f} us ({rate:.0f} {unit}) with {cfg}")
    return dict(kernel=label, results=res)


def tune(dims: Dims, fmts: list[str], out: Output) -> list[dict]:
    """The tile kernels' configs, per format, at one real shape each (paste the best into
    hunyuan_kernels/quant/triton_kernels.py: LINEAR_LARGE, LINEAR_SMALL (9-16 rows: fewer take the GEMV), GROUPED)."""
    H, E, K = dims.H, dims.E, dims.K
    res = []
    x = dims.randn(8194, H, seed=40)
    x16 = x[:16].contiguous()
    r = 8194 * K
    offs = torch.bincount(torch.randint(0, E, (r,), generator=dims.gen(43), device=dims.dev), minlength=E).cumsum(0).int()
    xr = dims.randn(r, H, seed=44)
    tiles = [dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=w, num_stages=st)
             for bm, bn, bk, w, st in ((128, 128, 32, 8, 3), (128, 128, 64, 8, 3), (64, 128, 32, 8, 3),
                                       (64, 128, 64, 8, 4), (128, 64, 64, 4, 3), (128, 256, 32, 8, 3))]
    small = [dict(BM=16, BN=bn, BK=bk, GROUP_M=1, num_warps=wp, num_stages=3)
             for bn, bk, wp in ((32, 256, 8), (16, 256, 4), (32, 128, 4), (64, 128, 8), (32, 512, 8))]
    for f in fmts:
        w = dims.qweight(f, (6144, H), H ** -0.5, 41)

        def lin(cfg, xx):
            return qt.linear(xx, f, w.codes, w.scales, w.gscale, w.inverse, cfg=cfg)
        res.append(_sweep(f"linear {f} M=8194", tiles, lambda c: lin(c, x), 2 * 8194 * 6144 * H, "TFLOP/s", out))
        res.append(_sweep(f"linear {f} M=16", small, lambda c: lin(c, x16), 6144 * H * BITS[f] / 8, "GB/s", out))
        del w
        pack = dims.qweight(f, (E, 2 * 3072, H), H ** -0.5, 46, gscale_dims=1)
        res.append(_sweep(f"grouped {f} tp1 GEMM1", tiles,
                          lambda c: qt.grouped(xr, f, pack.codes, pack.scales, offs, pack.gscale, pack.inverse, cfg=c),
                          2 * r * 2 * 3072 * H, "TFLOP/s", out))
        del pack
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------ run

def run(args: argparse.Namespace, out: Output) -> bool:
    dims = Dims(args.dry, args.quick)
    t0 = time.time()
    if not args.dry:
        first = {op: [i.backend for i in kernels.registry.candidates(op, "cuda", BF16)]
                 for op in ("linear_mxfp4", "grouped_mm_nvfp4", "linear_fp8", "grouped_mm_fp8", "moe_quant")}
        out.say(f"the registry's variants on CUDA bf16, in order: {first}")
        out.data["variants"] = first
    if args.decode:
        out.name = "kernels-quant-decode"
        sections = {"kernels": lambda r: decode_kernel_cases(dims, r, args.sweep),
                    "linear": lambda r: decode_linear_cases(dims, r, args.sweep),
                    "rows": lambda r: decode_rows_cases(dims, r),
                    "moe": lambda r: decode_op_cases(dims, r)}
        chosen = [s for s in args.sections.split(",") if s in sections]
    else:
        sections = {"linear": lambda r: linear_cases(dims, r), "grouped": lambda r: grouped_cases(dims, r),
                    "moe": lambda r: moe_cases(dims, r)}
        chosen = list(sections)
        if args.tune and not args.dry:
            out.data["tune"] = tune(dims, args.tune_formats.split(","), out)
    rows: list[dict] = []
    ok = True
    for name in chosen:
        ok &= sections[name](rows)
        out.say(f"{name} done ({time.time() - t0:.0f} s)")
        if not args.dry:
            torch.cuda.empty_cache()
    out.data["rows"] = rows
    out.table(rows, [Col("case", "case"), Col("N", "n"), Col("path", "path"), Col("ran", "ran"),
                     Col("ms", "ms", ".4f"), Col("rate", "rate"), Col("of floor", "floor", ".0%"),
                     Col("rel err", "err")])
    out.say(f"checks: {'all passed' if ok else 'FAILED'}  ({time.time() - t0:.0f} s)")
    return ok
