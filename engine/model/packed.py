"""The packed, micro-major layout of tensor-parallel weights, defined once: which slice of an official
checkpoint tensor a storage shard keeps, how it is packed, and which part of it a phase uses.

A dimension of size n split over the AR group (storage_size * micros logical ranks) gives each micro
n / logical_size; storage shard s keeps the contiguous block of its `micros` micros, starting at
s * micros * (n / logical_size). Two packings:
- rows (column-parallel weights: fused QKV by whole KV groups, gate/up, lm_head, expert gate/up):
  [micros, rows_per_micro, K]; a phase's micro range is a contiguous leading slice.
- cols (row-parallel weights: o_proj, shared down): [N, micros * cols_per_micro], the micros' input
  columns side by side; a phase's micro range is a column block.
Gate/up pairs are checkpoint rows [x1 (I) ; x2 (I)]; a micro keeps [x1 block ; x2 block] of its slice,
so SwiGLU stays local to the micro. The modules that own packed parameters read and view them only
through these helpers.

A read returns the layer's stored tensor set (`QuantTensors`: codes, scales, global scale, in the
checkpoint's format, engine/spec/qtensors.py) with the same packed shape semantics: its codes and
per-row scales are laid out as above, scalar scales are shared. A column (K) split must keep whole
scale blocks in every micro (`check_col_split`, run by the load plan before anything is read). `dense`
turns a read into the compute dtype by exact dequantization (the CPU reference path).
"""
from __future__ import annotations

import torch

import kernels
from engine.parallel.layout import PhaseView, ShardLayout
from engine.spec.checkpoint import Checkpoint, CheckpointError
from engine.spec.qtensors import QuantTensors, TensorSet, read_tensors
from engine.spec.quant import WeightFormat


def shard_block(n: int, layout: ShardLayout) -> slice:
    """The part of a dimension of size n that this rank's storage shard keeps."""
    block = n // layout.logical_size * layout.micros
    return slice(layout.storage_rank * block, (layout.storage_rank + 1) * block)


def _tensor_set(ckpt: Checkpoint, layer: str) -> TensorSet:
    return ckpt.formats.get(layer) or TensorSet(layer, WeightFormat.BF16)


def check_col_split(layer: str, n: int, fmt: WeightFormat, layout: ShardLayout, what: str) -> None:
    """Refuse a layout whose micros would cut the scale blocks along the K dimension n of `layer`."""
    per_micro = n // layout.logical_size
    if fmt.block and per_micro % fmt.block:
        raise CheckpointError(
            f"{what} ({n}, the input dimension K of {layer}) splits into {per_micro} columns per micro shard over "
            f"{layout.logical_size} micro shards, which cuts its {fmt.value.upper()} scale blocks of {fmt.block}: "
            f"this checkpoint needs a plan whose AR TP divides {n // fmt.block}")


def read_rows(ckpt: Checkpoint, layer: str, n: int, layout: ShardLayout) -> QuantTensors:
    """This shard's output rows [micros * r, K] of the [n, K] layer (view as [micros, r, K])."""
    return read_tensors(ckpt, _tensor_set(ckpt, layer), rows=shard_block(n, layout))


def read_cols(ckpt: Checkpoint, layer: str, n: int, layout: ShardLayout) -> QuantTensors:
    """This shard's input columns [N, micros * c] of the [N, n] layer."""
    ts = _tensor_set(ckpt, layer)
    check_col_split(layer, n, ts.format, layout, "the input dimension")
    return read_tensors(ckpt, ts, cols=shard_block(n, layout))


def read_gate_up(ckpt: Checkpoint, layer: str, inter: int, layout: ShardLayout) -> QuantTensors:
    """[micros, 2 * I_micro, K]: each micro's [x1 block ; x2 block] of the [2 * inter, K] layer."""
    blk, M, ts = shard_block(inter, layout), layout.micros, _tensor_set(ckpt, layer)
    x1 = read_tensors(ckpt, ts, rows=blk)
    x2 = read_tensors(ckpt, ts, rows=slice(inter + blk.start, inter + blk.stop), scalars_of=x1)
    per_micro = [q.map_rows(lambda t: t.view(M, -1, t.shape[-1])) for q in (x1, x2)]
    return QuantTensors.join(per_micro, lambda ts: torch.cat(ts, dim=1))


def dense(q: QuantTensors, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """The read's weights in `dtype`, dequantized exactly (kernels/quant.py), on `device` (the parameter's:
    the compact codes move, the dequantization runs there). A float read stays where it is: the
    parameter's copy_ moves it."""
    f = q.format
    if f is WeightFormat.BF16:
        return q.codes.to(dtype)
    if device is not None:
        q = q.to(device)
    if f is WeightFormat.MXFP8:
        return kernels.call("dequant_mxfp8", q.codes, q.scales, dtype)
    if f is WeightFormat.MXFP4:
        return kernels.call("dequant_mxfp4", q.codes, q.scales, dtype)
    if f is WeightFormat.NVFP4:
        return kernels.call("dequant_nvfp4", q.codes, q.scales, q.global_scale, q.global_inverse, dtype)
    return kernels.call("dequant_fp8", q.codes, q.scales, dtype)


def micro_rows(param: torch.Tensor, view: PhaseView) -> torch.Tensor:
    """The active micros of a rows-packed [micros, r, K] parameter as one [count * r, K] weight."""
    return param[view.micros].reshape(-1, param.shape[-1])


def micro_cols(param: torch.Tensor, view: PhaseView, micros: int) -> torch.Tensor:
    """The active micros of a cols-packed [N, micros * c] parameter: [N, count * c]."""
    c = param.shape[1] // micros
    return param[:, view.micro_start * c:(view.micro_start + view.micro_count) * c]
