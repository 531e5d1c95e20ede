"""What a request's phase program asks of the scheduler.

A request's phases run as a generator (engine/runtime/program.py): it runs its own
forwards inline (reference encoding, prefill, forced tokens, the hand-off, each denoise step, the VAE)
and yields events for its client, and one of these whenever it needs something shared with the other
requests, or before heavy work of its own that others would otherwise wait behind (the hand-off and its
image prefix's prefill, the VAE decode: a turn of its own, never inside another request's denoise turn).
The scheduler (engine/runtime/scheduler.py) answers through `send`, when it is the request's turn: that
is where requests are batched and interleaved.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from engine.runtime.denoise import StepInput
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
class DenoiseRows:
    """Denoise rows of the KV pool: `rows` rows of `length` positions, answered with the first of them
    once the request joins the denoise batch (engine/runtime/denoise_batch.py: requests of one step class
    at a time; `alone`: it never shares a forward), in a turn of its own: the request then hands its AR
    cache off and prefills its image prefix before it asks for its first step. `key`: the request's denoise
    step class (engine/runtime/denoise.py `step_class`: bucket and rows, not the prefix length); the
    scheduler also counts the requests of one class waiting while others step (`Scheduler.denoise_company`)."""
    key: tuple
    rows: int
    length: int
    alone: bool = False


@dataclass(frozen=True)
class DenoiseStep:
    """Denoise step `step` of a request holding its rows, with the inputs `job`; answered with its
    velocity, computed in one forward with the denoise batch's other requests (`key`: its step class)."""
    key: tuple
    step: int
    job: StepInput


@dataclass(frozen=True)
class ImageDecode:
    """The request's denoise is done (its rows go back: it leaves the denoise batch) and its `images`
    latents are to be decoded by the VAE, in a turn of its own; answered with None. Every rank asks for it
    (the scheduler's decisions are every rank's); the leader decodes."""
    images: int


Need = Union[ARSlot, Decode, DenoiseRows, DenoiseStep, ImageDecode]
