"""The MXFP4 MoE layer on humming-kernels (the `moe_quant` op's `humming` variant, packs laid out at load) beside
our own variants, at the real tp1 shapes, for a decode step's rows and a denoise step's.

    python -m bench humming [--ns 1,2,4,8,16] [--denoise 4096] [--layers 8] [--activations bf16,fp8] [--parts]
                            [--format mxfp4|nvfp4|mxfp8]

Each layer: H 4096, E 64, top-8, I 3072, the experts in --format (MXFP4 by default; NVFP4 with a global scale per
expert, as ModelOpt writes it), the shared MLP in MXFP8 (the MXFP4 build's), random weights and
router, random tokens (the decode sizes share one set of layers, N taking the first N tokens). Rows per N:
  ours                  the registry's choice on plain packs (decode / batched / grouped: `ran`)
  humming-bf16          W4A16 (the codes converted to bf16 in registers, bf16 MMA)
  humming-fp8           W4A8 (activations quantized per row to FP8 E4M3, the E8M0 scales folded per expert)
each humming row once per path at N <= humming.INDEXED_MAX_ROWS ("grouped": routing, permutation, grouped-
contiguous GEMMs; "indexed": the GEMMs gather the routes' rows themselves; `ran` says which one the variant
takes there by itself), the grouped path alone above. Decode sizes: `--layers` distinct layers captured in
ONE CUDA graph (beyond L2, as a step is), the floor the bytes of the experts the tokens touch, the shared MLP
and the router at 4.3 TB/s. Denoise size: 2 layers in a graph, the floor the FLOPs at the bf16 (W4A16) or FP8
(W4A8) dense peak measured on the device (790 / 1580 TFLOP/s). Every row is first checked on layer 0 against
the op's reference (relative L2 error; W4A8's includes the FP8 rounding of the activations), for the same
bits on a second run, and at decode sizes for batch invariance (a token alone gives the same bits); where
both paths run, whether they give the same bits (`= grouped`: the threshold then changes no result). Then
the us/layer of every path side by side per N, and per activation the row counts where the indexed path is
the faster (what humming.INDEXED_ROWS, a pack's default, is set from). Also: the time to lay out one
layer's packs (and to compile the kernels, the first time) and the share of scale blocks W4A8's fold rounds.
--parts adds, per N and activation, the humming variant's own path without the shared MLP ("no shared"): what
the shared MLP (MXFP8, on the decode GEMVs on a side stream up to 16 rows) adds to a layer at each N.
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
    ap.add_argument("--ns", default="1,2,4,8,16", help="decode row counts (default 1,2,4,8,16)")
    ap.add_argument("--denoise", type=int, default=4096, help="the denoise size's tokens (default 4096; 0: none)")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers in the decode graph (default 8)")
    ap.add_argument("--activations", default="bf16,fp8", help="humming's activations to run (default bf16,fp8)")
    ap.add_argument("--parts", action="store_true", help="also each humming variant without the shared MLP")
    ap.add_argument("--format", default="mxfp4", choices=humming.FORMATS, help="the experts' format (default mxfp4)")


def layer(seed: int, tokens: int, fmt: str = "mxfp4") -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(x=torch.randn(tokens, H, generator=g, device="cuda").to(BF16),
                gate=torch.randn(E, H, generator=g, device="cuda") * H ** -0.5,
                w1=random_qweight(fmt, (1, E, 2 * I, H), H ** -0.5, "cuda", g, gscale_dims=1),
                w2=random_qweight(fmt, (E, H, I), I ** -0.5, "cuda", g, gscale_dims=1),
                sw1=random_qweight("mxfp8", (1, 2 * I, H), H ** -0.5, "cuda", g),
                sw2=random_qweight("mxfp8", (H, I), I ** -0.5, "cuda", g))


def laid_out(lay: dict, activations: str) -> dict:
    return dict(lay, w1=humming.lay_out(lay["w1"], activations), w2=humming.lay_out(lay["w2"], activations, micros=1))


def args_of(lay: dict, n: int, shared: bool = True) -> tuple:
    sw1, sw2 = (lay["sw1"], lay["sw2"]) if shared else (None, None)
    return (lay["x"][:n], lay["gate"], lay["w1"], lay["w2"], sw1, sw2, 0, 1, K, True)


def floor_ms(layers: list[dict], n: int, act: str) -> float:
    if n > 64:      # compute-bound: the routed and shared GEMMs' FLOPs at the dense peak of the MMA's dtype
        flops = 2 * n * 3 * I * H * (K + 1) * len(layers)
        return flops / PEAK_FLOPS["fp8" if act == "fp8" else "bf16"] * 1e3
    total = 0.0
    per = 3 * I * H
    for lay in layers:
        _, idx = route(lay["x"][:n], lay["gate"], K, True)
        total += (idx.unique().numel() * per * BITS[lay["w1"].fmt] + per * BITS["mxfp8"]) / 8 + E * H * 4
    return total / PEAK_BW * 1e3


class Variant:
    """One row's way to run the layer: the registry's choice, or the humming variant on a forced path."""

    def __init__(self, name: str, layers: list[dict], path: str | None = None, shared: bool = True):
        self.name, self.layers, self.path, self.shared = name, layers, path, shared
        self.activations = name.split("-")[1] if name.startswith("humming") else "bf16"

    def __call__(self, args: tuple) -> torch.Tensor:
        if self.path is None or not self.shared:
            return kernels.call("moe_quant", *args)
        return humming.moe_quant_humming(*args, path=self.path)

    def ran(self, n: int) -> str:
        if self.path is None or not self.shared:
            return kernels.chosen("moe_quant")
        choice = humming.rows_path(n, self.layers[0]["w1"].layout.config.indexed_rows)
        return self.path + (" (its choice)" if choice == self.path else "")


def lay_out_all(layers: list[dict], acts: list[str], out: Output) -> dict[str, list[dict]]:
    laid = {}
    for act in acts:
        t1 = time.time()
        laid[act] = [laid_out(lay, act) for lay in layers]
        out.say(f"{len(layers)} layers laid out for humming-{act} in {time.time() - t1:.1f} s")
    return laid


def variants(layers: list[dict], laid: dict[str, list[dict]], n: int, parts: bool = False) -> list[Variant]:
    """ours, then per activation the humming variant on both paths (N <= INDEXED_MAX_ROWS) or its choice;
    `parts`: and its choice without the shared MLP."""
    paths = humming.PATHS if n <= humming.INDEXED_MAX_ROWS else (None,)
    vs = [Variant("ours", layers)] + [Variant(f"humming-{act}", lays, path) for act, lays in laid.items()
                                      for path in paths]
    if parts:
        vs += [Variant(f"humming-{act}-no-shared", lays, "-", shared=False) for act, lays in laid.items()]
    return vs


def check(v: Variant, args: tuple, want: torch.Tensor, decode: bool) -> Check:
    with poisoned():
        got = v(args)
    again = v(args)
    res = compare(got, want, 5e-2 if v.activations == "fp8" else 1e-2, again)
    if decode and args[0].shape[0] > 1:
        same = all(torch.equal(got[t], v((args[0][t:t + 1], *args[1:]))[0]) for t in range(0, args[0].shape[0], 3))
        res = Check(res.err, res.ok and same)
    return res


def same_bits(v: Variant, args: tuple) -> str | None:
    """Where `v` is the indexed path: "yes" when the grouped path gives the same bits on these args."""
    if v.path != "indexed":
        return None
    return "yes" if torch.equal(v(args), humming.moe_quant_humming(*args, path="grouped")) else "NO"


def rows_for(layers: list[dict], n: int, vs: list[Variant], rows: list, out: Output) -> bool:
    """Check and time every variant at N (the first n tokens of `layers`' own)."""
    ok = True
    with kernels.allowed():      # the reference (plain packs), with and without the shared MLP
        want = {s: kernels.call("moe_quant", *args_of(layers[0], n, s)) for s in {v.shared for v in vs}}
    for v in vs:
        res = check(v, args_of(v.layers[0], n, v.shared), want[v.shared], decode=n <= 64)
        ran = v.ran(n)
        ok &= res.ok
        agree = same_bits(v, args_of(v.layers[0], n, v.shared))
        calls = [(lambda a=args_of(lay, n, v.shared): v(a)) for lay in v.layers]
        ms = time_ms(lambda: [c() for c in calls], "graph")
        f = floor_ms(layers, n, v.activations)
        rows.append(dict(n=n, variant=v.name, path=v.path or "-", ran=ran, ms=ms, us_layer=ms / len(layers) * 1e3,
                         floor_ms=f, of_floor=ms / f, err=str(res), same=agree))
        out.say(f"  N={n} {v.name} ({ran}): {ms:.3f} ms, {ms / len(layers) * 1e3:.1f} us a layer, {ms / f:.2f}x floor, "
                f"{res}" + (f", = grouped: {agree}" if agree else ""))
    return ok


def side_by_side(rows: list[dict], acts: list[str]) -> tuple[list[dict], dict]:
    """us/layer per N: ours and each humming path (and its own without the shared MLP, with --parts) in one row;
    per activation the N where indexed wins."""
    table, wins = [], {act: [] for act in acts}
    for n in sorted({r["n"] for r in rows}):
        mine = {(r["variant"], r["path"]): r["us_layer"] for r in rows if r["n"] == n}
        line = dict(n=n, ours=mine.get(("ours", "-")))
        for act in acts:
            g = mine.get((f"humming-{act}", "grouped"), mine.get((f"humming-{act}", "-")))
            i = mine.get((f"humming-{act}", "indexed"))
            line[f"{act}_grouped"], line[f"{act}_indexed"] = g, i
            line[f"{act}_no_shared"] = mine.get((f"humming-{act}-no-shared", "-"))
            if i is not None and g is not None and i < g:
                wins[act].append(n)
        table.append(line)
    return table, wins


def run(args: argparse.Namespace, out: Output) -> bool:
    if not humming.available():
        out.say(f"humming-kernels is not available here (installed: {humming.installed()}, "
                f"capability {torch.cuda.get_device_capability()})")
        return False
    acts = [a for a in args.activations.split(",") if a]
    t0 = time.time()
    probe = layer(1, 1, args.format)
    lay = laid_out(probe, acts[0])
    out.data["first_layout_s"] = time.time() - t0
    out.say(f"first layout (kernels compiled): {out.data['first_layout_s']:.1f} s")
    if args.format == "mxfp4":                      # only MXFP4's W4A8 folds its block scales
        out.data["fp8_clamped_share"] = dict(gate_up=humming.clamped_share(probe["w1"]),
                                             down=humming.clamped_share(probe["w2"], micros=1))
        out.say(f"W4A8 fold: share of scale blocks rounded on random packs: {out.data['fp8_clamped_share']}")
    del probe, lay
    rows: list[dict] = []
    ok = True
    ns = [int(v) for v in args.ns.split(",") if v]
    sizes = [(ns, args.layers)] if ns else []
    sizes += [([args.denoise], 2)] if args.denoise else []
    for group, nlayers in sizes:
        t1 = time.time()
        layers = [layer(100 * i + 7, max(group), args.format) for i in range(nlayers)]
        out.say(f"{nlayers} layers of {max(group)} tokens made in {time.time() - t1:.0f} s")
        laid = lay_out_all(layers, acts, out)
        for n in group:
            ok &= rows_for(layers, n, variants(layers, laid, n, args.parts), rows, out)
        del layers, laid
        torch.cuda.empty_cache()
    out.data["rows"] = rows
    out.table(rows, [Col("N", "n"), Col("variant", "variant"), Col("ran", "ran"), Col("ms/graph", "ms", ".3f"),
                     Col("us/layer", "us_layer", ".1f"), Col("floor ms", "floor_ms", ".3f"),
                     Col("x floor", "of_floor", ".2f"), Col("check", "err"), Col("= grouped", "same")],
              title="the MXFP4 MoE layer (tp1, real shapes): ours vs humming-kernels")
    table, wins = side_by_side(rows, acts)
    out.data["paths"], out.data["indexed_faster_at"] = table, wins
    out.table(table, [Col("N", "n"), Col("ours", "ours", ".1f")]
              + [Col(f"{act} {p.replace('_', ' ')}", f"{act}_{p}", ".1f") for act in acts
                 for p in ("grouped", "indexed") + (("no_shared",) if args.parts else ())],
              title=f"us per layer by path (indexed is the variant's own up to {humming.INDEXED_MAX_ROWS} rows)")
    for act in acts:
        out.say(f"humming-{act}: the indexed path is the faster at N = {wins[act] or 'none measured'}")
    out.say(f"checks: {'all passed' if ok else 'FAILED'}")
    return ok
