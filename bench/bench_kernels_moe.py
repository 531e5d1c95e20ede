"""The `moe` kernel op at the real per-rank shapes of HunyuanImage-3.0 (H 4096, E 64, top-8, random bf16
weights): every fast path checked against the reference on fresh random inputs (outputs and scratch
poisoned with NaN), then timed (median of triton.testing.do_bench, L2 flushed between runs).

    python bench/bench_kernels_moe.py [--tune] [--quick]

Denoise (grouped path): hybrid4 (TP2 x 2 micros, N = 2 x 2049), tp4 (1 micro, N = 2 x 4097), tp1 (1 GPU,
I 3072, N = 8194): reference, the engine's MoE of today (index_add_ finalize), the multi-micro fast path,
the two-dispatch ablation, and the grouped GEMMs alone (the part torch._grouped_mm does). Decode
(hybrid4 AR = TP4, one micro): N = 1, 2, 8 eager and as a CUDA graph, bytes vs the 4.3 TB/s floor.
Details go to $OUT/bench_kernels_moe.json when $OUT is set. A compact table is printed last.
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

import kernels                                  # noqa: E402
from kernels import moe_fast, moe_triton        # noqa: E402
from kernels.moe import moe_reference, route, swiglu_halves  # noqa: E402

H, E, K = 4096, 64, 8
PEAK_TFLOPS, PEAK_TBS = 790.0, 4.3             # H200 measured: bf16 dense matmul, copy bandwidth
DENOISE = {  # name: (N, I_micro, micros resident, micro_start, micro_count)
    "hybrid4": (2 * 2049, 768, 2, 0, 2),
    "tp4": (2 * 4097, 768, 1, 0, 1),
    "tp1": (8194, 3072, 1, 0, 1),
}
DECODE = {"hybrid4": (768, 2, 1, 1)}           # I_micro, micros resident, micro_start, micro_count (AR: TP4)


def weights(inter, micros, seed, layers=1):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    return [dict(gate=rnd(E, H, scale=H ** -0.5, dtype=torch.float32),
                 w1=rnd(micros, E, 2 * inter, H, scale=H ** -0.5), w2=rnd(E, H, micros * inter, scale=inter ** -0.5),
                 shared_w1=rnd(micros, 2 * inter, H, scale=H ** -0.5),
                 shared_w2=rnd(H, micros * inter, scale=inter ** -0.5)) for _ in range(layers)]


def tokens(n, seed):
    return torch.randn(n, H, generator=torch.Generator(device="cuda").manual_seed(seed), device="cuda").bfloat16()


def op_args(x, w, ms, mc):
    return (x, w["gate"], w["w1"], w["w2"], w["shared_w1"], w["shared_w2"], ms, mc, K, True)


def engine_today(x, gate, w1, w2, sw1, sw2, ms, mc, k, norm):
    """The engine's first MoE (the baseline): per-micro GEMMs and bf16 partial sums, atomic index_add_
    finalize in bf16 (on today's packs: micro m's down weights are w2[:, :, m*I:(m+1)*I])."""
    w, idx = route(x, gate, k, norm)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    xs = x.index_select(0, token)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    partial = None
    is_inter = w1.shape[2] // 2
    for m in range(ms, ms + mc):
        y = torch._grouped_mm(swiglu_halves(torch._grouped_mm(xs, w1[m].transpose(1, 2), offs=offs)),
                              w2[:, :, m * is_inter:(m + 1) * is_inter].transpose(1, 2), offs=offs)
        partial = y if partial is None else partial + y
    out = torch.zeros_like(x).index_add_(0, token, (partial.float() * w.reshape(-1)[order].unsqueeze(1)).to(x.dtype))
    is_m = sw1.shape[1] // 2
    h = F.linear(x, sw1[ms:ms + mc].reshape(-1, H)).view(x.shape[0], mc, 2 * is_m)
    return out + F.linear(swiglu_halves(h).reshape(x.shape[0], -1), sw2[:, ms * is_m:(ms + mc) * is_m])


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bench(fn):
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def check(args, two_dispatch=False):
    ref = moe_reference(*args)
    out = torch.full_like(args[0], float("nan"))
    with moe_fast.poisoned():
        got = moe_fast.moe_cuda(*args, two_dispatch=two_dispatch, out=out)
    again = moe_fast.moe_cuda(*args, two_dispatch=two_dispatch)
    err = rel_err(got, ref)
    ok = bool(not got.isnan().any() and err < 1e-2 and torch.equal(got, again))
    return err, ok


def denoise_case(name, rows, quick):
    n, inter, micros, ms, mc = DENOISE[name]
    w = weights(inter, micros, seed=1)[0]
    args = op_args(tokens(n, 2), w, ms, mc)
    flops = 6 * n * K * mc * H * inter + 6 * n * mc * H * inter + 2 * n * E * H
    gemm_flops = 6 * n * K * mc * H * inter
    err, ok = check(op_args(tokens(n, 3), w, ms, mc))
    err2, ok2 = check(op_args(tokens(n, 4), w, ms, mc), two_dispatch=True)
    t = {"fast": bench(lambda: moe_fast.moe_cuda(*args))}
    if mc > 1:
        t["two-dispatch"] = bench(lambda: moe_fast.moe_cuda(*args, two_dispatch=True))
    if not quick:
        t["reference"] = bench(lambda: moe_reference(*args))
        t["engine today"] = bench(lambda: engine_today(*args))
    # the grouped GEMMs alone on prepared rows: what the rest of the fast path adds on top
    x = args[0]
    wts, idx = route(x, w["gate"], K, True)
    order = idx.reshape(-1).argsort(stable=True)
    xs = x.index_select(0, order // K)
    offs = torch.bincount(idx.reshape(-1), minlength=E).cumsum(0).int()
    act = torch.randn(xs.shape[0], mc * inter, device="cuda").bfloat16()

    def gemms():                          # as the fast path: GEMM1 per micro, one GEMM2 over all of them
        for m in range(ms, ms + mc):
            torch._grouped_mm(xs, w["w1"][m].transpose(1, 2), offs=offs)
        torch._grouped_mm(act, moe_fast._down_cols(w["w2"], ms, mc, inter), offs=offs)
    t["grouped GEMMs only"] = bench(gemms)
    for path, ms_ in t.items():
        f = gemm_flops if path == "grouped GEMMs only" else flops
        rows.append(dict(case=f"denoise {name}", n=n, path=path, ms=ms_, rate=f"{f / ms_ / 1e9:.0f} TFLOP/s",
                         floor=f"{f / (PEAK_TFLOPS * 1e12) * 1e3 / ms_:.0%}",
                         err=(f"{err:.1e}" + ("" if ok else " FAIL")) if path == "fast" else
                         (f"{err2:.1e}" + ("" if ok2 else " FAIL")) if path == "two-dispatch" else ""))
    return ok and ok2


def decode_bytes(x, w, ms, mc, inter):
    _, idx = route(x, w["gate"], K, True)
    unique = idx.unique().numel()
    return unique * mc * 3 * inter * H * 2 + mc * 3 * inter * H * 2 + E * H * 4 + 2 * x.numel() * 2


def decode_case(n, rows, layers=4, calls=8):
    inter, micros, ms, mc = DECODE["hybrid4"]
    ws = weights(inter, micros, seed=7, layers=layers)
    ok_all = True
    errs = []
    for seed in (10, 11):
        err, ok = check(op_args(tokens(n, seed), ws[0], ms, mc))
        errs.append(err)
        ok_all &= ok
    xs = [tokens(n, 20 + i) for i in range(calls)]
    nbytes = sum(decode_bytes(xs[i], ws[i % layers], ms, mc, inter) for i in range(calls)) / calls

    def run_all(fn):
        for i in range(calls):
            fn(*op_args(xs[i], ws[i % layers], ms, mc))
    t = {"reference": bench(lambda: run_all(moe_reference)) / calls,
         "fast eager": bench(lambda: run_all(moe_fast.moe_cuda)) / calls}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_all(moe_fast.moe_cuda)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all(moe_fast.moe_cuda)
    t["fast graph"] = bench(graph.replay) / calls
    for path, ms_ in t.items():
        rows.append(dict(case="decode hybrid4", n=n, path=path, ms=ms_, rate=f"{nbytes / ms_ / 1e9:.0f} GB/s",
                         floor=f"{nbytes / (PEAK_TBS * 1e12) * 1e3 / ms_:.0%}",
                         err=f"{max(errs):.1e}" + ("" if ok_all else " FAIL") if path != "reference" else ""))
    return ok_all


def tune_decode(rows):
    """Sweeps the decode kernels' tiles at N=1 (graph-free, eager); prints the best."""
    inter, micros, ms, mc = DECODE["hybrid4"]
    ws = weights(inter, micros, seed=7, layers=4)
    xs = [tokens(1, 30 + i) for i in range(8)]

    def t_cfg():
        def run():
            for i in range(8):
                moe_fast.moe_cuda(*op_args(xs[i], ws[i % 4], ms, mc))
        return bench(run) / 8
    base_up, base_down = dict(moe_triton.DECODE_UP), dict(moe_triton.DECODE_DOWN)
    best = []
    for bi in (16, 32):
        for bh in (128, 256, 512):
            for st in (3, 4, 5):
                moe_triton.DECODE_UP.update(BLOCK_I=bi, BLOCK_H=bh, num_stages=st)
                best.append((t_cfg(), "up", dict(moe_triton.DECODE_UP)))
    moe_triton.DECODE_UP.update(min((b for b in best if b[1] == "up"), key=lambda b: b[0])[2])
    for bho in (16, 32, 64):
        for bi in (64, 128, 256):
            moe_triton.DECODE_DOWN.update(BLOCK_HO=bho, BLOCK_I=bi)
            best.append((t_cfg(), "down", dict(moe_triton.DECODE_DOWN)))
    for kind in ("up", "down"):
        ms_, _, cfg = min((b for b in best if b[1] == kind), key=lambda b: b[0])
        print(f"tune {kind}: best {ms_ * 1e3:.1f} us with {cfg}")
    moe_triton.DECODE_UP.clear(), moe_triton.DECODE_UP.update(base_up)
    moe_triton.DECODE_DOWN.clear(), moe_triton.DECODE_DOWN.update(base_down)
    return [dict(ms=b[0], kernel=b[1], cfg=b[2]) for b in best]


