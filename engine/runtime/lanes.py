"""The two lanes of the overlap step policy (engine/runtime/scheduler.py): the image lane, a CUDA stream on which
the image phase's work runs (the denoise batch's forwards, the members' updates, the hand-offs and VAE decodes),
beside the AR lane, the stream of the AR work (slot prefills, the batched decode step and its one token read).

A memory-bound decode step can then run while a compute-bound denoise step occupies the GPU: the decode
step's token read waits for the AR lane only. What the two lanes share is ordered by the stream waits here,
never by a host sync:
- the image lane's work starts after what the AR lane queued before it (`image`): a hand-off reads the AR
  slot the AR phase wrote, a joining request's inputs were made there;
- the AR lane never waits for the image lane's queued steps on a request's own work: the AR slot a hand-off
  gives back (on the image lane) is free for another request's prefill once the image lane has passed an
  event recorded after it (`fence`, engine/runtime/kv_pool.py `release_slot`), and the tensors the AR phase
  made that the image phase reads (its reference images' encodings) are recorded on the image lane, so the
  caching allocator does not reuse their blocks before that lane's work on them is done;
- the AR lane waits for the image lane (`merge`) before a cancel (whose clean-up moves or frees rows the image
  lane may still be computing on) and before an adapter change (the image lane's forwards read the tables).
Each request's image-phase tensors are made and freed on the image lane, so the caching allocator never
hands the AR lane a block the image lane still reads. The two lanes' CUDA graphs replay from
memory pools of their own (engine/runtime/graphs.py).

The AR lane is a stream of the device's highest priority, the image lane one of its lowest (`step` runs an
engine step's work on the AR lane): where both have blocks waiting for an SM, the GPU's block scheduler starts
the decode step's first, so a decode kernel waits for the denoise kernel's running blocks, not for the ones
still queued behind them (a 1024x1024 DiT step's attention and GEMMs queue more blocks than the SMs hold).
The step is ordered after what the default stream queued before it, and the default stream's later work
after it.

Without CUDA (the CPU), or under the other policies, there is one lane: every call here does nothing, and
the scheduler runs the same code in the same order.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Lanes:
    def __init__(self, device: torch.device | None):
        """`device`: the CUDA device whose lanes to make; None (or a CPU device): one lane."""
        self.ar = self.side = None
        if device is not None and device.type == "cuda":
            least, greatest = torch.cuda.Stream.priority_range()
            self.ar = torch.cuda.Stream(device, priority=greatest)
            self.side = torch.cuda.Stream(device, priority=least)
            # a step's two waits, on events made once (an event recorded again is waited on as last recorded)
            self._entered, self._left = torch.cuda.Event(), torch.cuda.Event()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """An engine step's work on the AR lane, after what the default stream queued before it; the default
        stream's later work after it (no host wait)."""
        if self.ar is None:
            yield
            return
        default = torch.cuda.current_stream(self.ar.device)
        self._entered.record(default)
        self.ar.wait_event(self._entered)
        try:
            with torch.cuda.stream(self.ar):
                yield
        finally:
            self._left.record(self.ar)
            default.wait_event(self._left)

    @contextlib.contextmanager
    def image(self) -> Iterator[None]:
        """The block's work on the image lane, after what the current stream (the AR lane) queued before it."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            yield

    def fence(self) -> torch.cuda.Event | None:
        """Where the calling work runs on the image lane: an event recorded there now (the lane's work queued so
        far is done once it has passed); elsewhere None (nothing to wait for)."""
        if self.side is None or torch.cuda.current_stream(self.side.device) != self.side:
            return None
        done = torch.cuda.Event()
        done.record(self.side)
        return done

    def merge(self) -> None:
        """The current stream's later work waits for the image lane's queued work (no host wait)."""
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
