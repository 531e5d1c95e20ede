"""What every rank of a plan must decide the same way, decided by rank 0 and broadcast.

The sampled token and the cancel decision are rank 0's (one small broadcast per decode token and
per denoise step), so every rank feeds the same token and stops at the same step.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.parallel.layout import Comm


class Agreement:
    """Rank 0's sampled tokens and cancel decisions, made every rank's (one small broadcast)."""

    def __init__(self, world: Comm, device: torch.device):
        self.world, self.buf = world, torch.zeros(2, dtype=torch.long, device=device)

    def __call__(self, token: int, cancel: bool) -> tuple[int, bool]:
        if self.world.size == 1:
            return token, cancel
        self.buf[0], self.buf[1] = token, int(cancel)
        self.world.broadcast_(self.buf, 0)
        return int(self.buf[0]), bool(self.buf[1])

    def cancelled(self, local: Callable[[], bool]) -> Callable[[], bool]:
        return lambda: self(0, local())[1]
