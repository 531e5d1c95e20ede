"""The MXFP4 MoE layer on humming-kernels (the `moe_quant` op's `humming` variant, packs laid out at load) beside
our own variants, at the real tp1 shapes, for a decode step's rows and a denoise step's.

    python -m bench humming [--ns 1,8,16] [--denoise 4096] [--layers 8] [--activations bf16,fp8]

Each layer: H 4096, E 64, top-8, I 3072, the shared MLP in MXFP8 (the MXFP4 build's), random weights and
router, its own random tokens. Rows per N and variant:
  ours          the registry's choice on plain packs (decode / batched / grouped: `ran`)
  humming-bf16  W4A16 (the codes converted to bf16 in registers, bf16 MMA)
  humming-fp8   W4A8 (activations quantized per row to FP8 E4M3, the E8M0 scales folded per expert)
Decode sizes: `--layers` distinct layers captured in ONE CUDA graph (beyond L2, as a step is), the floor the
bytes of the experts the tokens touch, the shared MLP and the router at 4.3 TB/s. Denoise size: 2 layers in
a graph, the floor the FLOPs at the bf16 (W4A16) or FP8 (W4A8) dense peak measured on the device (790 /
1580 TFLOP/s). Every variant is first checked on layer 0 against the op's reference (relative L2 error;
W4A8's includes the FP8 rounding of the activations), for the same bits on a second run, and at decode
sizes for batch invariance (a token alone gives the same bits). Also: the time to lay out one layer's packs
(and to compile the kernels, the first time) and the share of scale blocks W4A8's fold rounds.
"""
from __future__ import annotations

import argparse
import time

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.moe import route
from hunyuan_kernels.quant import humming, random_qweight
from hunyuan_kernels.scratch import poisoned

from ..checks import Check, compare
from ..report import Col, Output
from ..timing import time_ms
from .kernels_quant import BITS, PEAK_BW

DRY = False
BF16 = torch.bfloat16
H, E, K, I = 4096, 64, 8, 3072
PEAK_FLOPS = {"bf16": 790e12, "fp8": 1580e12}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ns", default="1,8,16", help="decode row counts (default 1,8,16)")
    ap.add_argument("--denoise", type=int, default=4096, help="the denoise size's tokens (default 4096; 0: none)")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers in the decode graph (default 8)")
    ap.add_argument("--activations", default="bf16,fp8", help="humming's activations to run (default bf16,fp8)")


