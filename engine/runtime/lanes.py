"""The image lane: a second CUDA stream on which the overlap step policy (engine/runtime/scheduler.py) runs
the image phase's work (the denoise batch's forwards, the members' updates, the hand-offs and VAE decodes)
beside the default stream's AR work (slot prefills, the batched decode step and its one token read).

A memory-bound decode step can then run while a compute-bound denoise step occupies the GPU: the decode
step's token read waits for the default stream only. What the two lanes share is ordered by the stream
waits here, never by a host sync:
- the image lane's work starts after what the default stream queued before it (`image`): a hand-off reads
  the AR slot the AR phase wrote, a joining request's inputs were made there;
- the default stream waits for the image lane (`merge`) after a request's own work (its hand-off gave its
  AR slot back for another request's prefill; its VAE decode ended it) and before a cancel (whose clean-up
  moves or frees rows the image lane may still be computing on).
Each request's image-phase tensors are made and freed on the image lane, so the caching allocator never
hands the default stream a block the image lane still reads. The two lanes' CUDA graphs replay from
memory pools of their own (engine/runtime/graphs.py).

Without CUDA (the CPU), or under the other policies, there is one lane: every call here does nothing, and
the scheduler runs the same code in the same order.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Lanes:
    def __init__(self, device: torch.device | None):
        """`device`: the CUDA device whose image lane to make; None (or a CPU device): one lane."""
        self.side = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None

    @contextlib.contextmanager
    def image(self) -> Iterator[None]:
        """The block's work on the image lane, after what the default stream queued before it."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            yield

    def merge(self) -> None:
        """The default stream's later work waits for the image lane's queued work (no host wait)."""
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
