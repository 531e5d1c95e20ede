"""The scheduler's turns and step policies (engine/runtime/scheduler.py, issue 42 items 2 and 3): a request's
hand-off and image-prefix prefill, and its VAE decode, are turns of their own, never inside the denoise turn
of a step others wait on; each step policy (interleave, waves, overlap) gives every request what it gives
alone. An instrumented log of what each engine step ran (the decode forward, the denoise batch's forward, a
hand-off, a prefix prefill, a VAE decode) over a mixed workload, on the tiny checkpoint (fp32)."""
from __future__ import annotations

import collections
import dataclasses

import pytest

from engine.model.hunyuan import HunyuanImage3
from engine.runtime.decode_step import DecodeStep
from engine.runtime.denoise import DenoiseRunner
from engine.runtime.denoise_batch import DenoiseBatch
from engine.runtime.events import Denoising, Done, Error, Started
from engine.runtime.kv_pool import KVPool
from engine_drive import make_engine, run_together
from test_scheduler import MIXED, alone, outcome, psnr

HEAVY = {"denoise", "handoff", "prefill", "vae"}


def step_log(monkeypatch, scheduler_of) -> collections.defaultdict:
    """{engine step: [what it ran, in order]}: the methods that do the work, wrapped (the scheduler's own
    counts are not what is checked)."""
    log: collections.defaultdict = collections.defaultdict(list)
    for cls, name, kind in ((DecodeStep, "__call__", "decode"), (DenoiseBatch, "velocities", "denoise"),
                            (KVPool, "prefill_into", "ar_prefill"), (KVPool, "hand_off", "handoff"),
                            (DenoiseRunner, "prefill", "prefill"),
                            (HunyuanImage3, "decode_image", "vae")):
        def wrapped(self, *a, _orig=getattr(cls, name), _kind=kind, **k):
            if scheduler_of() is not None:
                log[scheduler_of().steps].append(_kind)
            return _orig(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapped)
    return log


def test_no_hand_off_or_vae_inside_a_denoise_turn(tiny, monkeypatch):
    """Four requests (reasoning, reasoning + recaption, the ratio pass, no AR phase), max_denoise_batch 2,
    K = 2: in every engine step the decode forward (if any) is followed by at most one kind of heavy work:
    a denoise forward, or one request's hand-off with its prefill, or one VAE decode, never two of them. Each
    request gives what it gives alone."""
    holder: list = [None]
    log = step_log(monkeypatch, lambda: holder[0])
    pipe = make_engine(tiny, preview_every=0, max_batch=4, max_denoise_batch=2)
    events, scheduler = run_together(tiny, MIXED, engine=pipe, on_start=lambda s: holder.__setitem__(0, s),
                                     decode_steps_per_denoise=2)
    holder[0] = None
    for i, kw in enumerate(MIXED):
        want, got = solo(tiny, kw), outcome(events[i])
        assert not got[2] and isinstance(events[i][-1], Done), got[2]
        assert got[0] == want[0] and psnr(got[1][0], want[1][0]) >= 40, i
    turns = {step: [w for w in work if w in HEAVY] for step, work in log.items()}
    kinds = collections.Counter(tuple(t) for t in turns.values() if t)
    # a denoise forward alone, a hand-off followed by its prefill (a request without an AR phase has none:
    # a prefill alone), or one VAE decode: nothing else shares a step
    assert set(kinds) <= {("denoise",), ("handoff", "prefill"), ("prefill",), ("vae",)}, kinds
    assert kinds[("vae",)] == 4 and kinds[("handoff", "prefill")] + kinds[("prefill",)] == 4, kinds
    with_decode = [t for step, t in turns.items() if "decode" in log[step] and t]
    assert {("denoise",), ("vae",)} <= {tuple(t) for t in with_decode}, turns   # heavy turns beside decoding ones
    assert scheduler.totals["handoffs"] == 4 and scheduler.totals["image_decodes"] == 4


_alone: dict = {}


def solo(lm, kw: dict) -> tuple:
    """What the request gives on its own engine (cached: the policy tests compare with it)."""
    key = tuple(sorted(kw.items()))
    if key not in _alone:
        _alone[key] = alone(lm, kw)
    return _alone[key]


