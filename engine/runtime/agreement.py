"""What every rank of a plan must decide the same way, decided by rank 0 and broadcast.

The sampled tokens (one small broadcast per decode step, every row of the batch at once, which is also
the step's one host read) and, for a request run on its own (`Engine.run`), the cancel decision; so
every rank feeds the same tokens and stops at the same step. Which requests join or leave the engine's
batch is agreed by the worker (engine/serve/worker.py) at each step boundary.
"""
from __future__ import annotations

import torch

from engine.parallel.layout import Comm


class Agreement:
    """Rank 0's sampled tokens and cancel decisions, made every rank's."""

    def __init__(self, world: Comm, device: torch.device):
        self.world, self.buf = world, torch.zeros(1, dtype=torch.long, device=device)

    def tokens(self, ids: torch.Tensor) -> list[int]:
        """Rank 0's ids [n] (a device buffer, overwritten on the other ranks) -> the ints, on every rank."""
        if self.world.size > 1:
            self.world.broadcast_(ids, 0)
        return ids.tolist()

    def token(self, token: torch.Tensor) -> int:
        """One id (a 0-d device tensor) -> rank 0's int."""
        return int(token) if self.world.size == 1 else self.tokens(token.reshape(1).clone())[0]

    def flag(self, value: bool) -> bool:
        if self.world.size == 1:
            return value
        self.buf[0] = int(value)
        self.world.broadcast_(self.buf, 0)
        return bool(self.buf[0])
