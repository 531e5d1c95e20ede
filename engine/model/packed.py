"""The packed per-micro layout of tensor-parallel weights, defined once: which slice of an official
checkpoint tensor a storage shard keeps, how it is packed, and which part of it a phase uses.

A dimension of size n split over the AR group (storage_size * micros logical ranks) gives each micro
n / logical_size; storage shard s keeps the contiguous block of its `micros` micros, starting at
s * micros * (n / logical_size). Two packings:
- rows (column-parallel weights: fused QKV by whole KV groups, gate/up, lm_head, expert gate/up):
  [micros, rows_per_micro, K]; a phase's micro range is a contiguous leading slice.
- cols (row-parallel weights: o_proj, shared down, expert down): [..., N, micros * cols_per_micro], the
  micros' input columns side by side (an expert pack has the expert as its leading dim); a phase's
  micro range is a column block.
Gate/up pairs are checkpoint rows [x1 (I) ; x2 (I)]; a micro keeps [x1 block ; x2 block] of its slice,
so SwiGLU stays local to the micro. The modules that own packed parameters read and view them only
through these helpers.

A read returns the layer's stored tensor set (`QuantTensors`: codes, scales, global scale, in the
checkpoint's format, engine/checkpoint/qtensors.py) with the same packed shape semantics: its codes and
per-row scales are laid out as above, scalar scales are shared. A column (K) split must keep whole
scale blocks in every micro (`check_col_split`, run by the load plan before anything is read). `dense`
turns a read into the compute dtype by exact dequantization (the CPU reference path). A layer the load
quantizes itself (`--quantize fp8`, `Checkpoint.online`) comes back from the read as FP8 with one scale
per output row of this shard's slice, quantized on the device it will live on.

Resident quantized packs (CUDA): a packed weight may instead stay in its stored format, as a
`QuantPack` (codes, scales and global scales as parameters, with the same leading dims and K columns
of codes and scales), so a micro view is a slice of codes and scales (`micro_rows`,
`micro_cols` return a `hunyuan_kernels.quant.QWeight` for it) and `linear` runs the quantized GEMM op of its
format. `PackFormat` is a pack's kernel format; the load plan decides which packs stay quantized
(engine/model/weights.py). `store` writes a read into either kind of parameter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import hunyuan_kernels as kernels
from hunyuan_kernels.quant import PER_BYTE, SCALE_BLOCK, QWeight, qlinear
from hunyuan_kernels.quant.formats import KernelLayout, fold_mx
from engine.parallel.layout import PhaseView, ShardLayout
from engine.checkpoint.shards import Checkpoint, CheckpointError
from engine.checkpoint.qtensors import QuantTensors, TensorSet, read_tensors
from engine.checkpoint.quant import WeightFormat


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


def _online(ckpt: Checkpoint, layer: str, q: QuantTensors, device) -> QuantTensors:
    """A layer the load quantizes itself: FP8 E4M3 with one scale per output row (amax / 448), made on
    the device the weight will live on (the Triton row quantizer on CUDA)."""
    if layer not in ckpt.online:
        return q
    codes = q.codes if device is None else q.codes.to(device)
    fp8, scale = kernels.call("quantize_fp8_rows", codes)
    return QuantTensors(WeightFormat.FP8_CHANNEL, fp8, scale)


def read_rows(ckpt: Checkpoint, layer: str, n: int, layout: ShardLayout, device=None) -> QuantTensors:
    """This shard's output rows [micros * r, K] of the [n, K] layer (view as [micros, r, K])."""
    q = read_tensors(ckpt, _tensor_set(ckpt, layer), rows=shard_block(n, layout))
    return _online(ckpt, layer, q, device)


def read_cols(ckpt: Checkpoint, layer: str, n: int, layout: ShardLayout, device=None) -> QuantTensors:
    """This shard's input columns [N, micros * c] of the [N, n] layer."""
    ts = _tensor_set(ckpt, layer)
    check_col_split(layer, n, ts.format, layout, "the input dimension")
    return _online(ckpt, layer, read_tensors(ckpt, ts, cols=shard_block(n, layout)), device)


def read_gate_up(ckpt: Checkpoint, layer: str, inter: int, layout: ShardLayout, device=None) -> QuantTensors:
    """[micros, 2 * I_micro, K]: each micro's [x1 block ; x2 block] of the [2 * inter, K] layer."""
    blk, M, ts = shard_block(inter, layout), layout.micros, _tensor_set(ckpt, layer)
    x1 = read_tensors(ckpt, ts, rows=blk)
    x2 = read_tensors(ckpt, ts, rows=slice(inter + blk.start, inter + blk.stop), scalars_of=x1)
    x1, x2 = (_online(ckpt, layer, q, device) for q in (x1, x2))
    per_micro = [q.map_rows(lambda t: t.view(M, -1, t.shape[-1])) for q in (x1, x2)]
    return QuantTensors.join(per_micro, lambda ts: torch.cat(ts, dim=1))


