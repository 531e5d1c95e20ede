"""The engine's scheduler on a real tiny checkpoint: requests admitted together run in one set of engine
steps, each giving what it gives alone; one decode forward per step serves every request in its decode
stage; a cancel or a failure ends one request and leaves its neighbours' results unchanged."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

import hunyuan_kernels as kernels
from engine.runtime.decode_step import DecodeStep
from engine.runtime.events import Done, Error, Image, Step, Text
from engine.runtime.graphs import Graphs
from engine.runtime.request import Request, prepare
from engine.runtime.scheduler import Scheduler, StepNews
from engine_drive import make_engine, run_together
from faults import fail_request

MIXED = [dict(prompt="a red circle", bot_task="think", size="256x256", max_new_tokens=10, steps=2, seed=11),
         dict(prompt="two blue squares", bot_task="think_recaption", max_new_tokens=14, steps=2, seed=12, greedy=True),
         dict(prompt="a green star", bot_task="image", steps=2, seed=13),               # reasoning off: the ratio pass
         dict(prompt="a yellow moon", bot_task="image", size="256x256", steps=2, seed=14)]   # no AR phase at all
TEXT = [dict(prompt=f"{what} on a white background", bot_task="think", max_new_tokens=12, text_only=True, seed=s)
        for s, what in enumerate(("a red circle", "two blue squares", "a green star", "a black cat"), start=21)]


def outcome(events: list) -> tuple[str, list[np.ndarray], list[Error]]:
    text = "".join(e.delta for e in events if isinstance(e, Text))
    images = [np.asarray(PILImage.open(io.BytesIO(e.png)), dtype=np.float64) for e in events if isinstance(e, Image)]
    return text, images, [e for e in events if isinstance(e, Error)]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def alone(lm, kw: dict) -> tuple:
    return outcome(list(make_engine(lm, preview_every=0).run(Request(**kw))))


class Recorder:
    """Counts the batched decode step's calls and forwards per engine step (a wrapper, not a hook)."""

    def __init__(self, monkeypatch):
        self.scheduler: Scheduler | None = None       # set as the run starts
        self.calls: list[tuple[int, int]] = []        # (engine step, rows) per call
        self.decoding: list[int] = []                 # requests in their decode stage at each call
        self.forwards: list[int] = []                 # engine step of each forward
        call, forward = DecodeStep.__call__, DecodeStep._forward

        def counted_call(step, rows):
            self.calls.append((self.scheduler.steps, len(rows)))
            self.decoding.append(self.scheduler.counts().get("decode", 0))
            return call(step, rows)

        def counted_forward(step, b):
            self.forwards.append(self.scheduler.steps)
            return forward(step, b)
        monkeypatch.setattr(DecodeStep, "__call__", counted_call)
        monkeypatch.setattr(DecodeStep, "_forward", counted_forward)


def test_four_requests_together_give_what_each_gives_alone(tiny):
    """Reasoning on: the same text (sampled and greedy), reasoning off and on: the same image (fp32, >= 40 dB).
    They ran together: one engine, interleaved steps, a batched decode."""
    events, scheduler = run_together(tiny, MIXED)
    for i, kw in enumerate(MIXED):
        want, got = alone(tiny, kw), outcome(events[i])
        assert not got[2] and isinstance(events[i][-1], Done), got[2]
        assert got[0] == want[0] and (got[0] or kw["bot_task"] == "image"), (i, got[0], want[0])
        assert len(got[1]) == len(want[1]) == 1 and psnr(got[1][0], want[1][0]) >= 40, i
    assert scheduler.steps < sum(len(e) for e in events.values())     # fewer steps than one after the other
    assert scheduler.pool.free == [0, 1, 2, 3]               # every AR slot went back


def test_one_decode_forward_per_step_and_a_cancel_ends_one_request(tiny, monkeypatch):
    """Every engine step with requests decoding runs ONE decode forward with all of them as rows; request 2,
    cancelled before step 4, ends there (nothing after its Error('cancelled')) and the others give what
    they give alone."""
    rec = Recorder(monkeypatch)
    events, scheduler = run_together(tiny, TEXT, cancel_at={2: 4}, on_start=lambda s: setattr(rec, "scheduler", s))
    per_step = {s: rows for s, rows in rec.calls}
    assert len(per_step) == len(rec.calls) == len(rec.forwards)                 # one call, one forward a step
    assert [rows for _, rows in rec.calls] == rec.decoding                      # every decoding request in it
    assert sorted(per_step) == list(range(len(per_step)))                       # every step until the last token
    assert per_step[0] == per_step[3] == 4 and per_step[4] == 3                 # all four, then without 2
    # the scheduler's own counts (bench serving's mean decode rows) agree with what the decode step saw
    assert scheduler.totals["decode_steps"] == len(rec.calls)
    assert scheduler.totals["decode_rows"] == sum(rows for _, rows in rec.calls)
    assert scheduler.totals["slots"] == 4 and scheduler.totals["joined"] == 4
    cancelled = events[2]
    assert isinstance(cancelled[-1], Error) and cancelled[-1].kind == "cancelled"
    # it stopped at step 4: at most the 5 tokens of steps 0-3 (the first came with its prefill), a prefix of its text
    text, full = outcome(cancelled)[0], alone(tiny, TEXT[2])[0]
    assert sum(isinstance(e, Text) for e in cancelled) <= 5 and len(text) < len(full) and full.startswith(text)
    for i in (0, 1, 3):
        got = outcome(events[i])
        assert not got[2] and got[0] == alone(tiny, TEXT[i])[0], i
    assert scheduler.pool.free == [0, 1, 2, 3]


