"""What a request's phase program asks of the scheduler.

A request's phases run as a generator (engine/runtime/pipeline.py, `Pipeline.program`): it runs its own
forwards inline (reference encoding, prefill, forced tokens, the hand-off, each denoise step, the VAE)
and yields events for its client, and one of these whenever it needs something shared with the other
requests. The scheduler (engine/runtime/scheduler.py) answers through `send`, when it is the request's
turn: that is where requests are batched and interleaved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from engine.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class ARSlot:
    """An AR slot of the KV pool for `length` positions; answered with the slot number."""
    length: int


@dataclass(frozen=True)
class Decode:
    """Feed `token` at sequence `index` of the request's AR slot `slot` and choose the next token with
    the request's own sampling parameters and generator (`allowed`: the only ids it may take, greedily);
    answered with that token, the same on every rank. One row of the engine's batched decode step."""
    slot: int
    token: int
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class DenoiseTurn:
    """The next denoise step (the first: the denoise rows of the KV pool, which one request holds at a
    time); answered with None when it is the request's turn. `key`: the request's denoise step key
    (engine/runtime/denoise.py `step_key`: bucket, token layout, rows), `step`: the step it asks for:
    requests of one key could share one forward (what the scheduler counts, `Scheduler.denoise_company`)."""
    key: tuple = ()
    step: int = 0


Need = Union[ARSlot, Decode, DenoiseTurn]
