"""FlashInfer (`pip install '.[flashinfer]'`), imported lazily: only when a CUDA call's candidates are first
listed (`available()`), never at import of `kernels`, so CPU builds and machines without it see no
change. Its variants sit beside each op's reference and Triton variant (norm.py, sampling.py,
decode_attention.py), registered after the Triton one: the registry prefers the earlier variant, so a
FlashInfer variant runs only where it is selected (`kernels.allowed("flashinfer")`,
`HUNYUAN_KERNELS=flashinfer`) or where Triton's `fits` refuses the arguments and FlashInfer's takes them.

The API relied on is FlashInfer 0.7's (read from the 0.7.4 wheel): `flashinfer.norm.rmsnorm(input, weight,
eps, out=)`, `flashinfer.top_k(input, k, sorted=, deterministic=, tie_break=)` and
`flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout, use_cuda_graph, ..., backend=)` with
`plan(..., disable_split_kv=)` and `run(q, (k, v), out=)`. Other versions are not offered.

FlashInfer compiles each kernel family the first time it is used (its JIT cache: $FLASHINFER_WORKSPACE_BASE,
default ~/.cache/flashinfer): on one H200 the norm module took 47 s and sampling 103 s.
"""
from __future__ import annotations

import functools
import re
from types import ModuleType

import torch

NAME = "flashinfer"
SUPPORTED = ((0, 7, 4), (0, 8, 0))      # [lowest, first unsupported): the API above


def _version(text: str) -> tuple[int, int, int]:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2]), int(m[3])) if m else (0, 0, 0)


@functools.cache
def lib() -> ModuleType | None:
    """The `flashinfer` module where it imports at a supported version, else None (cached)."""
    try:
        import flashinfer
    except Exception:  # noqa: BLE001  (absent, or present but broken: either way not offered)
        return None
    lo, hi = SUPPORTED
    return flashinfer if lo <= _version(getattr(flashinfer, "__version__", "0")) < hi else None


def available() -> bool:
    return lib() is not None and torch.cuda.is_available()
