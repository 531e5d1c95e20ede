"""The ablations the suites measure against the engine's paths, registered from here as variants of
their ops (the engine never runs them; `kernels.allowed(name)` selects one for a block):

  moe / two_dispatch   the multi-micro MoE taken apart: routing, permutation, both grouped GEMMs and the
                       finalize again for every micro (GEMM2 on micro m's column block, K = I), each
                       micro's output cast and added, as a naive per-micro implementation does. The
                       engine's variants route once for all active micros (hunyuan_kernels/moe/cuda.py).

The other comparisons the suites make are between variants the kernels register themselves (the
"fused" vs "grouped" GEMM1 of `moe`, the "triton" vs "triton_torch_topk" top-k of `sample`, the "gemv"
vs "triton" quantized linears)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.moe import cuda as moe_cuda
from hunyuan_kernels.moe import triton_kernels as tk
from hunyuan_kernels.registry import backend
from hunyuan_kernels.scratch import empty


def two_dispatch(x, gate, w1, w2, shared_w1, shared_w2, micro_start: int, micro_count: int, topk: int,
                 norm_topk: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `moe` op (signature: hunyuan_kernels.moe.reference.moe_reference), every micro on its own."""
    x = x.contiguous()
    out = torch.empty_like(x) if out is None else out
    if x.shape[0] == 0:
        return out
    acc = moe_cuda.shared_mlp(x, shared_w1, shared_w2, micro_start, micro_count) if shared_w1 is not None else None
    last = micro_start + micro_count - 1
    for m in range(micro_start, last + 1):
        w, inv, xs, offs = moe_cuda.permute(x, gate, topk, norm_topk)
        res = out if m == last else empty(*x.shape, dtype=x.dtype, device=x.device)
        acc = tk.finalize(moe_cuda.expert_mlp(xs, w1, w2, offs, m, 1), inv, w, acc, res)
    return out


def register() -> None:
    """Register the ablations (once a process)."""
    if "two_dispatch" not in kernels.ops()["moe"]:
        backend("moe", "two_dispatch", dtypes=(torch.bfloat16,), available=moe_cuda.available)(two_dispatch)


@contextlib.contextmanager
def instead(op: str, name: str) -> Iterator[None]:
    """Within the block `op` runs its variant `name` (or the reference where that does not fit), every
    other op its usual variants: the engine's path with one part swapped."""
    others = {v for o, names in kernels.ops().items() if o != op for v in names} - set(kernels.ops()[op])
    with kernels.allowed(*others, name):
        yield
