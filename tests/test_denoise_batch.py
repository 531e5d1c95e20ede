"""Denoise steps batched across requests (engine/runtime/denoise_batch.py) on the tiny checkpoint, fp32:
requests of one resolution bucket, whatever their prompt lengths, share one step key (one graph), and up
to `max_denoise_batch` of them one forward a step, each giving the image it gives alone; other buckets
run apart; a cancel or a failure of one leaves the others' images unchanged."""
from __future__ import annotations

import io

import numpy as np
from PIL import Image as PILImage

from engine.runtime.denoise import DenoiseRunner, TAIL_GRAIN
from engine.runtime.denoise_batch import DenoiseBatch
from engine.runtime.events import Done, Error, Image, Step
from engine.runtime.request import Request
from engine_drive import backbone_rows, make_engine, run_together
from faults import fail_request
from test_scheduler import EagerGraphs

SIDE = dict(size="256x256", bot_task="image", guidance=4.0)          # CFG: two rows a request
SAME = [dict(SIDE, prompt="a red circle", steps=2, seed=51),
        dict(SIDE, prompt="three small blue squares in a row on a wooden table", steps=3, seed=52),
        dict(SIDE, prompt="a green star", steps=2, seed=53, guidance=2.5)]
TAIL = 16 * 16 + 1          # a 256x256 step's tokens on the tiny model: <timestep> + 16x16 latent tokens
_alone: dict = {}


def image(events: list) -> np.ndarray:
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors and isinstance(events[-1], Done), errors
    png = next(e for e in events if isinstance(e, Image)).png
    return np.asarray(PILImage.open(io.BytesIO(png)), dtype=np.float64)


