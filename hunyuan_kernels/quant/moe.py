"""The `moe_quant` op: the `moe` op (hunyuan_kernels/moe) over quantized experts, resident as `QWeight`s.

    moe_quant(x [N, H], gate [E, H] fp32, w1: QWeight [micros, E, 2*I, H], w2: QWeight [E, H, micros*I],
              shared_w1, shared_w2 (QWeight or float tensors as in `moe`, or None),
              micro_start, micro_count, topk, norm_topk) -> [N, H] in x.dtype

The packs are the `moe` op's in the same packing (codes and scales along K: the down pack's micro m
is the column block w2.cols(m*I, (m+1)*I), whole scale blocks). Routing, permutation, ONE down GEMM
over the active micros' columns (the micro partials summed before the route weight) and the fp32
finalize are the `moe` op's (the reference shares `moe.reference.routed_reference`; the CUDA paths
reuse moe/cuda.py's and moe/triton_kernels.py's kernels); only the GEMMs change, per weight format:
  mxfp8 / mxfp4 / nvfp4  weight-only: the GEMM on the exactly dequantized weights (W8A16 / W4A16);
  fp8 (per output channel)  W8A8: every GEMM's input rows quantized per row to E4M3 (amax / 448)
      first, as `quant.grouped_mm_fp8` / `quant.linear_fp8` define; the down GEMM's row is the whole
      routed row of every active micro (micro_count * I), quantized once.
The CUDA variants are moe_cuda.py's (batched: a decode step's 1..32 rows, each touched expert's tile read
once for all its tokens, batch invariant; decode: the chosen experts' quantized bytes on gemv.py's GEMVs;
grouped: the Triton grouped GEMMs, or torch._scaled_grouped_mm for fp8). Deterministic like `moe`: no
atomics, fixed sum orders, no host sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..moe.reference import routed_reference, swiglu_halves
from ..registry import reference
from .formats import SCALE_BLOCK, QWeight
from .linear import qgrouped, qlinear

Weight = torch.Tensor | QWeight


def _linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    return qlinear(x, w) if isinstance(w, QWeight) else F.linear(x, w)


def _micro_rows(w: Weight, start: int, count: int) -> Weight:
    """Rows of micros [start, start + count) of a [micros, r, K] pack as one [count * r, K] weight."""
    if isinstance(w, QWeight):
        return w[start:start + count].flat_rows()
    return w[start:start + count].reshape(-1, w.shape[-1])


def _micro_cols(w: Weight, start: int, count: int, width: int) -> Weight:
    """Columns of micros [start, start + count) of a cols-packed [N, micros * width] weight."""
    if isinstance(w, QWeight):
        return w.cols(start * width, (start + count) * width)
    return w[:, start * width:(start + count) * width]


def _expert_cols(w2: QWeight, start: int, count: int, inter: int) -> QWeight:
    """Micros [start, start + count) of the cols-packed [E, H, micros * I] down pack: [E, H, count * I]
    (a strided view of its codes and scales)."""
    block = SCALE_BLOCK[w2.fmt]
    if block and inter % block:
        raise ValueError(f"moe_quant: I_micro {inter} is not a multiple of the {w2.fmt} scale block of {block}: "
                         f"a micro's column block of the down pack would cut its scale blocks")
    return w2.cols(start * inter, (start + count) * inter)


def shared_reference(x, shared_w1: Weight, shared_w2: Weight, micro_start: int, micro_count: int) -> torch.Tensor:
    n = x.shape[0]
    is_micro = shared_w1.shape[1] // 2
    h = _linear(x, _micro_rows(shared_w1, micro_start, micro_count))
    act = swiglu_halves(h.view(n, micro_count, 2 * is_micro)).reshape(n, -1)
    return _linear(act, _micro_cols(shared_w2, micro_start, micro_count, is_micro))


@reference("moe_quant")
def moe_quant_reference(x: torch.Tensor, gate: torch.Tensor, w1: QWeight, w2: QWeight, shared_w1: Weight | None,
                        shared_w2: Weight | None, micro_start: int, micro_count: int, topk: int,
                        norm_topk: bool) -> torch.Tensor:
    for w in (w1, w2):
        w._plain("moe_quant's reference")       # a pack laid out for a kernel family runs only on its variant
    inter = w1.shape[2] // 2

    def expert_mlp(xs, offs):
        act = torch.cat([swiglu_halves(qgrouped(xs, w1[m], offs))
                         for m in range(micro_start, micro_start + micro_count)], dim=-1)
        return qgrouped(act, _expert_cols(w2, micro_start, micro_count, inter), offs)

    out = routed_reference(x, gate, topk, norm_topk, expert_mlp)
    if shared_w1 is not None:
        out = out + shared_reference(x, shared_w1, shared_w2, micro_start, micro_count).float()
    return out.to(x.dtype)
