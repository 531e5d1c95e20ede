"""The grouped MoE GEMMs of a denoise rank at its real shape: the resident layout's one down GEMM
against two per-micro down GEMMs, and the gate/up GEMM's layouts (issue 16).

    python -m bench grouped-layout            # one H200: about a minute
    python -m bench grouped-layout --dry      # CPU, tiny shapes (SwiGLU under Triton's interpreter)

A hybrid4 / tp2cfg2 rank denoises with 2 micros of I_micro = 768 (its TP2 storage shard), 2 x 2049 or
2 x 4097 CFG-batched local tokens, top-8 of 64 experts, uniform random routing. The down pack is
cols-packed, W2[E, H, micros * I_micro] (engine/model/moe.py), so the grouped path runs ONE down GEMM
with K = 1536 over both micros' activations side by side (hunyuan_kernels/moe/cuda.py `expert_mlp`); the
per-micro way runs two with K = 768 on the two column blocks of the same pack (strided views) and sums
two [R, H] partials. GEMM1 stays micro-major, W1[micro, E, 2*I_micro, H] (two GEMMs of N = 1536); an
expert-major W1[E, micros*2*I_micro, H] (one of N = 3072) is timed as the open alternative.
Each form's output is checked against an fp32 product on the same inputs (the expert MLP's scratch
poisoned with NaN), then timed (triton.testing.do_bench, median); x32 layers is a DiT step's share.
"""
from __future__ import annotations

import argparse

import torch

from hunyuan_kernels.moe.cuda import expert_mlp
from hunyuan_kernels.scratch import poisoned

from ..checks import rel_err
from ..report import Col, Output
from ..timing import time_ms

DRY = True
PEAK_TFLOPS = 790.0                     # H200 measured, bf16 dense matmul


def add_arguments(ap: argparse.ArgumentParser) -> None:
    pass


def down_cols(w2: torch.Tensor, start: int, count: int, inter: int) -> torch.Tensor:
    """Micros [start, start + count) of the cols-packed down pack as torch._grouped_mm's [E, K, H]
    operand: a strided view, as the grouped path multiplies it."""
    return w2[:, :, start * inter:(start + count) * inter].transpose(1, 2)


def per_group_fp32(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of x times w[g] ([G, K, N]) in fp32, group by group (on the host's copy of offs: a check,
    not a hot path)."""
    out = torch.empty(x.shape[0], w.shape[2], dtype=torch.float32, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].float() @ w[g].float()
        start = end
    return out


def run(args: argparse.Namespace, out: Output) -> bool:
    dev = "cpu" if args.dry else "cuda"
    H, E, K, inter, micros = (64, 8, 3, 32, 2) if args.dry else (4096, 64, 8, 768, 2)
    token_counts = (37,) if args.dry else (2 * 2049, 2 * 4097)
    bf = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.randn(micros, E, 2 * inter, H, device=dev, dtype=bf, generator=gen) * H ** -0.5
    w2 = torch.randn(E, H, micros * inter, device=dev, dtype=bf, generator=gen) * inter ** -0.5
    w1e = torch.randn(E, micros * 2 * inter, H, device=dev, dtype=bf, generator=gen) * H ** -0.5
    rows, ok = [], True
    for tokens in token_counts:
        r = tokens * K
        offs = torch.bincount(torch.randint(0, E, (r,), generator=gen, device=dev), minlength=E).cumsum(0).to(torch.int32)
        xs = torch.randn(r, H, device=dev, dtype=bf, generator=gen)
        act = torch.randn(r, micros * inter, device=dev, dtype=bf, generator=gen)
        flop1, flop2 = 2 * r * H * 2 * inter * micros, 2 * r * H * inter * micros
        blocks = [down_cols(w2, m, 1, inter) for m in range(micros)]

        def down_one():                   # the grouped path's down GEMM: K = micros * I, one partial
            return torch._grouped_mm(act, down_cols(w2, 0, micros, inter), offs=offs)

        def down_per_micro():             # one K = I GEMM per column block, fp32 sum of the partials
            return sum(torch._grouped_mm(act[:, m * inter:(m + 1) * inter], blocks[m], offs=offs).float()
                       for m in range(micros))

        def mlp_fast():                   # GEMM1 per micro -> SwiGLU into one act buffer -> one GEMM2
            return expert_mlp(xs, w1, w2, offs, 0, micros)

        def mlp_per_micro():
            return sum(expert_mlp(xs, w1, w2, offs, m, 1).float() for m in range(micros))

        def up_micro_major():
            return [torch._grouped_mm(xs, w1[m].transpose(1, 2), offs=offs) for m in range(micros)]

        def up_expert_major():
            return torch._grouped_mm(xs, w1e.transpose(1, 2), offs=offs)

        # checks: both down forms against the fp32 product; the two MLP forms agree (one bf16 rounding of
        # the summed partials apart); the GEMM1 forms match their fp32 products
        want2 = per_group_fp32(act, down_cols(w2, 0, micros, inter), offs)
        with poisoned():
            fast_mlp = mlp_fast()
        forms = {
            "down one GEMM (K micros x I)": (down_one, flop2, rel_err(down_one(), want2)),
            "down per micro (K I each)": (down_per_micro, flop2, rel_err(down_per_micro(), want2)),
            "MLP one down GEMM": (mlp_fast, flop1 + flop2,
                                  rel_err(fast_mlp, mlp_per_micro()) if not fast_mlp.isnan().any() else float("nan")),
            "MLP per micro": (mlp_per_micro, flop1 + flop2, 0.0),
            "GEMM1 micro-major": (up_micro_major, flop1,
                                  rel_err(up_micro_major()[1], per_group_fp32(xs, w1[1].transpose(1, 2), offs))),
            "GEMM1 expert-major": (up_expert_major, flop1,
                                   rel_err(up_expert_major(), per_group_fp32(xs, w1e.transpose(1, 2), offs))),
        }
        for name, (fn, flop, err) in forms.items():
            good = err < 1e-2                 # (NaN: the poisoned MLP read scratch it never wrote)
            ok &= good
            ms = time_ms(fn, "wall", n=1, warmup=0) if args.dry else time_ms(fn, "bench")
            rows.append(dict(tokens=tokens, rows=r, variant=name, ms=ms, x32=32 * ms, tflops=flop / ms / 1e9,
                             floor=flop / (PEAK_TFLOPS * 1e12) * 1e3 / ms, err=err, ok=bool(good)))
        if not args.dry:
            torch.cuda.empty_cache()
    out.data["rows"] = rows
    out.table(rows, [Col("tokens", "tokens"), Col("variant", "variant"), Col("ms", "ms", ".3f"), Col("x32 ms", "x32", ".1f"),
                     Col("TFLOP/s", "tflops", ".0f"), Col("of peak", "floor", ".0%"), Col("err", "err", ".1e"),
                     Col("ok", lambda r: "" if r["ok"] else "FAIL")])
    out.say("all checks passed" if ok else "SOME CHECKS FAILED")
    return ok
