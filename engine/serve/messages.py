"""Every message on the pipes between the engine server and its worker processes, typed: the protocol can
be read here in one place, and a `match` over `ToWorker` or `FromWorker` that misses a kind is a type error
(its `case _:` calls `typing.assert_never`).

The server to rank 0, on the request pipe: `Run` a prepared request, `Cancel` one, `AdapterChange` (load or
unload a LoRA adapter between steps), `Stop`. Rank 0 to the server, on its event pipe: `Loading` progress,
then `Ready` (or `Failed`: the model cannot load); per request its events (`EventOut`), every rank's figures
after a step in which requests ended (`Stats`), then `End`. Any rank, on its own event pipe: `RankFailed`, a
request that failed on it (its collectives are then out of step with the other ranks', so it exits and the
server restarts the engine). Sequence numbers (`seq`) are the server's, never reused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.runtime.events import Event
from engine.runtime.request import Prepared


# ------------------------------------------------------------------ server -> rank 0
@dataclass(frozen=True)
class Run:
    seq: int
    prepared: Prepared


@dataclass(frozen=True)
class Cancel:
    seq: int


@dataclass(frozen=True)
class AdapterChange:
    op: Literal["load", "unload"]
    name: str
    folder: str | None = None          # load's PEFT folder (absolute)


@dataclass(frozen=True)
class Stop:
    """End the worker (also what a closed pipe reads as)."""


ToWorker = Run | Cancel | AdapterChange | Stop


# ------------------------------------------------------------------ workers -> server
@dataclass(frozen=True)
class Loading:
    done: int
    total: int
    what: str


@dataclass(frozen=True)
class Ready:
    info: dict[str, Any]               # load_s, device, dtype, plan, moe_kernels, mxfp8_kernels, kernels_text,
                                       # ranks (Stats'), warmup


@dataclass(frozen=True)
class Failed:
    message: str                       # why the model cannot load


@dataclass(frozen=True)
class EventOut:
    seq: int
    event: Event


@dataclass(frozen=True)
class Stats:
    ranks: list[dict[str, Any]]        # each rank's weights read, pointers unchanged, memory


@dataclass(frozen=True)
class End:
    seq: int


@dataclass(frozen=True)
class RankFailed:
    seq: int
    rank: int
    message: str


FromWorker = Loading | Ready | Failed | EventOut | Stats | End | RankFailed