def alone(lm, kw: dict) -> np.ndarray:
    """The image the request gives on its own engine (cached: several tests compare with it)."""
    key = tuple(sorted(kw.items()))
    if key not in _alone:
        _alone[key] = image(list(make_engine(lm, preview_every=0).run(Request(**kw))))
    return _alone[key]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def test_prompt_lengths_share_one_step_key(tiny, monkeypatch):
    """Two requests of one bucket whose prefixes differ in length: one step key, captured once (the
    second replays the first one's step over its own latent, positions and key mask), each its own image."""
    starts = []
    prefill = DenoiseRunner.prefill
    monkeypatch.setattr(DenoiseRunner, "prefill", lambda self: (starts.append(self.span.meta_start), prefill(self))[1])
    graphs = EagerGraphs()
    pipe = make_engine(tiny, preview_every=0, graphs=graphs)
    for kw in SAME[:2]:
        assert psnr(image(list(pipe.run(Request(**kw)))), alone(tiny, kw)) >= 40, kw
    assert len(set(starts)) == 2 and len({s // TAIL_GRAIN for s in starts}) == 1, starts    # (solo runs too)
    keys = [k for k in graphs.captures if k[0] == "denoise"]
    assert len(keys) == 1 and graphs.captures[keys[0]] == 1, graphs.captures


def test_requests_of_one_bucket_share_each_step_forward(tiny):
    """Three requests (steps 2, 3, 2; other guidance, other prompts), max_denoise_batch 3: each joins in a turn
    of its own (its hand-off and prefill), between the batch's forwards, and then shares them: 0 alone, 0 and
    1, then 1 and 2 (0 has ended) for the last two; each gives its solo image."""
    pipe = make_engine(tiny, preview_every=0, max_batch=3, max_denoise_batch=3)
    with backbone_rows(tiny, tokens=True) as calls:
        events, scheduler = run_together(tiny, SAME, engine=pipe)
    for i, kw in enumerate(SAME):
        assert psnr(image(events[i]), alone(tiny, kw)) >= 40, i
    steps = [rows for rows, tokens in calls if tokens == TAIL]
    assert steps == [2, 4, 4, 4], calls
    assert scheduler.denoising.forwards == 4 and not scheduler.denoising.members


LIGHTHOUSE = " ".join(["a tall red lighthouse on a rocky shore"] * 24)     # a prefix of ~630 tokens
ANY_LENGTH = [dict(SIDE, prompt=LIGHTHOUSE, steps=3, seed=72),                # its step tokens at 1024
              dict(SIDE, prompt="a red circle", steps=2, seed=71),           # at 512
              dict(prompt="two blue squares", bot_task="think_recaption", size="256x256", max_new_tokens=12,
                   greedy=True, steps=2, seed=73, guidance=4.0)]              # its CoT in its prefix, at 512


def test_prefixes_of_any_length_share_a_forward(tiny, monkeypatch):
    """Three requests of one bucket whose prefixes (prompt, or prompt + CoT) put their step tokens at different
    tails (1024, 512, 512) share forwards: the batch runs at its largest tail, each member's key mask hiding
    the gap after its own prefix. Graphs (EagerGraphs: the static buffers carry everything a member varies):
    one per (tail, members), each captured once; the last one, alone again, replays its own tail's. Each
    image equals its solo image (fp32; measured 88.8-91.5 dB here, the PNG's rounding of float noise)."""
    forwards = []            # the members' own tails, per forward of the batch
    velocities = DenoiseBatch.velocities
    monkeypatch.setattr(DenoiseBatch, "velocities",
                        lambda self, jobs: (forwards.append([j.runner.tail for j in jobs]), velocities(self, jobs))[1])
    graphs = EagerGraphs()
    pipe = make_engine(tiny, preview_every=0, max_batch=3, max_denoise_batch=3, graphs=graphs)
    events, _ = run_together(tiny, ANY_LENGTH, engine=pipe)
    # 0 alone, 0 and 1, all three, then the CoT request alone (each joined in a turn of its own)
    assert forwards == [[1024], [1024, 512], [1024, 512, 512], [512]], forwards
    for i, kw in enumerate(ANY_LENGTH):
        assert psnr(image(events[i]), alone(tiny, kw)) >= 60, i
    keys = {k[3:4] + k[7:]: n for k, n in graphs.captures.items() if k[0] == "denoise"}    # (tail, batch)
    assert keys == {(1024,): 1, (1024, ("batch", 2)): 1, (1024, ("batch", 3)): 1, (512,): 1}, graphs.captures


def test_other_buckets_run_apart(tiny):
    """Two requests of 256x256 and two of 256x512, max_denoise_batch 4: the first two share a forward, then
    the other two one of theirs; no forward mixes buckets (a 256x512 waits until the 256x256 batch is empty)."""
    wide = [dict(kw, size="256x512") for kw in SAME[:2]]
    reqs = [SAME[0], SAME[2], *wide]
    pipe = make_engine(tiny, preview_every=0, max_batch=4, max_denoise_batch=4)
    with backbone_rows(tiny, tokens=True) as calls:
        events, _ = run_together(tiny, reqs, engine=pipe)
    for i, kw in enumerate(reqs):
        assert psnr(image(events[i]), alone(tiny, kw)) >= 40, i
    steps = [c for c in calls if c[0] > 1]           # (a request's prefill is one row)
    assert [rows for rows, _ in steps] == [2, 4, 2, 2, 4, 2, 2], calls
    assert [t for _, t in steps[:3]] == [TAIL] * 3 and {t for _, t in steps[3:]} - {TAIL} == {steps[3][1]}, calls


def test_a_cancel_and_a_failure_end_only_their_own_request(tiny, monkeypatch):
    """Four requests of one batch (each joins in a turn of its own, between the batch's forwards): request 0
    cancelled after its second step (shared with 1), request 2 failing at its second (shared with 1 and 3);
    the others (1 moved down into the rows 0 left) give their solo images."""
    reqs = [dict(SAME[1], seed=61), SAME[1], dict(SAME[1], prompt="a yellow moon"), SAME[2]]
    fail_request(monkeypatch, "a yellow moon", lambda e: isinstance(e, Step) and e.i == 2, "injected")
    pipe = make_engine(tiny, preview_every=0, max_batch=4, max_denoise_batch=4)
    with backbone_rows(tiny, tokens=True) as calls:
        events, scheduler = run_together(tiny, reqs, cancel_at={0: 4}, engine=pipe)
    assert isinstance(events[0][-1], Error) and events[0][-1].kind == "cancelled"
    assert [e.i for e in events[0] if isinstance(e, Step)] == [1, 2]
    assert isinstance(events[2][-1], Error) and events[2][-1].kind == "engine" and "injected" in events[2][-1].message
    assert [e.i for e in events[2] if isinstance(e, Step)] == [1]
    for i in (1, 3):
        assert psnr(image(events[i]), alone(tiny, reqs[i])) >= 40, i
    # 0; 0 and 1; (0 cancelled) 1 and 2; 1, 2 and 3 (1 ends, 2 fails); 3
    assert [rows for rows, tokens in calls if tokens == TAIL] == [2, 4, 4, 6, 2], calls
    assert not scheduler.busy and not scheduler.denoising.members


def test_the_server_runs_with_max_denoise_batch(tiny_dir, tiny):
    """EngineServer(max_denoise_batch=2) hands the setting to its worker's engine (EngineConfig): two
    requests submitted together each give their solo image."""
    from engine.serve.engine_config import EngineConfig
    from engine.serve.server import EngineServer
    with EngineServer(EngineConfig(tiny_dir, max_batch=2, max_denoise_batch=2, preview_every=0)) as server:
        assert server.wait_ready(300), server.health()
        assert server.config.max_denoise_batch == 2
        subs = [server.submit(Request(**kw)) for kw in SAME[:2]]
        for kw, sub in zip(SAME[:2], subs):
            assert psnr(image(list(sub)), alone(tiny, kw)) >= 40, kw


def test_a_member_that_takes_the_place_of_another_gets_its_own_tables(tiny):
    """max_denoise_batch 2, three requests of one bucket: the first two share a step; when the first ends,
    the second moves down and the third joins, and the 2-request buffers serve another pair: the members' step
    tables (positions, masks) are written again for them (they are written only when the members change)."""
    reqs = [SAME[0], SAME[1], dict(SAME[2], prompt="a green star above a small blue house")]
    pipe = make_engine(tiny, preview_every=0, max_batch=3, max_denoise_batch=2)
    with backbone_rows(tiny, tokens=True) as calls:
        events, _ = run_together(tiny, reqs, engine=pipe)
    assert [rows for rows, tokens in calls if tokens == TAIL] == [2, 4, 4, 4], calls
    for i, kw in enumerate(reqs):
        assert psnr(image(events[i]), alone(tiny, kw)) >= 40, i