def test_one_sampling_call_per_decode_step(tiny, monkeypatch):
    """The decode step samples all its rows in ONE `sample_rows` call (the batched variant on the CPU, no
    per-row `sample` call for these sampled rows), and the four seeded requests still give what each
    gives alone."""
    import engine.runtime.scheduler as scheduler_module
    from hunyuan_kernels import sampling
    rec = Recorder(monkeypatch)
    sampled, per_row = [], []
    real_rows, real_call = scheduler_module.choose_rows, sampling.call

    def counted_rows(logits, rows, *rest):
        sampled.append((rec.scheduler.steps, len(rows)))
        return real_rows(logits, rows, *rest)
    monkeypatch.setattr(scheduler_module, "choose_rows", counted_rows)
    monkeypatch.setattr(sampling, "call", lambda op, *a: per_row.append(op) or real_call(op, *a))
    events, _ = run_together(tiny, TEXT, on_start=lambda s: setattr(rec, "scheduler", s))
    assert sampled == rec.calls and len(sampled) > 4         # one call a decode step, every row in it
    assert kernels.chosen("sample_rows") == "batched" and per_row == []
    for i, kw in enumerate(TEXT):
        got = outcome(events[i])
        assert not got[2] and got[0] == alone(tiny, kw)[0], i


def test_a_failure_ends_only_its_own_request(tiny, monkeypatch):
    """One request fails in its AR phase (while the others decode), one in its denoise phase: each ends
    with its Error('engine'), its AR slot and denoise rows go back, the others finish unchanged, and the
    same engine then runs a new request."""
    reqs = [TEXT[0], dict(TEXT[1], prompt="this one fails while decoding"),
            dict(prompt="this one fails while denoising", bot_task="image", size="256x256", steps=3, seed=5), TEXT[3]]
    texts = [0]
    fail_request(monkeypatch, reqs[1]["prompt"], lambda ev: isinstance(ev, Text) and texts.append(1) is None
                 and len(texts) > 4, "injected fault while decoding")
    fail_request(monkeypatch, reqs[2]["prompt"], lambda ev: isinstance(ev, Step) and ev.i == 1,
                 "injected fault at denoise step 1")
    events, scheduler = run_together(tiny, reqs)
    for i, words in ((1, "injected fault while decoding"), (2, "injected fault at denoise step 1")):
        err = events[i][-1]
        assert isinstance(err, Error) and err.kind == "engine" and words in err.message, err
    for i in (0, 3):
        got = outcome(events[i])
        assert not got[2] and got[0] == alone(tiny, reqs[i])[0], i
    pool = scheduler.pool
    assert pool.free == [0, 1, 2, 3] and not scheduler.busy
    scheduler.step(StepNews(join=((9, prepare(Request(**TEXT[2]), tiny)),)))
    while scheduler.busy:
        scheduler.step()
    done, ended = scheduler.drain()
    assert ended == [9] and outcome([e for _, e in done])[0] == alone(tiny, TEXT[2])[0]


def test_policy_gives_the_denoising_request_a_turn_every_k_decode_steps(tiny, monkeypatch):
    """While requests decode, the request holding the denoise rows steps once every K engine steps."""
    reqs = [dict(prompt="a long story about a cat", bot_task="think", max_new_tokens=40, text_only=True, seed=1,
                 greedy=True),
            dict(prompt="a yellow moon", bot_task="image", size="256x256", steps=6, seed=14)]
    turns: list[int] = []
    pipe = make_engine(tiny, preview_every=0, max_batch=2)
    scheduler = pipe.new_scheduler(3)
    news = StepNews(join=tuple((i, prepare(Request(**kw), tiny)) for i, kw in enumerate(reqs)))
    while scheduler.busy or news.join:
        before = scheduler.counts().get("decode", 0)
        scheduler.step(news)
        news = StepNews()
        done, _ = scheduler.drain()
        if any(seq == 1 and isinstance(e, Step) for seq, e in done) and before:
            turns.append(scheduler.steps)
    assert len(turns) >= 3 and all(b - a == 3 for a, b in zip(turns, turns[1:])), turns


