"""The grouped MoE GEMMs of a denoise rank at its real shape: the resident layout's one down GEMM
against two per-micro down GEMMs, and the gate/up GEMM's layouts (issue 16).

    python bench/bench_grouped_layout.py

A hybrid4 / tp2cfg2 rank denoises with 2 micros of I_micro = 768 (its TP2 storage shard), 2 x 2049 or
2 x 4097 CFG-batched local tokens, top-8 of 64 experts, uniform random routing. The down pack is
cols-packed, W2[E, H, micros * I_micro] (engine/model/moe.py), so the fast path runs ONE down GEMM with
K = 1536 over both micros' activations side by side (kernels/moe_fast.py `_expert_mlp`); the per-micro
way runs two with K = 768 on the two column blocks of the same pack (strided views) and sums two [R, H]
partials. GEMM1 stays micro-major, W1[micro, E, 2*I_micro, H] (two GEMMs of N = 1536); an
expert-major W1[E, micros*2*I_micro, H] (one of N = 3072) is timed as the open alternative.
Rows: each variant's output checked against an fp32 product on the same inputs (outputs start as
NaN where the variant takes an `out`), then timed (triton.testing.do_bench, median). Details go to
$OUT/bench_grouped_layout.json when $OUT is set; a short table is printed last.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import moe_fast                       # noqa: E402

H, E, K, I_MICRO, MICROS = 4096, 64, 8, 768, 2
BF16 = torch.bfloat16
PEAK_TFLOPS = 790.0                     # H200 measured, bf16 dense matmul


def offsets(rows: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, E, (rows,), generator=gen, device="cuda")
    return torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)


def per_group_fp32(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The reference product: rows of x times w[g] ([G, K, N]) in fp32, group by group (on the host's
    copy of offs: a check, not a hot path)."""
    out = torch.empty(x.shape[0], w.shape[2], dtype=torch.float32, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].float() @ w[g].float()
        start = end
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, ok = [], True
    w1 = torch.randn(MICROS, E, 2 * I_MICRO, H, device="cuda", dtype=BF16, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, MICROS * I_MICRO, device="cuda", dtype=BF16, generator=gen) * I_MICRO ** -0.5
    w1e = torch.randn(E, MICROS * 2 * I_MICRO, H, device="cuda", dtype=BF16, generator=gen) * H ** -0.5
    for tokens in (2 * 2049, 2 * 4097):
        r = tokens * K
        offs = offsets(r, gen)
        xs = torch.randn(r, H, device="cuda", dtype=BF16, generator=gen)
        act = torch.randn(r, MICROS * I_MICRO, device="cuda", dtype=BF16, generator=gen)
        flop1, flop2 = 2 * r * H * 2 * I_MICRO * MICROS, 2 * r * H * I_MICRO * MICROS
        blocks = [moe_fast._down_cols(w2, m, 1, I_MICRO) for m in range(MICROS)]
        want2 = per_group_fp32(act, moe_fast._down_cols(w2, 0, MICROS, I_MICRO), offs)

        def down_one():                   # the fast path's down GEMM: K = 1536, one partial
            return torch._grouped_mm(act, moe_fast._down_cols(w2, 0, MICROS, I_MICRO), offs=offs)

        def down_per_micro():             # two K = 768 GEMMs on the column blocks, fp32 sum of two partials
            parts = [torch._grouped_mm(act[:, m * I_MICRO:(m + 1) * I_MICRO], blocks[m], offs=offs)
                     for m in range(MICROS)]
            return parts[0].float() + parts[1].float()

        def mlp_fast():                   # GEMM1 x 2 -> SwiGLU into one act buffer -> one GEMM2
            return moe_fast._expert_mlp(xs, w1, w2, offs, 0, MICROS)

        def mlp_per_micro():
            return sum(moe_fast._expert_mlp(xs, w1, w2, offs, m, 1).float() for m in range(MICROS))

        def up_micro_major():
            return [torch._grouped_mm(xs, w1[m].transpose(1, 2), offs=offs) for m in range(MICROS)]

        def up_expert_major():
            return torch._grouped_mm(xs, w1e.transpose(1, 2), offs=offs)

        # checks: both down forms against the fp32 product; the two MLP forms agree (one bf16 rounding of
        # the summed partials apart); the GEMM1 forms are finite and match their fp32 products
        with moe_fast.poisoned():
            fast_mlp = mlp_fast()
        checks = {"down one GEMM (K 1536)": rel_err(down_one(), want2),
                  "down per micro (2 x K 768)": rel_err(down_per_micro(), want2),
                  "MLP one down GEMM": rel_err(fast_mlp, mlp_per_micro()),
                  "MLP per micro": 0.0,
                  "GEMM1 micro-major (2 x N 1536)": rel_err(up_micro_major()[1],
                                                            per_group_fp32(xs, w1[1].transpose(1, 2), offs)),
                  "GEMM1 expert-major (N 3072)": rel_err(up_expert_major(),
                                                         per_group_fp32(xs, w1e.transpose(1, 2), offs))}
        fns = {"down one GEMM (K 1536)": (down_one, flop2), "down per micro (2 x K 768)": (down_per_micro, flop2),
               "MLP one down GEMM": (mlp_fast, flop1 + flop2), "MLP per micro": (mlp_per_micro, flop1 + flop2),
               "GEMM1 micro-major (2 x N 1536)": (up_micro_major, flop1),
               "GEMM1 expert-major (N 3072)": (up_expert_major, flop1)}
        good_fast = not fast_mlp.isnan().any()
        for name, (fn, flop) in fns.items():
            err = checks[name]
            good = err < 1e-2 and (good_fast or not name.startswith("MLP"))
            ok &= good
            ms = do_bench(fn, warmup=5, rep=50, return_mode="median")
            rows.append(dict(tokens=tokens, rows=r, variant=name, ms=ms, tflops=flop / ms / 1e9,
                             floor=flop / (PEAK_TFLOPS * 1e12) * 1e3 / ms, err=err, ok=bool(good)))
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_grouped_layout.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  (x32 layers: a DiT step's share)")
    print(f"{'tokens':>7} {'variant':<32}{'ms':>8}{'x32 ms':>8}{'TFLOP/s':>9}{'of peak':>8}{'err':>9}")
    for row in rows:
        print(f"{row['tokens']:>7} {row['variant']:<32}{row['ms']:8.3f}{32 * row['ms']:8.1f}{row['tflops']:9.0f}"
              f"{row['floor']:8.0%}{row['err']:9.1e}{'' if row['ok'] else '  FAIL'}")
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