def dense(q: QuantTensors, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """The read's weights in `dtype`, dequantized exactly (hunyuan_kernels/quant/formats.py), on `device`
    (the parameter's: the compact codes move, the dequantization runs there). A float read stays where it
    is: the parameter's copy_ moves it."""
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


# ------------------------------------------------------------------ resident quantized packs
KERNEL_FORMAT = {WeightFormat.MXFP8: "mxfp8", WeightFormat.MXFP4: "mxfp4", WeightFormat.NVFP4: "nvfp4",
                 WeightFormat.FP8_CHANNEL: "fp8", WeightFormat.FP8_TENSOR: "fp8"}


@dataclass(frozen=True)
class PackFormat:
    """The kernel format a pack stays in ("mxfp8", "mxfp4", "nvfp4", "fp8" per output channel), and for
    NVFP4 whether the global scale divides the block scale (compressed-tensors) or multiplies it."""
    fmt: str
    inverse: bool = False

    @classmethod
    def of(cls, fmt: WeightFormat, inverse: bool = False) -> "PackFormat":
        return cls(KERNEL_FORMAT[fmt], inverse and fmt is WeightFormat.NVFP4)


class QuantPack(nn.Module):
    """A packed weight of logical shape [*lead, N, K] kept quantized: codes [*lead, N, K / per byte],
    scales [*lead, N, K / block] (or [*lead, N, 1] for FP8), gscale (NVFP4) [*gscale_lead, 1, 1] or []
    (one per expert of an expert pack: `gscale_lead` = (E,)). The tensors are parameters (never
    trained), so the resident accounting and the pointer checks see them."""

    def __init__(self, fmt: PackFormat, shape: tuple[int, ...], gscale_lead: tuple[int, ...] = (), device=None):
        super().__init__()
        *lead, n, k = shape
        f = fmt.fmt
        block = SCALE_BLOCK[f]
        if block and k % block:
            raise ValueError(f"a {f} pack needs K ({k}) to be a multiple of {block}")
        self.format, self.shape = fmt, tuple(shape)

        def param(*size, dtype):
            return nn.Parameter(torch.empty(size, dtype=dtype, device=device), requires_grad=False)
        self.codes = param(*lead, n, k // PER_BYTE[f], dtype=torch.uint8 if PER_BYTE[f] == 2 else torch.float8_e4m3fn)
        if f == "fp8":
            self.scales = param(*lead, n, 1, dtype=torch.float32)
        else:
            self.scales = param(*lead, n, k // block, dtype=torch.float8_e4m3fn if f == "nvfp4" else torch.uint8)
        self.gscale = param(*gscale_lead, *((1, 1) if gscale_lead else ()), dtype=torch.float32) if f == "nvfp4" else None
        self.layout: KernelLayout | None = None     # set once, at load, by `take_layout`

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def value(self) -> QWeight:
        return QWeight(self.format.fmt, self.codes, self.scales, self.gscale, self.format.inverse, self.layout)

    def take_layout(self, w: QWeight) -> None:
        """Hold the same weight laid out at load for one kernel family (hunyuan_kernels/quant/humming.py
        `lay_out`): its codes, scales and fp32 remainder replace the plain ones (the plain tensors are
        freed; the pack is then read only by that family's variants)."""
        if self.layout is not None or w.layout is None:
            raise ValueError("take_layout: a plain pack takes one laid-out weight, once")
        self.codes = nn.Parameter(w.codes, requires_grad=False)
        self.scales = nn.Parameter(w.scales, requires_grad=False)
        if w.layout.scale2 is not None:
            self.scale2 = nn.Parameter(w.layout.scale2, requires_grad=False)
        self.layout = w.layout

    def fold_to_fp8(self) -> None:
        """Turn this MX pack into an FP8 pack (per output channel), once, at load: its codes folded with their
        block scales (hunyuan_kernels/quant/formats.py `fold_mx`: exact but for the values under E4M3's normal
        range in blocks below their row's largest scale), its E8M0 scales replaced by one fp32 scale a row.
        It is then read by every FP8 op (W8A8: cuBLAS's row-wise scaled GEMMs, the decode GEMVs on rows
        quantized per token). An MXFP8 pack is folded in place (one matrix at a time, so the fp32 temporaries
        stay one matrix's); an MXFP4 pack's codes take twice the bytes after (one E4M3 code an element): the
        CPU's stand-in for W4A8 (`fold_all_to_fp8`), not a GPU layout."""
        fmt = self.format.fmt
        if fmt not in ("mxfp8", "mxfp4") or self.layout is not None:
            raise ValueError(f"fold_to_fp8 folds a plain mxfp8 or mxfp4 pack (this one: {fmt}"
                             f"{', laid out for ' + self.layout.kernel if self.layout else ''})")
        codes_in = self.codes.data.reshape(-1, *self.codes.shape[-2:])
        scales_in = self.scales.data.reshape(-1, *self.scales.shape[-2:])
        if fmt == "mxfp8":
            codes = self.codes.data
        else:
            codes = torch.empty(*self.shape, dtype=torch.float8_e4m3fn, device=self.device)
        out = codes.view(-1, *codes.shape[-2:])
        scales = torch.empty(*self.shape[:-1], 1, dtype=torch.float32, device=self.device)
        flat = scales.view(-1, *scales.shape[-2:])
        for i in range(codes_in.shape[0]):
            folded, flat[i] = fold_mx(codes_in[i], scales_in[i], fmt)
            out[i].copy_(folded)
        self.codes = nn.Parameter(codes, requires_grad=False)
        self.scales = nn.Parameter(scales, requires_grad=False)
        self.format = PackFormat("fp8")

    def _conform(self, q: QuantTensors, layer: str) -> QuantTensors:
        if not q.format.quantized or PackFormat.of(q.format, q.global_inverse) != self.format:
            raise CheckpointError(f"{layer} is stored as {q.format.value}, but its resident pack is {self.format.fmt}")
        if q.format is WeightFormat.FP8_TENSOR:      # one scale: the same for every output channel
            q = QuantTensors(WeightFormat.FP8_CHANNEL, q.codes, q.scales.reshape(()).expand(*q.codes.shape[:-1], 1))
        return q

    def fill(self, q: QuantTensors, layer: str, index=(), gindex=None, micro_rows: int | None = None) -> None:
        """Write a read of `layer` into [index] of the pack (see `store`); gindex: the global scale's."""
        q = self._conform(q, layer)
        codes, scales = q.codes, q.scales
        if micro_rows:
            codes, scales = (t.reshape(micro_rows, -1, t.shape[-1]) for t in (codes, scales))
        self.codes[index].copy_(codes)
        self.scales[index].copy_(scales)
        if self.gscale is not None:
            (self.gscale[gindex] if gindex is not None else self.gscale).copy_(q.global_scale)


Packed = torch.Tensor | QuantPack


def packed_param(shape: tuple[int, ...], fmt: PackFormat | None, dtype, device, gscale_lead: tuple[int, ...] = ()
                 ) -> Packed:
    """A packed parameter: float (dequantized at load), or kept quantized in `fmt`."""
    if fmt is None:
        return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))
    return QuantPack(fmt, shape, gscale_lead, device)


def check_micro_cols(fmt: PackFormat | None, per_micro: int, what: str) -> None:
    """A cols-packed pack kept quantized: each micro's column block must be whole scale blocks of its
    format (a phase's micro range is then a slice of codes and scales along K)."""
    block = SCALE_BLOCK[fmt.fmt] if fmt is not None else None
    if block and per_micro % block:
        raise ValueError(f"{what}: {per_micro} input columns per micro are not a multiple of the {fmt.fmt} "
                         f"scale block of {block}, so a micro's column block would cut the scale blocks")


def store(target: Packed, q: QuantTensors, layer: str, index=(), gindex=None, micro_rows: int | None = None) -> None:
    """Write a read into target[index]: micro_rows=M: the read's rows are M micros one after another
    (viewed [M, r, K]); a cols-packed read ([N, micros * c]) is stored as it is. A float parameter
    receives the exact dequantization, a QuantPack the codes and scales."""
    if isinstance(target, QuantPack):
        target.fill(q, layer, index, gindex, micro_rows)
        return
    d = dense(q, target.dtype, target.device)
    if micro_rows:
        d = d.view(micro_rows, -1, d.shape[-1])
    target[index].copy_(d)


def value(param: Packed | None) -> torch.Tensor | QWeight | None:
    """What the kernel ops take: the float tensor, or the pack's QWeight."""
    return param.value() if isinstance(param, QuantPack) else param


def micro_rows(param: Packed, view: PhaseView) -> torch.Tensor | QWeight:
    """The active micros of a rows-packed [micros, r, K] parameter as one [count * r, K] weight."""
    if isinstance(param, QuantPack):
        return param.value()[view.micros].flat_rows()
    return param[view.micros].reshape(-1, param.shape[-1])


def micro_cols(param: Packed, view: PhaseView, micros: int) -> torch.Tensor | QWeight:
    """The active micros of a cols-packed [N, micros * c] parameter: [N, count * c]."""
    c = param.shape[1] // micros
    start, stop = view.micro_start * c, (view.micro_start + view.micro_count) * c
    if isinstance(param, QuantPack):
        return param.value().cols(start, stop)
    return param[:, start:stop]


def linear(x: torch.Tensor, w: torch.Tensor | QWeight) -> torch.Tensor:
    """x @ w^T for a float weight or a quantized one (the GEMM op of its format)."""
    return qlinear(x, w) if isinstance(w, QWeight) else F.linear(x, w)
