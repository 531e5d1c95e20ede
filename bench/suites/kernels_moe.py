"""The `moe` kernel op at the real per-rank shapes of HunyuanImage-3.0 (H 4096, E 64, top-8, random bf16
weights): every variant checked against the reference on fresh random inputs (output and scratch
poisoned with NaN; run-to-run equal), then timed (median of triton.testing.do_bench, L2 flushed).

    python -m bench kernels-moe [--quick] [--tune] [--profile]
    python -m bench kernels-moe --dry      # CPU, Triton interpreter, tiny shapes: the checks only

Denoise: hybrid4 (TP2 x 2 micros, N = 2 x 2049), tp4 (1 micro, N = 2 x 4097), tp1 (one GPU, I 3072,
N = 8194): the engine's variant ("fused": GEMM1 + SwiGLU in one kernel), "grouped" (GEMM1 on
torch._grouped_mm), the two-dispatch ablation (`bench.ablations`: every micro routed and finalized on
its own), the reference, the engine's first MoE (index_add_ finalize), and the grouped GEMMs alone (the
part torch._grouped_mm does). Decode (hybrid4 AR = TP4, one micro): N = 1, 2, 8, the "decode" variant
eager and as a CUDA graph, bytes vs the 4.3 TB/s floor. --tune sweeps the decode kernels' tiles
(hunyuan_kernels/moe/triton_kernels.py DECODE_UP / DECODE_DOWN) on the kernels alone.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from hunyuan_kernels.moe import moe_reference, route, swiglu_halves
from hunyuan_kernels.scratch import poisoned

from .. import ablations, variants
from ..checks import Check, compare
from ..profiling import op_table
from ..report import Col, Output
from ..timing import time_ms

DRY = True
PEAK_TFLOPS, PEAK_TBS = 790.0, 4.3             # H200 measured: bf16 dense matmul, copy bandwidth


class Dims:
    """The op's sizes: the real model's, or (--dry) tiny ones the interpreter runs in seconds.
    denoise: name -> (N, I_micro, micros resident, micro_start, micro_count); decode: the same for AR."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.dev = "cpu" if dry else "cuda"
        if dry:
            self.H, self.E, self.K = 64, 8, 3
            self.denoise = {"hybrid4": (37, 32, 2, 0, 2), "tp1": (23, 48, 1, 0, 1)}
            self.decode, self.tokens = (32, 2, 1, 1), (1, 5)
        else:
            self.H, self.E, self.K = 4096, 64, 8
            self.denoise = {"hybrid4": (2 * 2049, 768, 2, 0, 2), "tp4": (2 * 4097, 768, 1, 0, 1),
                            "tp1": (8194, 3072, 1, 0, 1)}
            self.decode, self.tokens = (768, 2, 1, 1), (1, 2, 8)

    def weights(self, inter: int, micros: int, seed: int, layers: int = 1) -> list[dict]:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        H, E = self.H, self.E

        def rnd(*shape, scale, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=g, device=self.dev) * scale).to(dtype)
        return [dict(gate=rnd(E, H, scale=H ** -0.5, dtype=torch.float32),
                     w1=rnd(micros, E, 2 * inter, H, scale=H ** -0.5), w2=rnd(E, H, micros * inter, scale=inter ** -0.5),
                     shared_w1=rnd(micros, 2 * inter, H, scale=H ** -0.5),
                     shared_w2=rnd(H, micros * inter, scale=inter ** -0.5)) for _ in range(layers)]

    def tokens_of(self, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator(device=self.dev).manual_seed(seed)
        return torch.randn(n, self.H, generator=g, device=self.dev).bfloat16()

    def args(self, x: torch.Tensor, w: dict, ms: int, mc: int) -> tuple:
        return (x, w["gate"], w["w1"], w["w2"], w["shared_w1"], w["shared_w2"], ms, mc, self.K, True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tune", action="store_true", help="sweep the decode kernels' tiles first")
    ap.add_argument("--quick", action="store_true", help="skip timing the reference and the engine baseline")
    ap.add_argument("--profile", action="store_true", help="the CUDA kernels of a hybrid4 denoise and decode call")


def engine_first(x, gate, w1, w2, sw1, sw2, ms, mc, k, norm):
    """The engine's first MoE (the baseline): per-micro GEMMs and bf16 partial sums, atomic index_add_
    finalize in bf16 (micro m's down weights are w2[:, :, m*I:(m+1)*I])."""
    E, H = gate.shape
    w, idx = route(x, gate, k, norm)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    xs = x.index_select(0, token)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    partial = None
    inter = w1.shape[2] // 2
    for m in range(ms, ms + mc):
        y = torch._grouped_mm(swiglu_halves(torch._grouped_mm(xs, w1[m].transpose(1, 2), offs=offs)),
                              w2[:, :, m * inter:(m + 1) * inter].transpose(1, 2), offs=offs)
        partial = y if partial is None else partial + y
    out = torch.zeros_like(x).index_add_(0, token, (partial.float() * w.reshape(-1)[order].unsqueeze(1)).to(x.dtype))
    is_m = sw1.shape[1] // 2
    h = F.linear(x, sw1[ms:ms + mc].reshape(-1, H)).view(x.shape[0], mc, 2 * is_m)
    return out + F.linear(swiglu_halves(h).reshape(x.shape[0], -1), sw2[:, ms * is_m:(ms + mc) * is_m])


def check(args: tuple, variant: str) -> Check:
    """The variant (output and scratch NaN-poisoned) against the reference, and a second run equal to it."""
    ref = moe_reference(*args)
    out = torch.full_like(args[0], float("nan"))
    with poisoned():
        got = variants.run("moe", variant, *args, out=out)
    return compare(got, ref, 1e-2, again=variants.run("moe", variant, *args))


def timed(fn, dims: Dims) -> float:
    return time_ms(fn, "bench") if not dims.dry else time_ms(fn, "wall", n=1, warmup=0)


def denoise_case(name: str, dims: Dims, quick: bool, rows: list) -> bool:
    n, inter, micros, ms, mc = dims.denoise[name]
    H, E, K = dims.H, dims.E, dims.K
    w = dims.weights(inter, micros, seed=1)[0]
    args = dims.args(dims.tokens_of(n, 2), w, ms, mc)
    gemm_flops = 6 * n * K * mc * H * inter
    flops = gemm_flops + 6 * n * mc * H * inter + 2 * n * E * H
    paths = ("fused", "grouped") + (("two_dispatch",) if mc > 1 else ())
    checks = {p: check(dims.args(dims.tokens_of(n, 3 + i), w, ms, mc), p) for i, p in enumerate(paths)}
    t = {p: timed(variants.runner("moe", p, *args), dims) for p in paths}
    if not quick:
        t["reference"] = timed(lambda: moe_reference(*args), dims)
        t["engine's first MoE"] = timed(lambda: engine_first(*args), dims)
    # the grouped GEMMs alone on prepared rows: what the rest of the path adds on top
    x = args[0]
    _, idx = route(x, w["gate"], K, True)
    order = idx.reshape(-1).argsort(stable=True)
    xs = x.index_select(0, order // K)
    offs = torch.bincount(idx.reshape(-1), minlength=E).cumsum(0).int()
    act = torch.randn(xs.shape[0], mc * inter, device=dims.dev).bfloat16()
    down = w["w2"][:, :, ms * inter:(ms + mc) * inter].transpose(1, 2)     # the view the grouped path multiplies

    def gemms():                          # as the grouped path: GEMM1 per micro, one GEMM2 over all of them
        for m in range(ms, ms + mc):
            torch._grouped_mm(xs, w["w1"][m].transpose(1, 2), offs=offs)
        torch._grouped_mm(act, down, offs=offs)
    t["grouped GEMMs only"] = timed(gemms, dims)
    for path, ms_ in t.items():
        f = gemm_flops if path == "grouped GEMMs only" else flops
        rows.append(dict(case=f"denoise {name}", n=n, path=path, ms=ms_, rate=f"{f / ms_ / 1e9:.0f} TFLOP/s",
                         floor=f / (PEAK_TFLOPS * 1e12) * 1e3 / ms_, err=str(checks[path]) if path in checks else None))
    return all(c.ok for c in checks.values())


def decode_bytes(x: torch.Tensor, w: dict, mc: int, inter: int, dims: Dims) -> float:
    _, idx = route(x, w["gate"], dims.K, True)
    per = mc * 3 * inter * dims.H * 2
    return idx.unique().numel() * per + per + dims.E * dims.H * 4 + 2 * x.numel() * 2


def decode_case(n: int, dims: Dims, rows: list, layers: int = 4, calls: int = 8) -> bool:
    """`calls` decode calls on `layers` distinct weights (so L2 does not hold them), eager and as one graph."""
    inter, micros, ms, mc = dims.decode
    ws = dims.weights(inter, micros, seed=7, layers=layers)
    checks = [check(dims.args(dims.tokens_of(n, seed), ws[0], ms, mc), "decode") for seed in (10, 11)]
    xs = [dims.tokens_of(n, 20 + i) for i in range(calls)]
    nbytes = sum(decode_bytes(xs[i], ws[i % layers], mc, inter, dims) for i in range(calls)) / calls
    fns = [variants.runner("moe", "decode", *dims.args(xs[i], ws[i % layers], ms, mc)) for i in range(calls)]
    refs = [(lambda a=dims.args(xs[i], ws[i % layers], ms, mc): moe_reference(*a)) for i in range(calls)]
    t = {"reference": timed(lambda: [f() for f in refs], dims) / calls,
         "decode eager": timed(lambda: [f() for f in fns], dims) / calls}
    if not dims.dry:
        t["decode graph"] = time_ms(lambda: [f() for f in fns], "graph", per=calls)
    err = f"{max(c.err for c in checks):.1e}" + ("" if all(c.ok for c in checks) else " FAIL")
    for path, ms_ in t.items():
        rows.append(dict(case="decode hybrid4", n=n, path=path, ms=ms_, rate=f"{nbytes / ms_ / 1e9:.0f} GB/s",
                         floor=nbytes / (PEAK_TBS * 1e12) * 1e3 / ms_, err=err if path != "reference" else None))
    return all(c.ok for c in checks)


def tune_decode(dims: Dims, out: Output) -> list[dict]:
    """The decode kernels' tiles (N = 1, one micro, the 8 chosen experts + the shared MLP as one more
    slot), each kernel alone on one routing: the best of each printed."""
    from hunyuan_kernels.moe import triton_kernels as tk
    inter, micros, ms, mc = dims.decode
    w = dims.weights(inter, micros, seed=7)[0]
    x = dims.tokens_of(1, 30)
    _, ids, active = tk.router_select(tk.router_logits(x, w["gate"]), dims.K, True, plan=False)
    s = active.shape[0]
    w1a, w2a = w["w1"][ms:ms + mc], w["w2"][:, :, ms * inter:]
    sw1, sw2 = w["shared_w1"][ms:ms + mc], w["shared_w2"][:, ms * inter:]
    act = torch.empty(mc, s + 1, 16, inter, dtype=x.dtype, device=dims.dev)
    y = torch.empty(dims.K, dims.H, dtype=torch.float32, device=dims.dev)
    ys = torch.empty(1, dims.H, dtype=torch.float32, device=dims.dev)
    res = []
    for bi in (16, 32):
        for bh in (128, 256, 512):
            for st in (3, 4, 5):
                cfg = dict(BLOCK_I=bi, BLOCK_H=bh, num_warps=4, num_stages=st)
                res.append(dict(kernel="up", cfg=cfg, ms=time_ms(
                    lambda: tk.decode_up(x, ids, active, w1a, sw1, act, s + 1, inter, up=cfg), "bench")))
    for bho in (16, 32, 64):
        for bi in (64, 128, 256):
            cfg = dict(BLOCK_HO=bho, BLOCK_I=bi, num_warps=4, num_stages=4)
            res.append(dict(kernel="down", cfg=cfg, ms=time_ms(
                lambda: tk.decode_down(act, ids, active, w2a, sw2, y, ys, s + 1, inter, down=cfg), "bench")))
    for kind, default in (("up", tk.DECODE_UP), ("down", tk.DECODE_DOWN)):
        best = min((r for r in res if r["kernel"] == kind), key=lambda r: r["ms"])
        out.say(f"tune {kind}: best {best['ms'] * 1e3:.1f} us with {best['cfg']} (the kernels' default: {default})")
    return res


def profile(dims: Dims, out: Output) -> None:
    """The CUDA kernels of five calls at hybrid4 denoise and at decode N = 1, to see where the time goes."""
    for label, (n, inter, micros, ms, mc) in (("denoise hybrid4", dims.denoise["hybrid4"]),
                                               ("decode N=1", (1,) + dims.decode)):
        w = dims.weights(inter, micros, seed=1)[0]
        fn = variants.runner("moe", "decode" if n == 1 else "fused", *dims.args(dims.tokens_of(n, 2), w, ms, mc))
        out.say(f"--- {label}: CUDA kernels over 5 calls")
        for line in op_table(fn, "cuda_time_total", rows=14, calls=5):
            out.say(line)


def run(args: argparse.Namespace, out: Output) -> bool:
    dims = Dims(args.dry)
    ablations.register()
    t0 = time.time()
    if not args.dry:
        out.say(f"the registry's first moe variant on CUDA bf16: {variants.first('moe', 'cuda', torch.bfloat16)}")
    rows: list[dict] = []
    ok = True
    if args.tune and not args.dry:
        out.data["tune"] = tune_decode(dims, out)
    if args.profile and not args.dry:
        profile(dims, out)
    for n in dims.tokens:
        ok &= decode_case(n, dims, rows)
        out.say(f"decode N={n} done ({time.time() - t0:.0f} s)")
    for name in dims.denoise:
        ok &= denoise_case(name, dims, args.quick, rows)
        out.say(f"denoise {name} done ({time.time() - t0:.0f} s)")
    out.data["rows"] = rows
    out.table(rows, [Col("case", "case"), Col("N", "n"), Col("path", "path"), Col("ms", "ms", ".3f"),
                     Col("rate", "rate"), Col("of floor", "floor", ".0%"), Col("rel err", "err")])
    out.say(f"checks: {'all passed' if ok else 'FAILED'}  ({time.time() - t0:.0f} s)")
    return ok
