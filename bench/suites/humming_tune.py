"""humming's indexed GEMMs (the `humming` variant's path for a decode step's rows) with tile configs around the
one its heuristics pick, at the real tp1 MoE shapes: does another config make the decode MoE faster?

    python -m bench humming-tune [--ns 1,2] [--activations fp8] [--layers 8] [--block-n 64,128,256]
                                 [--ctas 1,2,3] [--stages 4]

At 1 token a layer's two indexed GEMMs read 8 experts' codes (gate/up N 6144, down N 4096, K tiles of 1024 bits of
activation): with humming's pick (its `get_heuristics_config`, what `humming.indexed_tuning` keeps at layout) the
gate/up GEMM is 8 x 6144 / block N output tiles over 132 SMs at its CTAs an SM, so the N tile and the CTAs an SM
set how many waves it takes and how many bytes each SM keeps in flight (docs/benchmarks.md, humming: W4A8's
indexed path 85.9 us a layer at 1 row against a bytes floor of ~47). Each GEMM (gate/up, then down, the other
kept at humming's pick) is run with every (block N, CTAs an SM, pipeline stages) of the grid that humming's own
SM90 tile fitting (`fit_sm90_tile`) leaves as it is and whose shared memory fits the SM; the M and K tiles stay
humming's (the M tile is the one `align` packs the routes for; the K tile keeps each row's sums in one order, so
a config gives the same bits: checked against humming's pick, `same bits`). Timed as `bench humming` times a
decode step: --layers distinct layers captured in one CUDA graph, us a layer, against humming's pick in the
same run. A config that wins at every N (and gives the same bits) is the one to keep in humming.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from hunyuan_kernels.quant import humming

from ..report import Col, Output
from ..timing import time_ms
from .humming import K, args_of, laid_out, layer

DRY = False
SMEM_PER_SM = 227 * 1024          # an H100 / H200 SM's shared memory a CTA may use


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ns", default="1,2", help="decode row counts (default 1,2: the indexed path's own rows)")
    ap.add_argument("--activations", default="fp8", help="humming's activations (default fp8: W4A8, auto's)")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers in the graph (default 8)")
    ap.add_argument("--block-n", default="64,128,256", help="N tiles to try")
    ap.add_argument("--ctas", default="1,2,3", help="CTAs an SM to try")
    ap.add_argument("--stages", default="4", help="pipeline stages to try (humming's pick: 4)")


def _tuple_lists(cfg: dict) -> dict:
    """A kernel config as JSON gave it, its lists as tuples (as humming's fitting writes them)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}


def refusal(layer_cfg, cfg: dict) -> str | None:
    """Why humming's SM90 fitting would not run `cfg` as it is (it changes it, or its shared memory does not
    fit the CTAs asked an SM), or None."""
    from humming.config import GemmType, MmaType
    from humming.tune.sm90_policies import fit_sm90_tile
    from humming.utils.smem import estimate_smem_size_layer
    cfg = _tuple_lists(cfg)
    fitted = _tuple_lists(fit_sm90_tile(layer_cfg, cfg, gemm_type=GemmType.INDEXED))
    if fitted != cfg:
        changed = {k: (cfg.get(k), fitted.get(k)) for k in set(cfg) | set(fitted) if cfg.get(k) != fitted.get(k)}
        return f"fitting changes {changed}"
    smem = estimate_smem_size_layer(layer_cfg, cfg["block_shape"], GemmType.INDEXED, cfg["num_stages"],
                                    warp_shape=cfg["warp_shape"], smem_reuse_mode=cfg.get("smem_reuse_mode"),
                                    use_tma=cfg.get("use_tma", False), use_warp_spec=cfg.get("use_warp_spec", False),
                                    mma_type=MmaType(cfg.get("mma_type", MmaType.WGMMA.value)))
    if smem * cfg.get("num_ctas_per_sm", 1) > SMEM_PER_SM:
        return f"shared memory {smem} B x {cfg.get('num_ctas_per_sm', 1)} CTAs > {SMEM_PER_SM}"
    return None


def candidates(config: humming.Config, routes: int, block_ns: list[int], ctas: list[int],
               stages: list[int]) -> list[tuple[str, str]]:
    """(label, tuning JSON) per grid point: humming's intervals up to `routes` routed rows (the ones these
    calls meet), each interval's kernel config with block N, CTAs an SM and stages replaced (the warp's N
    the heuristics' rule for FP8 activations: block N / 8, at least 16)."""
    intervals = [iv for iv in json.loads(config.indexed) if iv[0] < routes]
    n = config.layer.shape_n
    out = []
    for bn in block_ns:
        if n % bn:
            continue
        for c in ctas:
            for s in stages:
                new = []
                for lo, hi, cfg in intervals:
                    bm, _, bk = cfg["block_shape"]
                    wm, _, wk = cfg["warp_shape"]
                    new.append([lo, hi, dict(cfg, block_shape=[bm, bn, bk], warp_shape=[wm, max(16, bn // 8), wk],
                                             num_ctas_per_sm=c, num_stages=s)])
                out.append((f"N {bn}, {c} CTA/SM, {s} stages", json.dumps(new)))
    return out


def with_tuning(lay: dict, which: str, tuning: str) -> dict:
    """The layer with `which` pack ("w1" / "w2") on another indexed tuning (the same codes and scales)."""
    w = lay[which]
    config = dataclasses.replace(w.layout.config, indexed=tuning)
    return dict(lay, **{which: dataclasses.replace(w, layout=dataclasses.replace(w.layout, config=config))})


def timed(lays: list[dict], n: int) -> float:
    calls = [(lambda a=args_of(lay, n): humming.moe_quant_humming(*a, path="indexed")) for lay in lays]
    return time_ms(lambda: [c() for c in calls], "graph") / len(lays) * 1e3


def sweep(lays: list[dict], which: str, ns: list[int], grid: tuple, rows: list, out: Output) -> None:
    """Every candidate of `which` GEMM against humming's pick, at each N."""
    h = humming.lib()
    config: humming.Config = lays[0][which].layout.config
    base = {n: timed(lays, n) for n in ns}
    want = {n: humming.moe_quant_humming(*args_of(lays[0], n), path="indexed") for n in ns}
    gemm = "gate/up" if which == "w1" else "down"
    out.say(f"{gemm}: humming's pick " + ", ".join(f"N={n} {base[n]:.1f} us a layer" for n in ns))
    for n in ns:
        rows.append(dict(gemm=gemm, config="humming's pick", n=n, us_layer=base[n], vs_pick=1.0, same="-", note=""))
    for label, tuning in candidates(config, max(ns) * K, *grid):
        why = next((r for _, _, cfg in json.loads(tuning) if (r := refusal(config.layer, cfg))), None)
        if why:
            out.say(f"  {gemm} {label}: skipped ({why})")
            continue
        try:
            t0 = time.time()
            h.kernel.humming.HummingKernel.prepare_kernels(config.layer.to_str(), humming.COMPUTE_INDEXED, tuning,
                                                           lays[0][which].codes.device)
            variant = [with_tuning(lay, which, tuning) for lay in lays]
            for n in ns:
                got = humming.moe_quant_humming(*args_of(variant[0], n), path="indexed")
                same = "yes" if torch.equal(got, want[n]) else "NO"
                us = timed(variant, n)
                rows.append(dict(gemm=gemm, config=label, n=n, us_layer=us, vs_pick=us / base[n], same=same,
                                 note=f"compiled in {time.time() - t0:.1f} s"))
                out.say(f"  {gemm} {label} N={n}: {us:.1f} us a layer ({us / base[n]:.3f}x the pick), same bits {same}")
        except Exception as e:  # noqa: BLE001 - a config humming cannot build or run: the row says why
            out.say(f"  {gemm} {label}: failed ({type(e).__name__}: {str(e)[:200]})")
            rows.append(dict(gemm=gemm, config=label, n=0, us_layer=float("nan"), vs_pick=float("nan"), same="-",
                             note=f"{type(e).__name__}: {str(e)[:80]}"))


def run(args: argparse.Namespace, out: Output) -> bool:
    if not humming.available():
        out.say(f"humming-kernels is not available here (installed: {humming.installed()})")
        return False
    ns = [int(v) for v in args.ns.split(",") if v]
    if max(ns) > humming.INDEXED_MAX_ROWS:
        raise SystemExit(f"--ns: the indexed path takes at most {humming.INDEXED_MAX_ROWS} rows")
    grid = tuple([int(v) for v in s.split(",") if v] for s in (args.block_n, args.ctas, args.stages))
    rows: list[dict] = []
    for act in [a for a in args.activations.split(",") if a]:
        t0 = time.time()
        lays = [laid_out(layer(100 * i + 7, max(ns)), act) for i in range(args.layers)]
        out.say(f"humming-{act}: {args.layers} layers laid out in {time.time() - t0:.0f} s")
        for which in ("w1", "w2"):
            sweep(lays, which, ns, grid, rows, out)
        for r in rows:
            r.setdefault("activations", act)
        del lays
        torch.cuda.empty_cache()
    out.data["rows"] = rows
    out.table(rows, [Col("activations", "activations"), Col("GEMM", "gemm"), Col("config", "config"), Col("N", "n"),
                     Col("us/layer", "us_layer", ".1f"), Col("x pick", "vs_pick", ".3f"), Col("same bits", "same"),
                     Col("note", "note")],
              title="humming's indexed GEMM configs at a decode step's rows (tp1 MoE layer, one CUDA graph)")
    return all(r["same"] != "NO" for r in rows)
