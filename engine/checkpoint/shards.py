"""Lazy, slice-wise reads of an official safetensors checkpoint.

`model.safetensors.index.json` + shards, or a single `model.safetensors`. Only headers are read up
front; a tensor (or a slice of one) is read when asked, straight from the memory-mapped shard, so
host memory during a load stays near the size of the largest tensor read. Dtypes come from the
headers. Nothing in the folder is executed.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}       # the last two: quantized tensor sets
FLOAT_DTYPES = ("F32", "F16", "BF16")


class CheckpointError(ValueError):
    """The checkpoint folder does not match what the config describes."""


@dataclass(frozen=True)
class TensorSpec:
    """What validation accepts for one tensor: any of these shapes, any of these dtypes."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...] = FLOAT_DTYPES


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str          # safetensors dtype code, e.g. "BF16"
    file: str           # shard file name


def _read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"shard {path.name} is missing from {path.parent}") from None
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"shard {path.name} is not a readable safetensors file: {e}") from None


class Checkpoint:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.exists():
            try:
                weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            files = sorted(set(weight_map.values()))
        elif single.exists():
            weight_map, files = {}, [single.name]
        else:
            raise CheckpointError(f"no model.safetensors.index.json or model.safetensors in {self.folder}")

        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            for name, meta in _read_header(self.folder / file).items():
                if name == "__metadata__":
                    continue
                if weight_map and weight_map.get(name) != file:
                    continue  # the index is authoritative about which shard holds a tensor
                self.tensors[name] = TensorInfo(name, tuple(meta["shape"]), meta["dtype"], file)
        for name, file in weight_map.items():
            if name not in self.tensors:
                raise CheckpointError(f"tensor {name!r} is listed in the index under {file} but that shard lacks it")
        self._handles: dict[str, object] = {}
        # layer -> its stored tensor set (engine/checkpoint/qtensors.py), filled by the load plan; a layer not
        # listed is a plain float `layer.weight`
        self.formats: dict[str, object] = {}
        # layers the load quantizes itself as they are read (`--quantize fp8`: FP8 per output channel)
        self.online: frozenset[str] = frozenset()
        self.bytes_read = 0  # what this process actually pulled from disk (tests check per-rank reads)

    def close(self) -> None:
        self._handles.clear()

    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(str(self.folder / file), framework="pt", device="cpu")
        return h

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.folder}") from None

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """The tensor, or `tensor[index]` for a tuple of slices, read without loading the rest."""
        info = self.info(name)
        if info.dtype not in DTYPES:
            raise CheckpointError(f"tensor {name!r} in {info.file} has dtype {info.dtype}, which this engine "
                                  f"does not load (supported: {', '.join(DTYPES)})")
        t = self._handle(info.file).get_slice(name)[index] if index else self._handle(info.file).get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def validate(self, expected: Mapping[str, tuple[int, ...] | TensorSpec], skipped: Iterable[str] = ()) -> None:
        """Every expected tensor is present with an allowed shape and dtype (a plain shape: that shape, a
        float dtype); nothing else is there."""
        skipped = set(skipped)
        problems: list[str] = []
        for name, spec in expected.items():
            spec = spec if isinstance(spec, TensorSpec) else TensorSpec((tuple(spec),))
            shapes = " or ".join(str(list(s)) for s in spec.shapes)
            info = self.tensors.get(name)
            if info is None:
                problems.append(f"missing tensor {name!r} (expected shape {shapes})")
            elif info.shape not in spec.shapes:
                problems.append(f"tensor {name!r} in {info.file} has shape {list(info.shape)}, expected {shapes}")
            elif info.dtype not in spec.dtypes:
                what = "unsupported dtype" if spec.dtypes == FLOAT_DTYPES else "dtype"
                problems.append(f"tensor {name!r} in {info.file} has {what} {info.dtype} "
                                f"(expected {' or '.join(spec.dtypes)})")
        for name, info in self.tensors.items():
            if name not in expected and name not in skipped:
                problems.append(f"unexpected tensor {name!r} in {info.file}")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise CheckpointError(f"checkpoint {self.folder} does not match config.json: "
                                  + "; ".join(problems[:8]) + more)
