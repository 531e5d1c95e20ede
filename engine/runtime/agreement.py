"""What every rank of a plan must decide the same way, decided by rank 0 and broadcast.

The sampled tokens (one small broadcast per decode step, every row of the batch at once, which is also
the step's one host read) and, for a request run on its own (`Engine.run`), the cancel decision; so
every rank feeds the same tokens and stops at the same step. Which requests join or leave the engine's
batch is agreed by the worker (engine/serve/worker.py) at each step boundary.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.parallel.layout import Comm


class Agreement:
    """Rank 0's sampled tokens and cancel decisions, made every rank's."""

    def __init__(self, world: Comm, device: torch.device):
        self.world, self.buf = world, torch.zeros(1, dtype=torch.long, device=device)
        cuda = device.type == "cuda"
        # the host's copy of a step's tokens (pinned: read without waiting for work queued after them)
        self._host = torch.zeros(32, dtype=torch.long, pin_memory=cuda)
        self._copied = torch.cuda.Event() if cuda else None

    def tokens(self, ids: torch.Tensor) -> list[int]:
        """Rank 0's ids [n] (a device buffer, overwritten on the other ranks) -> the ints, on every rank."""
        return self.tokens_later(ids)()

    def tokens_later(self, ids: torch.Tensor) -> Callable[[], list[int]]:
        """`tokens` in two halves: rank 0's ids broadcast into `ids` and copied towards the host now; the
        call returned reads them, waiting for that copy only (not for work queued after it, such as the
        next decode step launched ahead: decode_step.py `DecodeStep.ahead`). Call it before the next
        `tokens_later` (one host buffer)."""
        if self.world.size > 1:
            self.world.broadcast_(ids, 0)
        if self._copied is None:
            return ids.tolist
        n = ids.numel()
        if self._host.numel() < n:     # grows to the widest decode step once (pinned memory is slow to get)
            self._host = torch.zeros(max(n, 2 * self._host.numel()), dtype=torch.long, pin_memory=True)
        host = self._host[:n]
        host.copy_(ids, non_blocking=True)
        self._copied.record()
        return lambda: (self._copied.synchronize(), host.tolist())[1]

    def token(self, token: torch.Tensor) -> int:
        """One id (a 0-d device tensor) -> rank 0's int."""
        return int(token) if self.world.size == 1 else self.tokens(token.reshape(1).clone())[0]

    def flag(self, value: bool) -> bool:
        if self.world.size == 1:
            return value
        self.buf[0] = int(value)
        self.world.broadcast_(self.buf, 0)
        return bool(self.buf[0])
