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
"""
from __future__ import annotations

import torch

from engine.parallel.layout import PhaseView, ShardLayout
from engine.spec.checkpoint import Checkpoint


def shard_block(n: int, layout: ShardLayout) -> slice:
    """The part of a dimension of size n that this rank's storage shard keeps."""
    block = n // layout.logical_size * layout.micros
    return slice(layout.storage_rank * block, (layout.storage_rank + 1) * block)


def read_rows(ckpt: Checkpoint, name: str, n: int, layout: ShardLayout) -> torch.Tensor:
    """This shard's output rows [micros * r, K] of the [n, K] tensor `name` (view as [micros, r, K])."""
    return ckpt.read(name, (shard_block(n, layout),))


def read_cols(ckpt: Checkpoint, name: str, n: int, layout: ShardLayout) -> torch.Tensor:
    """This shard's input columns [N, micros * c] of the [N, n] tensor `name`."""
    return ckpt.read(name, (slice(None), shard_block(n, layout)))


def read_gate_up(ckpt: Checkpoint, name: str, inter: int, layout: ShardLayout) -> torch.Tensor:
    """[micros, 2 * I_micro, K]: each micro's [x1 block ; x2 block] of the [2 * inter, K] tensor `name`."""
    blk, M = shard_block(inter, layout), layout.micros
    x1 = ckpt.read(name, (blk,))
    x2 = ckpt.read(name, (slice(inter + blk.start, inter + blk.stop),))
    return torch.cat([x1.view(M, -1, x1.shape[-1]), x2.view(M, -1, x2.shape[-1])], dim=1)


def micro_rows(param: torch.Tensor, view: PhaseView) -> torch.Tensor:
    """The active micros of a rows-packed [micros, r, K] parameter as one [count * r, K] weight."""
    return param[view.micros].reshape(-1, param.shape[-1])


def micro_cols(param: torch.Tensor, view: PhaseView, micros: int) -> torch.Tensor:
    """The active micros of a cols-packed [N, micros * c] parameter: [N, count * c]."""
    c = param.shape[1] // micros
    return param[:, view.micro_start * c:(view.micro_start + view.micro_count) * c]
