"""The quantized decode MoE of a batched decode step: N = 1..32 tokens, each format, against the floor of
reading the experts those tokens touch once.

    python -m bench moe-decode [--quick] [--layers 32] [--formats mxfp4,mxfp8,nvfp4,fp8] [--ns 1,2,4,8,16,32]
                               [--variants batched,decode,grouped] [--tune]
    python -m bench moe-decode --dry                  # CPU, Triton's interpreter, tiny shapes

For each format (the MXFP4 build keeps its shared MLP in MXFP8, the others are uniform; "bf16" is the
`moe` op, at most 16 layers) and N: `--layers` distinct tp1 layers (H 4096, E 64, top-8, I 3072, the
shared MLP), random weights, each layer with its own random tokens and router (uniform random routing),
all of them captured in ONE CUDA graph (the weights of 32 layers are far beyond L2, as in a real step).
Each row: the replay's ms for the step and per layer, the distinct experts the tokens touch per layer
(from the routing), the floor (the touched experts' bytes of every layer, the shared MLP, the router, at
4.3 TB/s) and the cost over it (target of issue 31: within 1.5x at N = 16), and the cost over the same
variant's N = 1. Before timing, each variant is checked on layer 0 against the op's reference (outputs
poisoned), and `batched` (and bf16's `decode`) for batch invariance (a token alone gives the same bits).
Variants: `batched` (expert-major, every N <= 32), `decode` (the GEMVs, N <= 8; bf16: the `moe` op's
decode, N <= 32), `grouped` (every N).
--tune: a few tile configs of `batched` (its `tiles` argument over triton_kernels.EDECODE_UP / EDECODE_DOWN) at N = 1 and 16, MXFP4;
--tune-scaled: the same tiles with the SCALED key (Triton's tl.dot_scaled upcasting the MX codes itself).
--tune-decode: the GEMV decode's tiles (its `tiles` argument over gemv.DECODE_UP / DECODE_DOWN: rows a program,
chunks along K, warps, tokens a pass, a register cap) at N = 1, 8 and 16, MXFP4; the up GEMV's with today's
down, then the down GEMV's with today's up. Each is checked against the reference and for batch invariance
(a token alone gives the same bits). G (the K split) sets every token's summation order: a default must keep
one G for every N, the rest may differ per N.
"""
from __future__ import annotations

import argparse
import functools
import time

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.moe import route
from hunyuan_kernels.quant import QWeight, random_qweight
from hunyuan_kernels.scratch import poisoned

from ..checks import Check, compare
from ..report import Col, Output
from ..timing import time_ms
from .kernels_quant import BITS, PEAK_BW, tol

DRY = True
BF16 = torch.bfloat16
FUNCS = {"batched": "moe_quant_batched", "decode": "moe_quant_decode", "grouped": "moe_quant_grouped"}
LIMIT = {"batched": 32, "decode": 16, "grouped": 1 << 30}
SHARED = {"mxfp4": "mxfp8"}            # the MXFP4-mixed build's shared MLP; the others keep their format


class Dims:
    def __init__(self, dry: bool):
        self.dry, self.dev = dry, "cpu" if dry else "cuda"
        self.H, self.E, self.K, self.I = (128, 8, 2, 64) if dry else (4096, 64, 8, 3072)

    def gen(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.dev).manual_seed(seed)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="8 layers, N = 1, 8, 16, 32, batched and decode")
    ap.add_argument("--layers", type=int, default=0, help="distinct layers in the graph (default 32; quick 8)")
    ap.add_argument("--formats", default="", help="comma-separated: mxfp4,mxfp8,nvfp4,fp8,bf16 (default the four)")
    ap.add_argument("--ns", default="", help="token counts (default 1,2,4,8,16,32)")
    ap.add_argument("--variants", default="", help="comma-separated: batched,decode,grouped (default all)")
    ap.add_argument("--tune", action="store_true", help="sweep batched's tile configs first (MXFP4)")
    ap.add_argument("--tune-scaled", action="store_true",
                    help="the same sweep with the tiles' SCALED key (tl.dot_scaled on the MX codes)")
    ap.add_argument("--tune-decode", action="store_true",
                    help="sweep the GEMV decode's tile configs first (MXFP4, N = 1, 8, 16; up and down in turn)")
    ap.add_argument("--decode-max", type=int, default=LIMIT["decode"],
                    help="the most rows `decode` is timed at (default 16, the registry's most; up to 32)")


