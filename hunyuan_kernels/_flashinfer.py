"""FlashInfer (`pip install '.[flashinfer]'`), found without importing it: `available()` reads the installed
distribution's version (listing a CUDA call's candidates must not pay its import, seconds long, when the
Triton variant runs anyway), and `lib()` imports it at the first call of a FlashInfer variant. CPU builds
and machines without it see no change. Its variants sit beside each op's reference and Triton variant
(norm.py, sampling.py, decode_attention.py), registered after the Triton one: the registry prefers the
earlier variant, so a FlashInfer variant runs only where it is selected (`kernels.allowed("flashinfer")`)
or where Triton's `fits` refuses the arguments and FlashInfer's takes them.

The API relied on is FlashInfer 0.7's (read from the 0.7.4 wheel): `flashinfer.norm.rmsnorm(input, weight,
eps, out=)`, `flashinfer.top_k(input, k, sorted=, deterministic=, tie_break=)` and
`flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, use_cuda_graph, <its three buffers>,
backend=)` with `plan(indptr, indices, last_page_len, Hq, Hkv, D, page_size, q_data_type=, kv_data_type=)` and
`run(q, (k, v), out=)`. Other versions are not offered.

FlashInfer compiles each kernel family the first time it is used (its JIT cache: $FLASHINFER_WORKSPACE_BASE,
default ~/.cache/flashinfer): on one H200 the norm module took 47 s and sampling 103 s (issue 32).
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from types import ModuleType

import torch

NAME = "flashinfer"
DIST = "flashinfer-python"
SUPPORTED = ((0, 7, 4), (0, 8, 0))      # [lowest, first unsupported): the API above


def _version(text: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else (0, 0, 0)


def _dist_version() -> str | None:
    """The version of the installed flashinfer-python whose `flashinfer` module is on the path, else None."""
    if importlib.util.find_spec("flashinfer") is None:
        return None
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def installed() -> str | None:
    """The installed version where it is a supported one (cached; nothing imported)."""
    v = _dist_version()
    lo, hi = SUPPORTED
    return v if v is not None and lo <= _version(v) < hi else None


def available() -> bool:
    return installed() is not None and torch.cuda.is_available()


@functools.cache
def lib() -> ModuleType:
    """The `flashinfer` module, imported at the first call of a FlashInfer variant."""
    import flashinfer
    return flashinfer
