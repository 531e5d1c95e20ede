"""Driving the engine's pieces in tests: the backbone over a plain sequence, a request's text phase on its
own outside the scheduler (each `Decode` need answered by the test), and requests run together through
the scheduler as the worker runs them."""
from __future__ import annotations

import contextlib
from typing import Callable, Generator, Iterator

import torch

from engine.runtime.engine import Engine
from engine.runtime.graphs import Graphs
from engine.runtime.needs import Decode
from engine.runtime.options import EngineOptions
from engine.runtime.request import Request, prepare
from engine.runtime.scheduler import Scheduler, StepNews


@contextlib.contextmanager
def backbone_rows(lm, tokens: bool = False) -> Iterator[list]:
    """Inside the block, every forward of `lm`'s backbone appends its batch rows to the list yielded
    (with `tokens`: (rows, tokens))."""
    calls: list = []
    orig = lm.model.backbone

    def counting(x, *a, **k):
        calls.append(tuple(x.shape[:2]) if tokens else x.shape[0])
        return orig(x, *a, **k)

    lm.model.backbone = counting
    try:
        yield calls
    finally:
        del lm.model.backbone


def run_backbone(model, x: torch.Tensor, index: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor, cache,
                 kv_len: int, view, masked: bool = True) -> torch.Tensor:
    """The backbone over embeddings x of the tokens at sequence indices `index` of a sequence (its
    positions `pos` and blocks), attending to keys [0, kv_len) of `cache`."""
    return model.backbone(x, model.attn_batch(index, pos, blocks, kv_len, view, masked), cache, view)


def drive(program: Generator, answer: Callable[[Decode], int]) -> tuple[list, object]:
    """Run a text phase (generate_text) to its end: (its events, its TextResult)."""
    events, reply = [], None
    while True:
        try:
            item = program.send(reply)
        except StopIteration as stop:
            return events, stop.value
        if isinstance(item, Decode):
            reply = answer(item)
        else:
            events.append(item)
            reply = None


def make_engine(lm, graphs: Graphs | None = None, **options) -> Engine:
    """An engine of the loaded model on one rank, with these EngineOptions (`graphs`: its graph owner)."""
    return Engine(lm, options=EngineOptions(**options), graphs=graphs)


def run_together(lm, requests: list[dict], cancel_at: dict[int, int] | None = None, engine: Engine | None = None,
                 on_start: Callable[[Scheduler], None] = lambda s: None, **policy) -> tuple[dict[int, list], Scheduler]:
    """The requests joined at the first engine step (seq = their index), the engine's steps run until every
    one ended, as the worker runs them (on a fresh scheduler, `Engine.new_scheduler(**policy)`); `cancel_at`
    {seq: engine step before which it is cancelled}. Returns (events per seq, the scheduler)."""
    engine = engine or make_engine(lm, preview_every=0, max_batch=len(requests))
    scheduler = engine.scheduler = engine.new_scheduler(**policy)
    on_start(scheduler)
    news = StepNews(join=tuple((i, prepare(Request(**kw), lm, engine.adapters()))
                                  for i, kw in enumerate(requests)))
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    while True:
        engine.step(news)
        done, _ = scheduler.drain()
        for seq, ev in done:
            events[seq].append(ev)
        if not scheduler.busy:
            return events, scheduler
        news = StepNews(cancel=frozenset(s for s, at in (cancel_at or {}).items() if at == scheduler.steps))