def layer(dims: Dims, fmt: str, seed: int) -> dict:
    """One layer's weights (tp1: one micro), its router and its own tokens (32 rows: a step takes the first N)."""
    H, E, I = dims.H, dims.E, dims.I
    g = dims.gen(seed)

    def w(f: str, shape: tuple, std: float, experts: bool) -> QWeight | torch.Tensor:
        if f == "bf16":
            return (torch.randn(*shape, generator=g, device=dims.dev) * std).to(BF16)
        return random_qweight(f, shape, std, dims.dev, g, inverse=f == "nvfp4", gscale_dims=1 if experts else 0)
    sf = SHARED.get(fmt, fmt)
    return dict(x=torch.randn(32, H, generator=g, device=dims.dev).to(BF16),
                gate=torch.randn(E, H, generator=g, device=dims.dev) * H ** -0.5,
                w1=w(fmt, (1, E, 2 * I, H), H ** -0.5, True), w2=w(fmt, (E, H, I), I ** -0.5, True),
                sw1=w(sf, (1, 2 * I, H), H ** -0.5, False), sw2=w(sf, (H, I), I ** -0.5, False))


def args_of(lay: dict, n: int, dims: Dims) -> tuple:
    return (lay["x"][:n], lay["gate"], lay["w1"], lay["w2"], lay["sw1"], lay["sw2"], 0, 1, dims.K, True)


def touched(lay: dict, n: int, dims: Dims) -> int:
    _, idx = route(lay["x"][:n], lay["gate"], dims.K, True)
    return idx.unique().numel()


def floor_bytes(fmt: str, experts: int, dims: Dims) -> float:
    """Bytes one layer must read: its touched experts, the shared MLP, the router (fp32), the tokens."""
    per = 3 * dims.I * dims.H
    return (experts * per * BITS[fmt] + per * BITS[SHARED.get(fmt, fmt)]) / 8 + dims.E * dims.H * 4


def variant_fn(fmt: str, name: str):
    if fmt == "bf16":
        from hunyuan_kernels.moe import cuda as moe_cuda
        return {"decode": moe_cuda.moe_decode, "grouped": moe_cuda.moe_grouped}[name]
    from hunyuan_kernels.quant import moe_cuda
    return getattr(moe_cuda, FUNCS[name])


def check(fmt: str, name: str, fn, args: tuple, invariant: bool = False) -> Check:
    """Layer 0 against the reference (poisoned scratch); the batch-invariant variants (batched, bf16's
    decode; `invariant`: any): each token alone gives the same bits."""
    with poisoned():
        got = fn(*args)
    with kernels.allowed():
        want = kernels.call("moe" if fmt == "bf16" else "moe_quant", *args)
    res = compare(got, want, 5e-2 if fmt == "fp8" else tol(fmt))
    if invariant or name == "batched" or (fmt == "bf16" and name == "decode"):
        rows = range(args[0].shape[0]) if args[0].shape[0] <= 4 or not args[0].is_cuda else range(0, 32, 3)
        same = all(torch.equal(got[t], fn(args[0][t:t + 1], *args[1:])[0]) for t in rows if t < args[0].shape[0])
        res = Check(res.err, res.ok and same)
    return res


def timed(dims: Dims, fns: list) -> float:
    """ms of one step: every layer's call, as one CUDA graph's replay (one wall call in a dry run)."""
    def step():
        return [f() for f in fns]
    return time_ms(step, "wall", n=1, warmup=0) if dims.dry else time_ms(step, "graph")