def profile() -> None:
    """Per-kernel CUDA time of the fast path (hybrid4 denoise and decode N=1), to see where it goes."""
    from torch.profiler import ProfilerActivity, profile as prof
    for label, (n, inter, micros, ms, mc) in (("denoise hybrid4", DENOISE["hybrid4"]),
                                               ("decode N=1", (1,) + DECODE["hybrid4"])):
        w = weights(inter, micros, seed=1)[0]
        args = op_args(tokens(n, 2), w, ms, mc)
        for _ in range(3):
            moe_fast.moe_cuda(*args)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                moe_fast.moe_cuda(*args)
            torch.cuda.synchronize()
        print(f"--- {label}: CUDA kernels over 5 calls")
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true", help="sweep the decode kernel tiles first")
    ap.add_argument("--quick", action="store_true", help="skip timing the reference and the engine baseline")
    ap.add_argument("--profile", action="store_true", help="print the CUDA kernels of one hybrid4 call per path")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    t0 = time.time()
    chosen = kernels.chosen("moe", "cuda", torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  chosen backend: {chosen}")
    rows, ok = [], chosen == "triton"
    tuned = tune_decode(rows) if args.tune else None
    if args.profile:
        profile()
    for n in (1, 2, 8):
        ok &= decode_case(n, rows)
        print(f"decode N={n} done ({time.time() - t0:.0f} s)", flush=True)
    for name in DENOISE:
        ok &= denoise_case(name, rows, args.quick)
        print(f"denoise {name} done ({time.time() - t0:.0f} s)", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_kernels_moe.json").write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, tune=tuned), indent=1))
    print(f"\n{'case':<16} {'N':>5}  {'path':<20} {'ms':>8}  {'rate':>13}  {'of floor':>8}  {'rel err':>8}")
    for r in rows:
        print(f"{r['case']:<16} {r['n']:>5}  {r['path']:<20} {r['ms']:>8.3f}  {r['rate']:>13}  {r['floor']:>8}  "
              f"{r['err']:>8}")
    print(f"checks: {'all passed' if ok else 'FAILED'}  ({time.time() - t0:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
