"""Where the rest of a quantized decode token goes (issue 17: MXFP4 Distil at tp1, one H200):

    python -m bench decode-parts [--sections sample,topk,moe]

sample: the `sample` op on the 133120 logits (temperature 0.6, top-k 1024, top-p 0.95, the engine's
    defaults) as a decode step pays it, outside the graph: wall time per call with its one host read,
    its parts (torch.topk(1024) over the vocabulary, a two-stage top-k over 2048-wide slices, the
    noise), and a profile of a few calls.
topk: hunyuan_kernels.sampling.topk_desc (the Triton radix-select top-k of the `sample` op's "triton" variant)
    against torch.topk at V = 133120, k 1024 / 4096: a check on fresh random, tie-heavy (bf16-rounded)
    and -inf-padded logits (outputs poisoned first), GPU us by do_bench and per call inside a CUDA graph
    of 20 calls (no host launch cost), a sweep of the chunk per program, and the whole `sample` op +
    int() by each top-k (the variants "triton" and "triton_torch_topk").
rows: a batched decode step's sampling (`sample_rows`, the engine's defaults on every row) at B = 1, 8, 16:
    the per-row path (the reference: the `sample` op's CUDA variants, row by row), the `triton_rows`
    variant (the same kernels with a row axis: one group's launches for all rows; the CUDA default) and
    the torch batched variant (CPU-only: hunyuan_kernels/sampling.py says why), host ms (the launches) and events
    ms, and how many of each one's tokens differ from the per-row path's on fresh logits (triton_rows:
    should be 0, it is bit-exact; batched torch: near-tie rounding).
moe: one MoE layer's decode (`moe_quant` "decode", MXFP4 experts + MXFP8 shared MLP, tp1, 1 token) x 32
    layers (distinct weights, so L2 holds none of them), captured as ONE CUDA graph as the decode step
    is: microseconds per layer and GB/s of the weight bytes read (8 chosen experts + the shared MLP).
    (The GEMVs' tiles alone: `kernels-quant --decode --sweep`.)
"""
from __future__ import annotations

import argparse

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels import sampling
from hunyuan_kernels.quant import random_qweight

from .. import variants
from ..checks import nan_blocks
from ..profiling import op_table
from ..report import Col, Output
from ..timing import time_ms

DRY = False
V, H, E, K, I = 133120, 4096, 64, 8, 3072
LAYERS = 32


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sections", default="sample,moe", help="of sample,topk,rows,moe")


