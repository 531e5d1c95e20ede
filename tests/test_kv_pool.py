"""The engine's KV pool: one allocation of AR slots and one of denoise rows, one AR prefill step and one
batched AR decode step (on CUDA: their captured graphs) serve every request that fits, and a request on a
reused pool gives what it gives on a fresh engine."""
from __future__ import annotations

from engine.runtime.engine import Engine
from engine.runtime.events import Error, Image, Text
from engine.runtime.request import Request
from engine_drive import make_engine

A = dict(prompt="three small blue triangles across the top, with a long description to take many positions",
         bot_task="think_recaption", max_new_tokens=24, steps=3, seed=7)
B = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=16, steps=3, seed=3)


def _run(p: Engine, kw: dict):
    ev = list(p.run(Request(**kw)))
    assert not [e for e in ev if isinstance(e, Error)], ev
    return "".join(e.delta for e in ev if isinstance(e, Text)), next(e for e in ev if isinstance(e, Image)).png


def test_a_reused_pool_gives_a_fresh_pipelines_result(tiny):
    reused = make_engine(tiny, preview_every=0)
    _run(reused, A)
    pool = reused.pool
    steps = (pool.decode, pool.prefill)
    got = _run(reused, B)                       # B runs over what A left in the caches
    assert got == _run(make_engine(tiny, preview_every=0), B)
    assert pool is reused.pool and pool.allocations == 2          # the AR slots and the denoise rows, once
    assert (pool.decode, pool.prefill) == steps                   # the same prefill and decode steps (graphs)
    assert pool.free == [0]                                       # the slot went back


def test_the_pool_grows_for_a_longer_request(tiny):
    p = make_engine(tiny, preview_every=0)
    _run(p, B)
    length, allocations = p.pool.ar_length, p.pool.allocations
    longer = dict(B, max_new_tokens=length)      # more positions than the AR slots hold
    out = _run(p, longer)
    assert p.pool.ar_length > length and p.pool.allocations > allocations
    assert out == _run(make_engine(tiny, preview_every=0), longer)


def test_a_longer_request_waits_until_every_slot_is_free(tiny):
    """The AR storage grows only while nobody holds a slot (its rows are other requests' caches)."""
    pool = make_engine(tiny, preview_every=0, max_batch=2).pool
    a = pool.take_slot(100)
    length = pool.ar_length
    assert a == 0 and pool.take_slot(length) == 1
    pool.release_slot(1)
    assert pool.take_slot(length + 1) is None and pool.allocations == 1     # slot 0 is still held
    pool.release_slot(a)
    assert pool.take_slot(length + 1) == 0 and pool.ar_length > length and pool.allocations == 2


def test_a_slot_given_back_on_the_image_lane_is_free_once_its_event_has_passed(tiny):
    """Overlap (engine/runtime/lanes.py): a hand-off gives its AR slot back on the image lane, where its read of
    the slot may still be queued; the slot is taken again only once the event recorded there has passed (a
    query, no wait), and the AR storage does not grow while a slot drains."""
    class Done:                               # a CUDA event as the pool uses one: recorded, then queried
        def __init__(self):
            self.passed = False

        def query(self):
            return self.passed

    pool = make_engine(tiny, preview_every=0, max_batch=2).pool
    events = []
    pool.fence = lambda: events.append(Done()) or events[-1]
    a, b = pool.take_slot(100), pool.take_slot(100)
    pool.release_slot(a)                      # on the image lane: drains
    assert pool.take_slot(100) is None and pool.free == [] and len(pool.draining) == 1
    events[0].passed = True
    assert pool.take_slot(100) == a and not pool.draining
    length = pool.ar_length
    pool.release_slot(a)
    pool.release_slot(b)
    events[2].passed = True                   # b has drained, a has not: no growth yet
    assert pool.take_slot(length + 1) is None and pool.allocations == 1 and pool.free == [b]
    events[1].passed = True
    assert pool.take_slot(length + 1) == 0 and pool.ar_length > length
    pool.fence = None                         # one lane (the CPU, the other policies): free at once
    pool.release_slot(0)
    assert pool.free == [0, 1]


def test_each_scheduler_steps_the_pool_with_its_own_fence(tiny):
    """The server's scheduler (overlap on one GPU) and a request run on its own (`run_prepared`: the warm-up, the
    CLI; interleave) share the engine's pool: whichever steps, the pool gives slots back by its lanes, so a
    scheduler made later cannot leave the overlap one freeing slots its image lane still reads."""
    engine = make_engine(tiny, preview_every=0, max_batch=2)
    overlap = engine.new_scheduler(policy="overlap")

    def fence():
        return None
    overlap.lanes.side, overlap.lanes.fence = object(), fence     # as on a GPU (no image work in these steps)
    overlap.step()
    assert engine.pool.fence is fence
    _run(engine, B)                                               # run_prepared: a scheduler of its own, interleave
    assert engine.pool.fence is None and engine.pool.free == [0, 1]
    overlap.step()
    assert engine.pool.fence is fence