def layer(seed: int, tokens: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(x=torch.randn(tokens, H, generator=g, device="cuda").to(BF16),
                gate=torch.randn(E, H, generator=g, device="cuda") * H ** -0.5,
                w1=random_qweight("mxfp4", (1, E, 2 * I, H), H ** -0.5, "cuda", g),
                w2=random_qweight("mxfp4", (E, H, I), I ** -0.5, "cuda", g),
                sw1=random_qweight("mxfp8", (1, 2 * I, H), H ** -0.5, "cuda", g),
                sw2=random_qweight("mxfp8", (H, I), I ** -0.5, "cuda", g))


def laid_out(lay: dict, activations: str) -> dict:
    return dict(lay, w1=humming.lay_out(lay["w1"], activations), w2=humming.lay_out(lay["w2"], activations, micros=1))


def args_of(lay: dict, n: int) -> tuple:
    return (lay["x"][:n], lay["gate"], lay["w1"], lay["w2"], lay["sw1"], lay["sw2"], 0, 1, K, True)


def floor_ms(layers: list[dict], n: int, act: str) -> float:
    if n > 64:      # compute-bound: the routed and shared GEMMs' FLOPs at the dense peak of the MMA's dtype
        flops = 2 * n * 3 * I * H * (K + 1) * len(layers)
        return flops / PEAK_FLOPS["fp8" if act == "fp8" else "bf16"] * 1e3
    total = 0.0
    per = 3 * I * H
    for lay in layers:
        _, idx = route(lay["x"][:n], lay["gate"], K, True)
        total += (idx.unique().numel() * per * BITS["mxfp4"] + per * BITS["mxfp8"]) / 8 + E * H * 4
    return total / PEAK_BW * 1e3


def check(name: str, args: tuple, want: torch.Tensor, decode: bool) -> Check:
    with poisoned():
        got = kernels.call("moe_quant", *args)
    again = kernels.call("moe_quant", *args)
    res = compare(got, want, 5e-2 if name.endswith("fp8") else 1e-2, again)
    if decode and args[0].shape[0] > 1:
        same = all(torch.equal(got[t], kernels.call("moe_quant", args[0][t:t + 1], *args[1:])[0])
                   for t in range(0, args[0].shape[0], 3))
        res = Check(res.err, res.ok and same)
    return res


def rows_for(n: int, nlayers: int, acts: list[str], out: Output, rows: list) -> bool:
    t0 = time.time()
    layers = [layer(100 * i + 7, n) for i in range(nlayers)]
    ok = True
    with kernels.allowed():
        want = kernels.call("moe_quant", *args_of(layers[0], n))      # the reference (plain packs)
    variants = [("ours", layers)]
    for act in acts:
        t1 = time.time()
        variants.append((f"humming-{act}", [laid_out(lay, act) for lay in layers]))
        out.say(f"N={n}: {nlayers} layers laid out for humming-{act} in {time.time() - t1:.1f} s")
    out.say(f"N={n}: layers made in {time.time() - t0:.0f} s")
    for name, lays in variants:
        res = check(name, args_of(lays[0], n), want, decode=n <= 64)
        ran = kernels.chosen("moe_quant")
        ok &= res.ok
        calls = [(lambda a=args_of(lay, n): kernels.call("moe_quant", *a)) for lay in lays]
        ms = time_ms(lambda: [c() for c in calls], "graph")
        f = floor_ms(layers, n, name.split("-")[-1])
        rows.append(dict(n=n, variant=name, ran=ran, ms=ms, us_layer=ms / nlayers * 1e3, floor_ms=f,
                         of_floor=ms / f, err=str(res)))
        out.say(f"  N={n} {name} ({ran}): {ms:.3f} ms, {ms / nlayers * 1e3:.1f} us a layer, {ms / f:.2f}x floor, {res}")
    del layers, variants
    torch.cuda.empty_cache()
    return ok


def run(args: argparse.Namespace, out: Output) -> bool:
    if not humming.available():
        out.say(f"humming-kernels is not available here (installed: {humming.installed()}, "
                f"capability {torch.cuda.get_device_capability()})")
        return False
    acts = [a for a in args.activations.split(",") if a]
    t0 = time.time()
    probe = layer(1, 1)
    lay = laid_out(probe, acts[0])
    out.data["first_layout_s"] = time.time() - t0
    out.say(f"first layout (kernels compiled): {out.data['first_layout_s']:.1f} s")
    out.data["fp8_clamped_share"] = dict(gate_up=humming.clamped_share(probe["w1"]),
                                         down=humming.clamped_share(probe["w2"], micros=1))
    out.say(f"W4A8 fold: share of scale blocks rounded on random packs: {out.data['fp8_clamped_share']}")
    del probe, lay
    rows: list[dict] = []
    ok = True
    for n in [int(v) for v in args.ns.split(",") if v]:
        ok &= rows_for(n, args.layers, acts, out, rows)
    if args.denoise:
        ok &= rows_for(args.denoise, 2, acts, out, rows)
    out.data["rows"] = rows
    out.table(rows, [Col("N", "n"), Col("variant", "variant"), Col("ran", "ran"), Col("ms/graph", "ms", ".3f"),
                     Col("us/layer", "us_layer", ".1f"), Col("floor ms", "floor_ms", ".3f"),
                     Col("x floor", "of_floor", ".2f"), Col("check", "err")],
              title="the MXFP4 MoE layer (tp1, real shapes): ours vs humming-kernels")
    out.say(f"checks: {'all passed' if ok else 'FAILED'}")
    return ok
