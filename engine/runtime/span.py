"""How long a stretch of a request's device work took, measured without the host waiting for it.

A request's phases time their work for its `Timings` (the image prefix's prefill, the denoise steps, the VAE
decode). Waiting for the device to finish (a device-wide synchronize) to read a wall clock would stop the
engine's loop for the whole stretch, and with it the work of every other request: the decode steps the
overlap policy runs beside a denoise step, the decode step launched ahead. On a GPU a span is a pair of
CUDA events on the current stream, read where the request's Done is read (events.Done.later: the worker's
sender thread, after the image's pixels are on the host); on a CPU, where a forward has finished when it
returns, it is the wall clock.
"""
from __future__ import annotations

import time

import torch


class Span:
    def __init__(self, dev: torch.device):
        """Starts now: at this point of the current stream's work (a GPU), or of the wall clock (a CPU)."""
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if dev.type == "cuda" else None
        self._t = [time.perf_counter(), None]
        if self._events is not None:
            self._events[0].record()

    def stop(self) -> "Span":
        """Ends at this point of the current stream's work (the wall clock's now on a CPU)."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._t[1] = time.perf_counter()
        return self

    def ms(self) -> float:
        """Its milliseconds (on a GPU this waits for the work up to its end, done already when it is read
        after a host read of later work on the same stream)."""
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1])
        return (self._t[1] - self._t[0]) * 1e3
