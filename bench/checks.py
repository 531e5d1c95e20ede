"""How the suites check a fast path before timing it: the relative error against a reference, a verdict
that prints with the figures, and NaN-filled memory for outputs to be drawn from (an element a kernel
leaves unwritten then shows up as NaN)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64."""
    want = want.to(torch.float64)
    return ((got.to(torch.float64) - want).norm() / want.norm()).item()


@dataclass(frozen=True)
class Check:
    err: float
    ok: bool

    def __str__(self) -> str:
        return f"{self.err:.1e}" + ("" if self.ok else " FAIL")


def compare(got: torch.Tensor, want: torch.Tensor, tol: float, again: torch.Tensor | None = None) -> Check:
    """Relative error within `tol`, nothing left NaN and, where a second run is given, the same bits."""
    err = rel_err(got, want)
    ok = bool(not got.isnan().any() and err < tol and (again is None or torch.equal(got, again)))
    return Check(err, ok)


def nan_blocks(device: torch.device | str, *like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """NaN (-1 for integers) into the caching allocator's free blocks of these (shape, dtype) sizes: the
    next outputs of these sizes start so. A no-op off CUDA (the CPU allocator does not hand freed blocks
    back)."""
    if torch.device(device).type != "cuda":
        return
    bufs = [torch.full(shape, float("nan") if dt.is_floating_point else -1, dtype=dt, device=device)
            for shape, dt in like]
    del bufs