def test_waves_decode_together_then_denoise(tiny, monkeypatch):
    """Waves (K ignored): no step runs a decode forward and heavy work together, and no AR slot is granted
    (no AR prefill) while a request is in its image phase; request 1, cancelled while decoding, ends at its
    next token; the others give what each gives alone."""
    holder: list = [None]
    log = step_log(monkeypatch, lambda: holder[0])
    pipe = make_engine(tiny, preview_every=0, max_batch=4, max_denoise_batch=2)
    events, scheduler = run_together(tiny, MIXED, engine=pipe, cancel_at={1: 6},
                                     on_start=lambda s: holder.__setitem__(0, s), policy="waves")
    holder[0] = None
    for step, work in log.items():
        assert not ("decode" in work and HEAVY & set(work)), (step, work)
    heavy = sorted(step for step, work in log.items() if HEAVY & set(work))
    prefills = sorted(step for step, work in log.items() for w in work if w == "ar_prefill")
    # request 3 (no AR phase) is an image wave of its own at once (steps 0-3: hand-off, 2 steps, VAE); the
    # others' CoTs after it, then their images
    assert heavy[:4] == [0, 1, 2, 3] and prefills == [4, 4, 4], (heavy, prefills)
    cancelled = events[1]
    assert isinstance(cancelled[-1], Error) and cancelled[-1].kind == "cancelled"
    text, full = outcome(cancelled)[0], solo(tiny, MIXED[1])[0]
    assert 0 < len(text) < len(full) and full.startswith(text)       # some tokens, then no more
    for i in (0, 2, 3):
        want, got = solo(tiny, MIXED[i]), outcome(events[i])
        assert not got[2] and got[0] == want[0] and psnr(got[1][0], want[1][0]) >= 40, i


def test_overlap_runs_interleave_order_with_the_same_results(tiny):
    """Overlap on the CPU: one lane, so the very same events as interleave (the same tokens, the same PNG
    bytes, in the same engine steps); each request gives what it gives alone."""
    runs = {}
    for policy in ("interleave", "overlap"):
        pipe = make_engine(tiny, preview_every=0, max_batch=4, max_denoise_batch=2)
        events, scheduler = run_together(tiny, MIXED, engine=pipe, policy=policy, decode_steps_per_denoise=2)
        # (each run's request ids and wall-clock timings are its own)
        runs[policy] = ({i: [dataclasses.replace(e, request_id="") if isinstance(e, Started) else
                             dataclasses.replace(e, timings=None) if isinstance(e, Done) else
                             dataclasses.replace(e, waited_ms=0.0) if isinstance(e, Denoising) else e for e in evs]
                         for i, evs in events.items()}, scheduler.steps, dict(scheduler.totals))
        assert scheduler.lanes.side is None
    assert runs["overlap"] == runs["interleave"]
    for i, kw in enumerate(MIXED):
        want, got = solo(tiny, kw), outcome(runs["overlap"][0][i])
        assert not got[2] and got[0] == want[0] and psnr(got[1][0], want[1][0]) >= 40, i


def test_an_unknown_policy_is_refused(tiny):
    with pytest.raises(ValueError, match="interleave, waves, overlap"):
        make_engine(tiny, preview_every=0).new_scheduler(policy="fifo")


def test_the_default_policy_is_overlap_on_one_gpu_and_interleave_elsewhere(tiny):
    """No policy asked (--step-policy auto): overlap on one GPU, the fastest measured there; interleave on
    several GPUs (which refuse overlap) and on a CPU (no second stream); a policy asked for is kept."""
    from engine.parallel.plan import check_step_policy, default_step_policy
    assert default_step_policy(1, "cuda") == "overlap"
    assert default_step_policy(4, "cuda") == default_step_policy(1, "cpu") == "interleave"
    check_step_policy(default_step_policy(4, "cuda"), 4, "cuda")
    assert make_engine(tiny, preview_every=0).scheduler.policy == "interleave"
    assert make_engine(tiny, preview_every=0, step_policy="waves").scheduler.policy == "waves"
    assert make_engine(tiny, preview_every=0, step_policy="waves").new_scheduler(policy="overlap").policy == "overlap"


def test_overlap_is_refused_across_gpus_and_kept_on_one():
    """Overlap's second stream would run two NCCL communicators' collectives at once on several GPUs (a
    possible hang): refused there before anything loads, with what to use instead; one GPU, the CPU's
    gloo ranks and the other policies pass."""
    from engine.parallel.plan import check_step_policy
    for policy in ("overlap", "overlap:8"):
        with pytest.raises(ValueError, match=r"runs on one GPU: on 4 GPUs .* use interleave or waves"):
            check_step_policy(policy, 4, "cuda")
        check_step_policy(policy, 1, "cuda")
        check_step_policy(policy, 2, "cpu")
    for policy in ("interleave", "interleave:8", "waves"):
        check_step_policy(policy, 4, "cuda")
