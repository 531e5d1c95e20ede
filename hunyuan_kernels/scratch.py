"""Scratch buffers of the fast paths: `empty` is torch.empty, except inside `poisoned()` (tests), where
every buffer starts as NaN (0 for integers), so an element a kernel reads before writing shows up."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_POISON = [False]


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if _POISON[-1]:
        return torch.full(shape, float("nan") if dtype.is_floating_point else 0, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    _POISON.append(True)
    try:
        yield
    finally:
        _POISON.pop()
