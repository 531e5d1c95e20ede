"""The decode step launched ahead (scheduler `lookahead`, on by default on a GPU): each decode step launches
the next before its tokens reach the host, and the next step uses that forward only when exactly the same
requests went on with their tokens. On the CPU (where it is off by default) it runs the same code: every
request gives exactly what it gives without it, through ends, joins, forced tokens, cancels and a failed
launch."""
from __future__ import annotations

import numpy as np

from engine.runtime.decode_step import DecodeStep
from engine.runtime.events import Done, Error, Text
from engine_drive import make_engine, run_together
from test_scheduler import MIXED, TEXT, outcome

# sampled and greedy, a think_recaption whose `</think>` forces `<recaption>` (a forward of its own), the
# one-step ratio pass, a request without an AR phase, and a longer text that decodes alone at the end
REQUESTS = MIXED + [dict(TEXT[0], max_new_tokens=24)]


def run(lm, requests: list[dict], lookahead: bool, **kw) -> tuple[dict, object]:
    engine = make_engine(lm, preview_every=0, max_batch=len(requests), decode_lookahead=lookahead)
    return run_together(lm, requests, engine=engine, **kw)


def same(a: list, b: list) -> None:
    (ta, ia, ea), (tb, ib, eb) = outcome(a), outcome(b)
    assert ta == tb and len(ia) == len(ib) and [e.kind for e in ea] == [e.kind for e in eb]
    assert all(np.array_equal(x, y) for x, y in zip(ia, ib))     # the same bits: the same forwards ran


class Counts:
    """The batched decode step's own forwards (`__call__`) and the ones launched ahead, per engine step."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.own, self.ahead = 0, 0
        call, ahead = DecodeStep.__call__, DecodeStep.ahead

        def counted_call(step, rows):
            self.own += 1
            return call(step, rows)

        def counted_ahead(step, rows, tokens):
            self.ahead += 1
            if self.ahead == fail_at:
                raise RuntimeError("injected fault in the step launched ahead")
            return ahead(step, rows, tokens)
        monkeypatch.setattr(DecodeStep, "__call__", counted_call)
        monkeypatch.setattr(DecodeStep, "ahead", counted_ahead)


def test_lookahead_gives_exactly_what_the_plain_step_gives(tiny, monkeypatch):
    """Every request's text and image are the same bits with and without the step launched ahead, and
    only the steps where the requests decoding changed ran their own forward."""
    plain, s0 = run(tiny, REQUESTS, lookahead=False)
    counts = Counts(monkeypatch)
    events, s1 = run(tiny, REQUESTS, lookahead=True)
    for i in range(len(REQUESTS)):
        assert isinstance(events[i][-1], Done), events[i][-1]
        same(events[i], plain[i])
    steps = s1.totals["decode_steps"]
    assert steps == s0.totals["decode_steps"] and s1.totals["decode_rows"] == s0.totals["decode_rows"]
    assert counts.ahead == steps                     # every decode step launched the next one
    # its own forward only where a request joined, ended or fed forced tokens (a handful), not every step
    assert 1 <= counts.own <= 8 < steps, (counts.own, steps)
    assert s1.pool.free == list(range(len(REQUESTS)))


def test_a_cancel_and_a_failed_launch_change_nothing_else(tiny, monkeypatch):
    """Request 2 cancelled mid-decode ends there; the third launch ahead fails (the next step runs its own
    forward); the other requests give exactly what they give without lookahead."""
    plain, _ = run(tiny, TEXT, lookahead=False, cancel_at={2: 4})
    counts = Counts(monkeypatch, fail_at=3)
    events, scheduler = run(tiny, TEXT, lookahead=True, cancel_at={2: 4})
    assert isinstance(events[2][-1], Error) and events[2][-1].kind == "cancelled"
    same(events[2], plain[2])
    for i in (0, 1, 3):
        assert isinstance(events[i][-1], Done)
        same(events[i], plain[i])
    assert counts.ahead == scheduler.totals["decode_steps"] and counts.own >= 3
    assert scheduler.pool.free == [0, 1, 2, 3]


def test_lookahead_is_on_by_default_on_a_gpu_only(tiny):
    assert not make_engine(tiny, preview_every=0).new_scheduler().lookahead          # the CPU: nothing to hide
    assert make_engine(tiny, preview_every=0, decode_lookahead=True).new_scheduler().lookahead


def test_a_request_that_fed_forced_tokens_gets_its_own_forward(tiny, monkeypatch):
    """Two reasoning requests decode side by side; at the third decode step one chooses `</think>`, which
    forces `<recaption>` (fed in a forward of its own): the requests decoding are the same two, but that one
    is now two positions on, so the step launched ahead is not used, and both give exactly what they give
    without lookahead."""
    import engine.runtime.scheduler as scheduler_module
    real = scheduler_module.choose_rows
    end_think = tiny.tok.special.end_think

    def choose_rows(logits, rows, *rest):
        tokens = real(logits, rows, *rest)
        calls.append(len(rows))
        if len(calls) == 3:
            tokens[0] = end_think
        return tokens
    monkeypatch.setattr(scheduler_module, "choose_rows", choose_rows)
    reqs = [dict(prompt=p, bot_task="think_recaption", max_new_tokens=12, text_only=True, seed=s)
            for s, p in ((31, "a red circle"), (32, "two blue squares"))]
    calls: list[int] = []
    plain, _ = run(tiny, reqs, lookahead=False)
    calls.clear()
    counts = Counts(monkeypatch)
    events, scheduler = run(tiny, reqs, lookahead=True)
    assert calls[:4] == [2, 2, 2, 2]                  # both decoding before and after the forced tokens
    assert any(getattr(e, "section", "") == "recaption" for e in events[0])      # the transition happened
    for i in range(2):
        same(events[i], plain[i])
    # its own forward at the first decode step, the one after the forced feed and the one after the first end
    assert counts.own == 3


def test_an_adapter_change_drops_the_step_launched_ahead(tiny, monkeypatch, capsys):
    """The step launched ahead read the LoRA tables as they were: after a step boundary that changes them
    (here an unload the engine refuses, which still counts as a change) the next step runs its own forward."""
    from engine.runtime.request import Request, prepare
    from engine.runtime.scheduler import StepNews

    def own_forwards(change_at: int | None) -> tuple[int, list]:
        counts = Counts(monkeypatch)
        engine = make_engine(tiny, preview_every=0, max_batch=2, decode_lookahead=True)
        scheduler = engine.scheduler = engine.new_scheduler()
        news = StepNews(join=tuple((i, prepare(Request(**kw), tiny)) for i, kw in enumerate(TEXT[:2])))
        events: list = []
        while news.join or scheduler.busy:
            engine.step(news)
            events += scheduler.drain()[0]
            news = StepNews(adapters=(("unload", "none-such", None),)) if scheduler.steps == change_at else StepNews()
        return counts.own, events
    plain, plain_events = own_forwards(None)
    changed, events = own_forwards(3)
    texts = [[(seq, e.delta) for seq, e in evs if isinstance(e, Text)] for evs in (events, plain_events)]
    assert changed == plain + 1 and texts[0] == texts[1] and texts[0]
    assert "none-such" in capsys.readouterr().err