@pytest.mark.parametrize("k", [0])
def test_a_policy_of_zero_is_refused(tiny, k):
    with pytest.raises(ValueError, match="decode_steps_per_denoise"):
        make_engine(tiny, preview_every=0).new_scheduler(k)


class EagerGraphs(Graphs):
    """The graph owner's contract on the CPU: a key's forward is 'captured' at its first replay and THAT
    forward (closed over the first request's runner and the key's static buffers) is what every later
    replay of the key runs, into the first output, as a CUDA graph replays its recorded kernels. So a
    later request of the key gives its own image only if everything it varies reaches the key's buffers."""

    def capturable(self, model) -> bool:
        return True

    def _capture(self, key, forward, warmup, shared):
        self.captures[key] += 1
        out = forward()

        class Replay:
            @staticmethod
            def replay():
                for o, new in zip(out if isinstance(out, tuple) else (out,), forward() if isinstance(out, tuple)
                                  else (forward(),)):
                    o.copy_(new)
        return Replay(), out


SAME_LAYOUT = [dict(prompt="a red circle", bot_task="image", size="256x256", steps=2, seed=31),
               dict(prompt="a blue circle", bot_task="image", size="256x256", steps=3, seed=32, guidance=3.0)]


def test_denoise_step_graph_captured_once_per_step_key(tiny):
    """The denoise step's graph is keyed by what it depends on (bucket, token layout, rows, CFG), not by
    request: a second request of a key captures nothing and replays the first one's step over its own
    latent, times and tables, giving the image it gives alone; another bucket is its own key; the keys
    outlive their requests. With CFG both branches are the key's rows."""
    graphs = EagerGraphs()
    pipe = make_engine(tiny, preview_every=0, graphs=graphs)
    other = dict(SAME_LAYOUT[0], size="256x512", seed=33)
    for n, kw in enumerate([*SAME_LAYOUT, other, SAME_LAYOUT[0]]):
        got = outcome(list(pipe.run(Request(**kw))))
        want = alone(tiny, kw)
        assert not got[2] and len(got[1]) == 1 and psnr(got[1][0], want[1][0]) >= 40, n
        keys = [k for k in graphs.captures if k[0] == "denoise"]
        assert len(keys) == (1 if n < 2 else 2) and set(graphs.captures.values()) == {1}, (n, graphs.captures)
        assert all(k in graphs for k in keys)          # kept after their request ended
    first = keys[0]
    assert first[4:6] == (1, (0, 1)), first          # one image, both CFG branches in the step


def test_an_engine_refusal_names_its_field(tiny):
    """A request refused once the engine tokenizes it says which Request field is at fault (the API
    and the page put it on their own field without reading the message)."""
    long = " ".join(f"word{i} x{i % 97}" for i in range(800))[:7999]       # within the character limit
    err = list(make_engine(tiny, preview_every=0).run(Request(prompt=long, bot_task="image", size="256x256")))[-1]
    assert isinstance(err, Error) and err.kind == "invalid" and "positions" in err.message, err
    assert err.param == "prompt"
    err = list(make_engine(tiny, preview_every=0).run(Request(prompt="x", steps=0)))[-1]
    assert isinstance(err, Error) and err.param == "steps", err


def test_the_scheduler_counts_denoise_turns_that_could_share_a_forward(tiny):
    """The measurement before denoise batching: at each denoise turn, the other requests waiting for a
    step of the same step key (same bucket and token layout) are counted; another bucket is not."""
    reqs = [*SAME_LAYOUT, dict(SAME_LAYOUT[0], size="256x512", seed=34)]     # 2, 3 and 2 steps
    events, scheduler = run_together(tiny, reqs)
    assert all(isinstance(e[-1], Done) for e in events.values())
    # request 0 steps twice while 1 (same key, at its step 0) and 2 (another bucket) wait; then 1, then 2
    assert dict(scheduler.denoise_company) == {"turns": 7, "same_key": 2, "same_step": 1}


def test_a_cancel_ends_a_denoising_request_at_its_next_step(tiny):
    """Request 0 holds the denoise rows (3 steps; nothing decodes: its hand-off in engine step 0, then one
    step per engine step); cancelled before engine step 2, it ends after its first step; request 1, waiting
    for the rows, then runs and gives the image it gives alone."""
    reqs = [dict(SAME_LAYOUT[1], seed=41), SAME_LAYOUT[0]]
    events, scheduler = run_together(tiny, reqs, cancel_at={0: 2})
    cancelled = events[0]
    assert isinstance(cancelled[-1], Error) and cancelled[-1].kind == "cancelled"
    assert [e.i for e in cancelled if isinstance(e, Step)] == [1] and not any(isinstance(e, Image) for e in cancelled)
    got, want = outcome(events[1]), alone(tiny, reqs[1])
    assert not got[2] and psnr(got[1][0], want[1][0]) >= 40
    assert not scheduler.busy
