"""The tensors of one linear or expert as stored, whatever its format: which tensors a layer holds
(`TensorSet`, found from the checkpoint's names and dtypes), what shapes they must have, and the read
of a row or column slice of all of them at once (`QuantTensors`, codes + scales + global scale).

On disk, per layer of N output rows and K input columns (research/quant_formats.md §1-§5):
  BF16        weight F32/F16/BF16 [N, K]
  MXFP8       weight F8_E4M3 (or BF16 holding E4M3 values) [N, K], weight_scale U8 [N, K/32]
  MXFP4       weight_packed U8 [N, K/2], weight_scale U8 [N, K/32]
  NVFP4 (CT)  weight_packed U8 [N, K/2], weight_scale F8_E4M3 [N, K/16], weight_global_scale F32 [1]
              (the block scale is divided by it)
  NVFP4 (ModelOpt) weight U8 [N, K/2], weight_scale F8_E4M3 [N, K/16], weight_scale_2 F32 [] (multiplies)
  FP8 channel weight F8_E4M3 [N, K], weight_scale F32 [N] or [N, 1]
  FP8 tensor  weight F8_E4M3 [N, K], weight_scale F32 [] or [1]
Activation scales (`input_scale`, `input_global_scale`) are accepted and not read: the weight-only
and dynamic-activation paths do not use them.

Slices: rows (output channels) slice the codes and every per-row scale; columns (K) slice the codes at
K / elements-per-byte and the block scales at K / block, so a column slice must start and end on a
block. Scalar scales are read whole by every reader.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import torch

from engine.checkpoint.shards import FLOAT_DTYPES, Checkpoint, CheckpointError, TensorInfo, TensorSpec
from engine.checkpoint.quant import WeightFormat

ACTIVATION_SCALES = ("input_scale", "input_global_scale")
SCALAR = ((), (1,))


@dataclass(frozen=True)
class TensorSet:
    """How one layer's tensors are named and stored."""
    layer: str
    format: WeightFormat
    codes: str = "weight"                 # suffix of the element tensor
    scales: str | None = None             # suffix of the block / channel / tensor scale
    global_scale: str | None = None       # suffix of the NVFP4 global scale
    global_inverse: bool = False          # compressed-tensors' global scale divides the block scale
    unused: tuple[str, ...] = ()          # suffixes present and not read (activation scales)

    def specs(self, n: int, k: int) -> dict[str, TensorSpec]:
        """Every tensor of the set with the shapes and dtypes its format allows."""
        f, p = self.format, f"{self.layer}."
        if f is WeightFormat.BF16:
            return {p + self.codes: TensorSpec(((n, k),))}
        out = {}
        if f is WeightFormat.MXFP8:
            out[p + self.codes] = TensorSpec(((n, k),), ("F8_E4M3", "BF16"))
            out[p + self.scales] = TensorSpec(((n, k // 32),), ("U8",))
        elif f is WeightFormat.MXFP4:
            out[p + self.codes] = TensorSpec(((n, k // 2),), ("U8",))
            out[p + self.scales] = TensorSpec(((n, k // 32),), ("U8",))
        elif f is WeightFormat.NVFP4:
            out[p + self.codes] = TensorSpec(((n, k // 2),), ("U8",))
            out[p + self.scales] = TensorSpec(((n, k // 16),), ("F8_E4M3",))
            out[p + self.global_scale] = TensorSpec(SCALAR, ("F32",))
        elif f is WeightFormat.FP8_CHANNEL:
            out[p + self.codes] = TensorSpec(((n, k),), ("F8_E4M3",))
            out[p + self.scales] = TensorSpec(((n,), (n, 1)), ("F32", "BF16", "F16"))
        else:
            out[p + self.codes] = TensorSpec(((n, k),), ("F8_E4M3",))
            out[p + self.scales] = TensorSpec(SCALAR, ("F32",))
        for u in self.unused:
            out[p + u] = TensorSpec(SCALAR, ("F32",))
        return out


def group_by_layer(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, TensorInfo]]:
    """layer -> {suffix: info} for every tensor name `layer.suffix`."""
    out: dict[str, dict[str, TensorInfo]] = {}
    for name, info in tensors.items():
        layer, _, suffix = name.rpartition(".")
        out.setdefault(layer, {})[suffix] = info
    return out


def _describe(found: Mapping[str, TensorInfo]) -> str:
    return ", ".join(f"{s} {i.dtype} {list(i.shape)}" for s, i in sorted(found.items()))


def detect(layer: str, found: Mapping[str, TensorInfo]) -> TensorSet | None:
    """The tensor set of `layer` from its tensors' names and dtypes; None when it has no tensors.
    Raises CheckpointError for a set that is no format this engine loads."""
    if not found:
        return None
    d = {s: i.dtype for s, i in found.items()}
    unused = tuple(s for s in ACTIVATION_SCALES if s in d)
    rest = {s: t for s, t in d.items() if s not in unused}
    W = WeightFormat
    sets: list[tuple[dict[str, tuple[str, ...]], Callable[[], TensorSet]]] = [
        ({"weight": FLOAT_DTYPES}, lambda: TensorSet(layer, W.BF16)),
        ({"weight_packed": ("U8",), "weight_scale": ("U8",)},
         lambda: TensorSet(layer, W.MXFP4, "weight_packed", "weight_scale", unused=unused)),
        ({"weight_packed": ("U8",), "weight_scale": ("F8_E4M3",), "weight_global_scale": ("F32",)},
         lambda: TensorSet(layer, W.NVFP4, "weight_packed", "weight_scale", "weight_global_scale", True, unused)),
        ({"weight": ("U8",), "weight_scale": ("F8_E4M3",), "weight_scale_2": ("F32",)},
         lambda: TensorSet(layer, W.NVFP4, "weight", "weight_scale", "weight_scale_2", False, unused)),
        ({"weight": ("F8_E4M3", "BF16"), "weight_scale": ("U8",)},
         lambda: TensorSet(layer, W.MXFP8, "weight", "weight_scale", unused=unused)),
        ({"weight": ("F8_E4M3",), "weight_scale": ("F32", "BF16", "F16")},
         lambda: TensorSet(layer, W.FP8_TENSOR if _numel(found["weight_scale"]) == 1 else W.FP8_CHANNEL,
                           "weight", "weight_scale", unused=unused)),
    ]
    for need, make in sets:
        if set(rest) == set(need) and all(rest[s] in dt for s, dt in need.items()):
            if make().format is W.BF16 and unused:
                break                         # activation scales beside a float weight: not a known set
            return make()
    raise CheckpointError(f"layer {layer} holds {_describe(found)}: not a weight format this engine loads "
                          "(supported: BF16, MXFP8, MXFP4, NVFP4, FP8 per channel or per tensor)")


def _numel(info: TensorInfo) -> int:
    n = 1
    for d in info.shape:
        n *= d
    return n


@dataclass(frozen=True)
class QuantTensors:
    """One layer's tensors in memory (or a slice of them), in its format.

    codes: [..., rows, K] (float or E4M3) or [..., rows, K/2] (uint8, two E2M1 codes a byte).
    scales: [..., rows, K/block] (block), [..., rows, 1] (per channel), a 0-d tensor (per tensor), None.
    global_scale: 0-d float32 (NVFP4) or None; `global_inverse`: it divides the block scale.
    Leading dimensions ([micros, ...]) are the packed layout's (engine/model/packed.py)."""
    format: WeightFormat
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    global_inverse: bool = False

    def to(self, device: torch.device | str) -> "QuantTensors":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, codes=move(self.codes), scales=move(self.scales), global_scale=move(self.global_scale))

    def _row_scaled(self) -> bool:
        return self.scales is not None and self.scales.dim() >= 2

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantTensors":
        """Apply a rearrangement of rows (and leading dims) to the codes and every per-row scale."""
        return replace(self, codes=fn(self.codes), scales=fn(self.scales) if self._row_scaled() else self.scales)

    @staticmethod
    def join(parts: Sequence["QuantTensors"], fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> "QuantTensors":
        """Combine row blocks of one layer (e.g. the x1 and x2 halves of gate/up) with `fn` (a cat)."""
        first = parts[0]
        scales = fn([p.scales for p in parts]) if first._row_scaled() else first.scales
        return replace(first, codes=fn([p.codes for p in parts]), scales=scales)


def _aligned(layer: str, what: str, sl: slice, step: int) -> slice:
    if sl.start % step or sl.stop % step:
        raise CheckpointError(f"columns {sl.start}:{sl.stop} of {layer} do not fall on its {what} of {step}")
    return slice(sl.start // step, sl.stop // step)


def read_tensors(ckpt: Checkpoint, ts: TensorSet, rows: slice | None = None, cols: slice | None = None,
                 scalars_of: QuantTensors | None = None) -> QuantTensors:
    """Rows and/or columns (in K elements) of the layer's tensors, each rank reading only its bytes;
    `scalars_of`: an earlier read of the same layer whose scalar scales are reused, not read again."""
    f, p = ts.format, f"{ts.layer}."
    rows = rows or slice(None)
    code_cols = _aligned(ts.layer, "code bytes", cols, f.per_byte) if cols is not None else slice(None)
    codes = ckpt.read(p + ts.codes, (rows, code_cols))
    if f is WeightFormat.MXFP8 and codes.dtype != torch.float8_e4m3fn:
        # vLLM-Omni's reading of "FP8 stored as BF16": accept it when every value is an E4M3 value
        fp8 = codes.to(torch.float8_e4m3fn)
        if not torch.equal(fp8.to(codes.dtype), codes):
            raise CheckpointError(f"{p + ts.codes} is stored as {codes.dtype} but holds values that are not "
                                  "float8 E4M3 (an MXFP8 weight must be)")
        codes = fp8
    if f is WeightFormat.BF16:
        return QuantTensors(f, codes)
    if f.block:
        scale_cols = _aligned(ts.layer, f"{f.value} blocks", cols, f.block) if cols is not None else slice(None)
        scales = ckpt.read(p + ts.scales, (rows, scale_cols))
    elif f is WeightFormat.FP8_CHANNEL:
        scales = ckpt.read(p + ts.scales, (rows,)).reshape(-1, 1).float()
    elif scalars_of is not None:
        scales = scalars_of.scales
    else:
        scales = ckpt.read(p + ts.scales).reshape(()).float()
    if scalars_of is not None:
        glob = scalars_of.global_scale
    else:
        glob = ckpt.read(p + ts.global_scale).reshape(()).float() if ts.global_scale else None
    return QuantTensors(f, codes, scales, glob, ts.global_inverse)