def fmt_rows(dims: Dims, fmt: str, nlayers: int, ns: list[int], names: list[str], rows: list, out: Output,
             limits: dict) -> bool:
    t0 = time.time()
    layers = [layer(dims, fmt, 100 * i + 7) for i in range(nlayers)]
    out.say(f"{fmt}: {nlayers} layers made ({time.time() - t0:.0f} s)")
    ok = True
    base: dict[str, float] = {}
    for n in ns:
        experts = [touched(lay, n, dims) for lay in layers]
        floor_ms = sum(floor_bytes(fmt, e, dims) for e in experts) / PEAK_BW * 1e3
        for name in names:
            limit = 32 if fmt == "bf16" and name == "decode" else limits[name]      # bf16: the `moe` op's decode
            if n > limit or (fmt == "bf16" and name == "batched"):
                continue
            fn = variant_fn(fmt, name)
            res = check(fmt, name, fn, args_of(layers[0], n, dims))
            ok &= res.ok
            calls = [(lambda a=args_of(lay, n, dims), f=fn: f(*a)) for lay in layers]
            ms = timed(dims, calls)
            if n == ns[0]:
                base[name] = ms
            rows.append(dict(fmt=fmt, variant=name, n=n, ms=ms, us_layer=ms / nlayers * 1e3,
                             experts=sum(experts) / nlayers, floor_ms=floor_ms, of_floor=ms / floor_ms,
                             of_n1=ms / base[name] if name in base else None, err=str(res)))
            out.say(f"  {fmt} {name} N={n}: {ms:.3f} ms ({ms / floor_ms:.2f}x floor) {res}")
    del layers
    if not dims.dry:
        torch.cuda.empty_cache()
    return ok


def tune(dims: Dims, out: Output, scaled: bool = False) -> list[dict]:
    """batched's tiles at N = 1 and 16 on 8 MXFP4 layers (each config checked, then timed)."""
    ups = [dict(BI=32, BK=128, num_warps=4), dict(BI=64, BK=64, num_warps=4), dict(BI=64, BK=128, num_warps=8),
           dict(BI=16, BK=256, num_warps=4)]
    downs = [dict(BH=64, BK=128, num_warps=4), dict(BH=128, BK=64, num_warps=4), dict(BH=128, BK=128, num_warps=8),
             dict(BH=32, BK=256, num_warps=4)]
    if scaled:       # the same tiles on tl.dot_scaled (Triton's MX upcast) instead of our dequantization
        ups, downs = [dict(u, SCALED=True) for u in ups], [dict(d, SCALED=True) for d in downs]
    layers = [layer(dims, "mxfp4", 100 * i + 7) for i in range(2 if dims.dry else 8)]
    fn = variant_fn("mxfp4", "batched")
    res = []
    for up in ups:
        for down in downs:
            tiles = dict(up=dict(up, num_stages=2), down=dict(down, num_stages=2))
            tiled = functools.partial(fn, tiles=tiles)
            for n in (1, 16):
                c = check("mxfp4", "batched", tiled, args_of(layers[0], n, dims))
                ms = timed(dims, [(lambda a=args_of(lay, n, dims): tiled(*a)) for lay in layers])
                res.append(dict(up=str(up), down=str(down), n=n, ms=ms, ok=c.ok))
                out.say(f"  tune up={up} down={down} N={n}: {ms:.3f} ms {c}")
    return res


# the GEMV tiles --tune-decode tries (today's first: gemv.DECODE_UP / DECODE_DOWN, tokens a pass gemv.DECODE_TB)
DECODE_UPS = [dict(BI=16, G=32, num_warps=8), dict(BI=32, G=32, num_warps=8), dict(BI=8, G=32, num_warps=4),
              dict(BI=32, G=16, num_warps=8), dict(BI=16, G=32, num_warps=8, TB=4),
              dict(BI=32, G=32, num_warps=8, TB=4, maxnreg=128)]
