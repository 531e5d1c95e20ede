"""Triton, when it can be imported (the CPU test machine has it too: its interpreter runs the kernels on
CPU tensors with TRITON_INTERPRET=1, set before this module is first imported)."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - Triton ships with CUDA torch builds
    triton = tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"

# the float dtypes every elementwise op here supports on CUDA
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def available() -> bool:
    return HAS_TRITON


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
