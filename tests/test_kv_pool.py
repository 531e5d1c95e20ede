"""The pipeline's KV pool: one cache allocation, one AR prefill step and one AR decode step (on CUDA:
their captured graphs) serve every request that fits, and a request on a reused pool gives what it gives on a fresh pipeline."""
from __future__ import annotations

from engine.runtime.events import Error, Image, Text
from engine.runtime.pipeline import Pipeline
from engine.runtime.request import Request

A = dict(prompt="three small blue triangles across the top, with a long description to take many positions",
         bot_task="think_recaption", max_new_tokens=24, steps=3, seed=7)
B = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=16, steps=3, seed=3)


def _run(p: Pipeline, kw: dict):
    ev = list(p.run(Request(**kw)))
    assert not [e for e in ev if isinstance(e, Error)], ev
    return "".join(e.delta for e in ev if isinstance(e, Text)), next(e for e in ev if isinstance(e, Image)).png


def test_a_reused_pool_gives_a_fresh_pipelines_result(tiny):
    reused = Pipeline(tiny, preview_every=0)
    _run(reused, A)
    pool = reused._kv
    steps = list(pool.steps.values())
    got = _run(reused, B)                       # B runs over what A left in the cache
    assert got == _run(Pipeline(tiny, preview_every=0), B)
    assert pool is reused._kv and pool.allocations == 1
    assert list(pool.steps.values()) == steps and len(steps) == 2   # the same prefill and decode steps (graphs)


def test_the_pool_grows_for_a_longer_request(tiny):
    p = Pipeline(tiny, preview_every=0)
    _run(p, B)
    rows, length = p._kv.rows, p._kv.length
    longer = dict(B, max_new_tokens=length)      # more positions than the pool holds
    out = _run(p, longer)
    assert p._kv.length > length and p._kv.rows == rows and p._kv.allocations == 2
    assert out == _run(Pipeline(tiny, preview_every=0), longer)