DECODE_DOWNS = [dict(R=16, G=32, num_warps=8), dict(R=32, G=32, num_warps=8), dict(R=8, G=32, num_warps=4),
                dict(R=32, G=16, num_warps=8), dict(R=16, G=32, num_warps=8, TB=4)]


def tune_decode(dims: Dims, out: Output) -> list[dict]:
    """The GEMV decode's tiles at N = 1, 8, 16 on 8 MXFP4 layers (each config checked, then timed)."""
    layers = [layer(dims, "mxfp4", 100 * i + 7) for i in range(2 if dims.dry else 8)]
    fn = variant_fn("mxfp4", "decode")
    configs = [dict(up=u, down=DECODE_DOWNS[0]) for u in DECODE_UPS] + \
              [dict(up=DECODE_UPS[0], down=d) for d in DECODE_DOWNS[1:]]
    res = []
    for tiles in configs:
        tiled = functools.partial(fn, tiles=tiles)
        for n in (1, 5) if dims.dry else (1, 8, 16):
            c = check("mxfp4", "decode", tiled, args_of(layers[0], n, dims), invariant=True)
            ms = timed(dims, [(lambda a=args_of(lay, n, dims): tiled(*a)) for lay in layers])
            res.append(dict(up=str(tiles["up"]), down=str(tiles["down"]), n=n, ms=ms, ok=c.ok, err=c.err))
            out.say(f"  tune-decode up={tiles['up']} down={tiles['down']} N={n}: {ms:.3f} ms {c}")
    return res


def run(args: argparse.Namespace, out: Output) -> bool:
    dims = Dims(args.dry)
    nlayers = args.layers or (2 if args.dry else 8 if args.quick else 32)
    fmts = [f for f in (args.formats or ("mxfp4,nvfp4" if args.dry else "mxfp4,mxfp8,nvfp4,fp8")).split(",") if f]
    ns = [int(v) for v in (args.ns or ("1,5" if args.dry else "1,8,16,32" if args.quick else "1,2,4,8,16,32")
                           ).split(",")]
    names = [v for v in (args.variants or ("batched,decode" if args.quick or args.dry else "batched,decode,grouped")
                         ).split(",") if v]
    for v in names:
        if v not in FUNCS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(FUNCS)}")
    if not args.dry:
        out.data["variants"] = [i.backend for i in kernels.registry.candidates("moe_quant", "cuda", BF16)]
        out.say(f"moe_quant's variants on CUDA bf16, in order: {out.data['variants']}")
    if args.tune:
        out.data["tune"] = tune(dims, out)
    if args.tune_scaled:
        out.data["tune_scaled"] = tune(dims, out, scaled=True)
    if args.tune_decode:
        out.data["tune_decode"] = tune_decode(dims, out)
    limits = dict(LIMIT, decode=min(args.decode_max, 32))
    rows: list[dict] = []
    ok = True
    for fmt in fmts:
        ok &= fmt_rows(dims, fmt, min(nlayers, 16) if fmt == "bf16" else nlayers, ns, names, rows, out, limits)
    out.data["rows"] = rows
    out.table(rows, [Col("format", "fmt"), Col("variant", "variant"), Col("N", "n"), Col("ms/step", "ms", ".3f"),
                     Col("us/layer", "us_layer", ".1f"), Col("experts/layer", "experts", ".1f"),
                     Col("floor ms", "floor_ms", ".3f"), Col("x floor", "of_floor", ".2f"),
                     Col("x N=1", "of_n1", ".2f"), Col("check", "err")],
              title=f"decode MoE, {nlayers} distinct layers in one graph" + (" (dry run)" if args.dry else ""))
    out.say(f"checks: {'all passed' if ok else 'FAILED'}")
    return ok
