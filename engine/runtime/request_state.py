"""A request admitted to the engine: its prepared request, its running phase program, what it waits for.

The program (engine/runtime/program.py) is a chain of generators whose frames hold the rest
of the request's state: its sequences, its RNG generators (text and noise, seeded from the request),
its AR slot and denoise rows of the KV pool. Closing it (a cancel) runs its `finally`, which gives them
back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

from engine.runtime.events import Event
from engine.runtime.needs import ARSlot, Decode, DenoiseRows, DenoiseStep, ImageDecode, Need
from engine.runtime.request import Prepared

Program = Generator["Event | Need", Any, None]     # a request's phase program: its events and needs


@dataclass
class RequestState:
    seq: int                                  # the engine's number for it (never reused)
    prepared: Prepared
    program: Program
    need: Need | None = None                  # what its program waits for; None once it ended
    asked: int = 0                            # when it asked for `need` (the scheduler's count of needs)
    cancelled: bool = False

    @property
    def stage(self) -> str:
        """prefill (waiting for an AR slot), decode, handoff (AR done, waiting for the denoise rows and
        its hand-off), denoise, vae (waiting for its VAE decode), or done."""
        if isinstance(self.need, ARSlot):
            return "prefill"
        if isinstance(self.need, Decode):
            return "decode"
        if isinstance(self.need, DenoiseRows):
            return "handoff"
        if isinstance(self.need, DenoiseStep):
            return "denoise"
        if isinstance(self.need, ImageDecode):
            return "vae"
        return "done"