def two_stage(x: torch.Tensor, k: int):
    """Top-k over 2048-wide slices, then over their winners."""
    w = 2048
    n = -(-x.numel() // w)
    pad = torch.full((n * w,), float("-inf"), device=x.device)
    pad[: x.numel()] = x
    v1, i1 = pad.view(n, w).topk(k, dim=1)
    v2, i2 = v1.flatten().topk(k)
    base = (torch.arange(n, device=x.device) * w)[:, None]
    return v2, (i1 + base).flatten()[i2]


def sample_section(out: Output) -> dict:
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(V, device="cuda") * 3
    full = lambda: int(kernels.call("sample", x, 0.6, 1024, 0.95, g, False, None))    # noqa: E731
    res = {"sample + int() wall ms": time_ms(full, "wall", n=30)}
    parts = {"x / temperature": lambda: x / 0.6, "torch.topk(1024)": lambda: x.topk(1024),
             "two-stage topk (65x2048)": lambda: two_stage(x, 1024),
             "exponential_ noise": lambda: torch.empty_like(x).exponential_(1, generator=g)}
    rows = [dict(part="sample + int()", wall_ms=res["sample + int() wall ms"])]
    for name, fn in parts.items():
        rows.append(dict(part=name, wall_ms=time_ms(fn, "wall", n=30), gpu_ms=time_ms(fn, "bench")))
    a, b = x.topk(1024), two_stage(x, 1024)
    out.table(rows, [Col("sample op, V 133120", "part"), Col("wall ms (host read incl.)", "wall_ms", ".3f"),
                     Col("GPU ms (do_bench)", "gpu_ms", ".4f")])
    out.say(f"two-stage topk equals torch.topk (values): {torch.equal(a.values, b[0])}, "
            f"ids give the values: {torch.equal(x[b[1]], b[0])}")
    for sort in ("cuda_time_total", "cpu_time_total"):
        for line in op_table(full, sort, rows=14, calls=5):
            out.say(line)
    return dict(rows=rows)


def topk_logits(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    rnd = torch.randn(V, generator=g, device="cuda") * 3
    ties = (torch.randn(V, generator=g, device="cuda") * 2.5).bfloat16().float() / 0.6
    padded = ties.clone()
    padded[127000:] = float("-inf")                # the vocabulary past the tokenizer, as the engine pads it
    few = torch.tensor([-1.0, 0.0, 0.5, 2.0], device="cuda")[torch.randint(0, 4, (V,), generator=g, device="cuda")]
    return {"random": rnd, "bf16 ties": ties, "-inf padded": padded, "4 levels": few}


def topk_ok(x: torch.Tensor, k: int, vals: torch.Tensor, idx: torch.Tensor) -> bool:
    return (torch.equal(vals, x.topk(k).values) and bool(((idx >= 0) & (idx < x.numel())).all())
            and idx.unique().numel() == k and torch.equal(x[idx], vals))


def topk_section(out: Output) -> tuple[dict, bool]:
    checks = {}
    for seed in range(3):
        for name, x in topk_logits(seed).items():
            for k in (1024, 4096, 1):
                for chunk in ((2048, 4096, 8192) if k == 1024 else (sampling.TOPK_CHUNK,)):
                    nan_blocks("cuda", ((k,), torch.float32), ((k,), torch.int64), ((4, 33, 256), torch.int32))
                    checks[f"{name} k={k} chunk={chunk} seed={seed}"] = topk_ok(x, k, *sampling.topk_desc(x, k, chunk=chunk))
    bad = [c for c, ok in checks.items() if not ok]
    out.say(f"top-k check (values == torch.topk's, ids distinct and giving them): {len(checks) - len(bad)}/{len(checks)} ok"
            + (f"; failed: {bad}" if bad else ""))
    x = topk_logits(9)["-inf padded"]
    rows = []
    for k in (1024, 4096):
        forms = [(f"torch.topk k={k}", lambda k=k: x.topk(k))] + \
                [(f"topk_desc k={k} chunk={c}", lambda c=c, k=k: sampling.topk_desc(x, k, chunk=c)) for c in (2048, 4096, 8192)]
        for label, fn in forms:
            try:
                graph_us = time_ms(lambda: [fn() for _ in range(20)], "graph", per=20) * 1e3
            except Exception as e:  # noqa: BLE001  report, keep benching
                graph_us = None
                out.say(f"{label}: graph capture failed: {type(e).__name__}: {e}")
            # bytes: 4 digit passes + the compact pass read x (L2-resident in decode); the histograms are extra
            gbs = 5 * V * 4 / (graph_us * 1e-6) / 1e9 if graph_us and "torch" not in label else None
            rows.append(dict(form=label, bench_us=time_ms(fn, "bench") * 1e3, graph_us=graph_us, gbs=gbs))
    g = torch.Generator("cuda").manual_seed(0)
    for name in ("triton", "triton_torch_topk"):
        fn = variants.runner("sample", name, x, 0.6, 1024, 0.95, g, False, None, direct=True)   # timed alike
        rows.append(dict(form=f"sample op ({name}) + int(), wall", wall_ms=time_ms(lambda: int(fn()), "wall", n=50)))
    for name, radix in (("radix", True), ("torch.topk", False)):
        rows.append(dict(form=f"sample_device ({name} top-k), GPU",
                         bench_us=time_ms(lambda: sampling.sample_device(x / 0.6, 1024, 0.95, g, radix=radix), "bench") * 1e3))
    out.table(rows, [Col("top-k of V 133120", "form"), Col("do_bench us", "bench_us", ".1f"),
                     Col("in graph us", "graph_us", ".1f"), Col("GB/s (5 reads, graph)", "gbs", ".0f"),
                     Col("wall ms", "wall_ms", ".3f")])
    return dict(checks=checks, rows=rows), not bad


def rows_section(out: Output) -> dict:
    rows, draws = [], 0
    misses = {"triton_rows": 0, "batched": 0}
    for B in (1, 8, 16):
        logits = (torch.randn(B, V, device="cuda") * 2.5).bfloat16().float()      # ties, as the model's
        gens = [torch.Generator("cuda").manual_seed(i) for i in range(B)]
        args = (logits, list(range(B)), [0.6] * B, [1024] * B, [0.95] * B, gens, [False] * B, [None] * B)
        per_row = lambda: sampling.sample_rows_ref(*args)                  # noqa: E731
        variants_ = {"triton_rows": lambda: sampling.sample_rows_triton(*args),
                     "batched": lambda: sampling.sample_rows_batched(*args)}
        forms = {"per row (sample op, row by row)": per_row, "triton_rows (row axis, CUDA default)":
                 variants_["triton_rows"], "batched torch variant": variants_["batched"]}
        for name, fn in forms.items():
            rows.append(dict(B=B, form=name, host_ms=time_ms(fn, "host", n=30), events_ms=time_ms(fn, "events")))
        for seed in range(20):                        # the same generator states for each
            for i, g in enumerate(gens):
                g.manual_seed(seed * 100 + i)
            want = per_row()
            for name, fn in variants_.items():
                for i, g in enumerate(gens):
                    g.manual_seed(seed * 100 + i)
                misses[name] += int((fn() != want).sum())
            draws += B
    out.table(rows, [Col("sample_rows, V 133120", "form"), Col("B", "B"), Col("host ms", "host_ms", ".3f"),
                     Col("events ms", "events_ms", ".3f")])
    for name, n in misses.items():
        out.say(f"{name} variant vs the per-row path on CUDA: {n} of {draws} tokens differ"
                + (" (should be 0: bit-exact)" if name == "triton_rows" else ""))
    return dict(rows=rows, misses=misses, draws=draws)


def moe_section(out: Output) -> dict:
    gen = torch.Generator("cuda").manual_seed(1)
    layers = []
    for _ in range(LAYERS):
        w1 = random_qweight("mxfp4", (1, E, 2 * I, H), H ** -0.5, "cuda", gen)
        w2 = random_qweight("mxfp4", (E, H, I), I ** -0.5, "cuda", gen)
        s1 = random_qweight("mxfp8", (1, 2 * I, H), H ** -0.5, "cuda", gen)
        s2 = random_qweight("mxfp8", (H, I), I ** -0.5, "cuda", gen)
        gate = torch.randn(E, H, device="cuda", generator=gen) * H ** -0.5
        layers.append((gate, w1, w2, s1, s2))
    x = torch.randn(1, H, device="cuda", generator=gen).to(torch.bfloat16)
    nbytes = (K * (2 * I * H + H * I) * (4 + 8 / 32) + (2 * I * H + H * I) * (8 + 8 / 32)) / 8
    calls = [variants.runner("moe_quant", "decode", x, *layer[:3], *layer[3:], 0, 1, K, True) for layer in layers]
    us = time_ms(lambda: [c() for c in calls], "graph", per=LAYERS) * 1e3
    res = dict(us_per_layer=us, gbs=nbytes / (us * 1e-6) / 1e9, mb_per_layer=nbytes / 1e6)
    out.say(f"MoE decode layer (MXFP4 experts + MXFP8 shared, tp1, 1 token) x {LAYERS} in one graph: "
            f"{us:.1f} us a layer, {res['gbs']:.0f} GB/s of its {res['mb_per_layer']:.0f} MB of weights")
    return res


def run(args: argparse.Namespace, out: Output) -> bool:
    ok = True
    for s in args.sections.split(","):
        if s == "sample":
            out.data["sample"] = sample_section(out)
        elif s == "topk":
            out.data["topk"], good = topk_section(out)
            ok &= good
        elif s == "rows":
            out.data["rows"] = rows_section(out)
        elif s == "moe":
            out.data["moe"] = moe_section(out)
        else:
            raise SystemExit(f"unknown section {s!r} (sample, topk, rows, moe)")
    return ok
