"""Would an expert-major MoE pack beat today's micro-major one in the denoise phase? (issue 16)

    python bench/bench_grouped_layout.py

A hybrid4 / tp2cfg2 rank denoises with 2 micros of I_micro = 768 (its TP2 storage shard). Today the
pack is W1[micro, E, 2*I_micro, H], W2[micro, E, H, I_micro] (a micro view is contiguous for the AR
phase), so each micro runs its own grouped GEMMs: GEMM1 N = 1536, GEMM2 K = 768, and two [R, H] partials
are summed by the finalize. Expert-major packs (W1[E, micro*2*I_micro, H], W2[E, H, micro*I_micro])
would give one GEMM1 with N = 3072 and one GEMM2 with K = 1536 and one partial. Uniform random routing
of the CFG-batched 2 x 2049 local tokens, top-8 of 64 experts. Times with triton.testing.do_bench.
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

H, E, K, I_MICRO, MICROS = 4096, 64, 8, 768, 2
BF16 = torch.bfloat16


def offsets(rows: int, gen: torch.Generator) -> torch.Tensor:
    ids = torch.randint(0, E, (rows,), generator=gen, device="cuda")
    return torch.bincount(ids, minlength=E).cumsum(0).to(torch.int32)


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (4098, 2 * 4097):
        r = tokens * K
        offs = offsets(r, gen)
        xs = torch.randn(r, H, device="cuda", dtype=BF16)
        w1 = torch.randn(MICROS, E, 2 * I_MICRO, H, device="cuda", dtype=BF16) * 0.02
        w2 = torch.randn(MICROS, E, H, I_MICRO, device="cuda", dtype=BF16) * 0.02
        w1e = torch.randn(E, MICROS * 2 * I_MICRO, H, device="cuda", dtype=BF16) * 0.02
        w2e = torch.randn(E, H, MICROS * I_MICRO, device="cuda", dtype=BF16) * 0.02
        a1 = torch.randn(r, I_MICRO, device="cuda", dtype=BF16)
        a1e = torch.randn(r, MICROS * I_MICRO, device="cuda", dtype=BF16)
        flop1, flop2 = 2 * r * H * 2 * I_MICRO * MICROS, 2 * r * H * I_MICRO * MICROS

        def micro_major_1():
            for m in range(MICROS):
                torch._grouped_mm(xs, w1[m].transpose(1, 2), offs=offs)

        def micro_major_2():
            for m in range(MICROS):
                torch._grouped_mm(a1, w2[m].transpose(1, 2), offs=offs)

        rows = {
            "GEMM1 micro-major (2 x N 1536)": (micro_major_1, flop1),
            "GEMM1 expert-major (N 3072)": (lambda: torch._grouped_mm(xs, w1e.transpose(1, 2), offs=offs), flop1),
            "GEMM2 micro-major (2 x K 768)": (micro_major_2, flop2),
            "GEMM2 expert-major (K 1536)": (lambda: torch._grouped_mm(a1e, w2e.transpose(1, 2), offs=offs), flop2),
        }
        print(f"\n{tokens} tokens x top-{K} = {r} routed rows, {E} experts (~{r // E} rows each)")
        for name, (fn, flop) in rows.items():
            ms = do_bench(fn, warmup=5, rep=50, return_mode="median")
            print(f"  {name:<34}{ms:8.3f} ms {flop / ms / 1e9:8.0f} TFLOP/s   x32 layers {32 * ms:6.1f} ms")
        del xs, w1, w2, w1e, w2e, a1, a1e


if __name__ == "__main__":
    main()
