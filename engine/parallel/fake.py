"""One GPU standing in for one rank of a bigger plan (docs/design.md, Tests): a group whose collectives keep the
shapes of the real ones and move nothing, so rank r's exact work runs at the real shapes and its compute
can be timed alone. Used by the benchmarks (`bench/`); the engine never builds one."""
from __future__ import annotations

import torch

from .layout import Comm


class FakeComm(Comm):
    """A group of `size` ranks, seen from rank 0. What the real group does on the rank itself stays, so the
    compute-only figures count it: the all-to-all makes its send buffer contiguous first, as NCCL needs it
    (`groups.GroupComm`), and returns a contiguous result, as NCCL writes it; the all-gather returns the
    gathered shape (this rank's tensor repeated). The in-place reductions and broadcasts are the base
    class's no-ops."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat([t] * self.size, dim=dim) if self.size > 1 else t

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous() if self.size > 1 else t
