"""Heavy work in turns of its own (engine/runtime/scheduler.py, issue 42 item 3): a request's hand-off and
image-prefix prefill, and its VAE decode, are never run inside the denoise turn of a step others wait on.
An instrumented log of what each engine step ran (the decode forward, the denoise batch's forward, a
hand-off, a prefix prefill, a VAE decode) over a mixed workload, on the tiny checkpoint (fp32)."""
from __future__ import annotations

import collections

from engine.model.hunyuan import HunyuanImage3
from engine.runtime.decode_step import DecodeStep
from engine.runtime.denoise import DenoiseRunner
from engine.runtime.denoise_batch import DenoiseBatch
from engine.runtime.events import Done
from engine.runtime.kv_pool import KVPool
from engine_drive import make_engine, run_together
from test_scheduler import MIXED, alone, outcome, psnr

HEAVY = {"denoise", "handoff", "prefill", "vae"}


def step_log(monkeypatch, scheduler_of) -> collections.defaultdict:
    """{engine step: [what it ran, in order]}: the methods that do the work, wrapped (the scheduler's own
    counts are not what is checked)."""
    log: collections.defaultdict = collections.defaultdict(list)
    for cls, name, kind in ((DecodeStep, "__call__", "decode"), (DenoiseBatch, "velocities", "denoise"),
                            (KVPool, "hand_off", "handoff"), (DenoiseRunner, "prefill", "prefill"),
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
        want, got = alone(tiny, kw), outcome(events[i])
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
