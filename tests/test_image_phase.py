"""The image path: T2I and TI2I end to end, the prefix-cached denoise step, the Distil schedule and
forward count, seeds, the KV hand-off, and refusal of bad input before any compute."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from engine.model.attention import KVCache
from engine.runtime.conditioning import embed_range
from engine.runtime.denoise import flow_sigmas, tail_embeddings, velocity
from engine.runtime.events import Done, Error, Image, Ratio, Started, Step, Text
from engine.parallel.layout import PhaseView
from engine.runtime.request import Request, prepare
from engine.runtime.sequence import image_phase_sequence, user_turn

from engine_drive import backbone_rows, make_engine, run_backbone


def run(pipe, **kw):
    return list(pipe.run(Request(**kw)))


def image_of(events):
    imgs = [e for e in events if isinstance(e, Image)]
    assert imgs, [e for e in events if isinstance(e, Error)]
    return PILImage.open(io.BytesIO(imgs[0].png))


def refs(n):
    colors = [(220, 40, 40), (40, 200, 60), (30, 60, 220)]
    out = []
    for i in range(n):
        buf = io.BytesIO()
        PILImage.new("RGB", (120 + 60 * i, 160), colors[i]).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def test_t2i_stream_order_and_size(tiny):
    ev = run(make_engine(tiny), prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=4)
    kinds = [type(e) for e in ev]
    assert kinds[0] is Started and kinds[-1] is Done
    assert kinds.index(Ratio) < kinds.index(Step) < kinds.index(Image)
    if Text in kinds:
        assert max(i for i, k in enumerate(kinds) if k is Text) < kinds.index(Step)
    ratio = next(e for e in ev if isinstance(e, Ratio))
    assert image_of(ev).size == (ratio.width, ratio.height)
    assert [e.i for e in ev if isinstance(e, Step)] == [1, 2]
    t = ev[-1].timings
    assert t.dit_steps == 2 and t.dit_ms_per_step > 0 and t.vae_ms > 0 and t.total_s > 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ti2i_with_references(tiny, n):
    ev = run(make_engine(tiny, preview_every=0), prompt="put them together", images=refs(n), bot_task="image",
             size="192x256", steps=2, seed=1)
    assert image_of(ev).size == (256, 192)


def test_same_seed_same_image_and_other_seed_differs(tiny):
    pipe = make_engine(tiny, preview_every=0)
    kw = dict(prompt="a blue star", images=refs(1), bot_task="think", max_new_tokens=6, steps=2)
    a = image_of(run(pipe, seed=7, **kw)).tobytes()
    b = image_of(run(pipe, seed=7, **kw)).tobytes()
    c = image_of(run(pipe, seed=8, **kw)).tobytes()
    assert a == b and a != c


def test_distil_schedule_values():
    t = (flow_sigmas(8, 3.0) * 1000).tolist()
    expected = [1000, 954.5, 900, 833.3, 750, 642.9, 500, 300, 0]
    assert all(abs(a - b) < 0.06 for a, b in zip(t, expected)), t


def test_distil_runs_one_forward_per_step(tiny_distil):
    pipe = make_engine(tiny_distil, preview_every=0)
    with backbone_rows(tiny_distil) as calls:
        ev = run(pipe, prompt="a cat", bot_task="image", size="256x256", steps=3, seed=0)
    assert image_of(ev).size == (256, 256)
    assert calls == [1, 1, 1, 1]       # the prefix once, then one batch-1 forward per step: no uncond branch


def test_prefix_cached_step_equals_full_sequence_step(tiny):
    model, tok, view = tiny.model, tiny.tok, PhaseView()
    seq = image_phase_sequence(user_turn(tok, "be brief", "a green square", []),
                               "<think>plan</think><recaption>x</recaption>", 4, 4, 16, distil=False)
    span = seq.gen_image
    T = seq.tensors()
    ids = T["ids"][None]
    L = span.stop
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(1, 16, 4, 4, generator=g)
    x2 = torch.randn(1, 16, 4, 4, generator=g)
    t1, t2 = torch.tensor([1000.0]), torch.tensor([700.0])
    with torch.no_grad():
        cache = KVCache.allocate(2, 1, 8, L, 8, torch.float32, "cpu")
        full1 = torch.cat([embed_range(model, seq, ids, [], 0, span.meta_start),
                           tail_embeddings(model, x1, t1, None, None)], 1)
        run_backbone(model, full1, torch.arange(L), T["pos"], T["blocks"], cache, L, view)
        tail2 = tail_embeddings(model, x2, t2, None, None)
        cached = run_backbone(model, tail2, torch.arange(span.meta_start, L), T["pos"], T["blocks"], cache, L, view)
        full2 = torch.cat([embed_range(model, seq, ids, [], 0, span.meta_start), tail2], 1)
        fresh = KVCache.allocate(2, 1, 8, L, 8, torch.float32, "cpu")
        recomputed = run_backbone(model, full2, torch.arange(L), T["pos"], T["blocks"], fresh, L, view)
        v_cached = velocity(model, cached[:, -16:], t2, span)
        v_full = velocity(model, recomputed[:, -16:], t2, span)
    assert (v_cached - v_full).abs().max().item() <= 1e-5


def test_kv_handoff_equals_recompute(tiny):
    kw = dict(prompt="a red circle on the left", images=refs(1), bot_task="think_recaption", max_new_tokens=10,
              steps=2, seed=3, greedy=True)
    a = run(make_engine(tiny, preview_every=0, kv_handoff=True), **kw)
    b = run(make_engine(tiny, preview_every=0, kv_handoff=False), **kw)
    assert [e for e in a if isinstance(e, Text)] == [e for e in b if isinstance(e, Text)]
    assert a[-1].timings.kv_reused_tokens > 256 and b[-1].timings.kv_reused_tokens == 0   # past the image
    ia = np.asarray(image_of(a), dtype=np.float32)
    ib = np.asarray(image_of(b), dtype=np.float32)
    assert np.abs(ia - ib).max() <= 1.0     # fp32: at most one rounding step of the 8-bit output


@pytest.mark.parametrize("kw,msg", [
    (dict(prompt="  "), "prompt is empty"),
    (dict(prompt="x", images=[b"a", b"b", b"c", b"d"]), "at most 3"),
    (dict(prompt="x", images=[b"not an image"]), "reference image 1 cannot be read"),
    (dict(prompt="x", size="huge"), "size 'huge' is not understood"),
    (dict(prompt="x", steps=0), "steps must be"),
    (dict(prompt="x", steps=500), "steps must be"),
    (dict(prompt="x", guidance=-1.0), "guidance must be"),
    (dict(prompt="x", bot_task="dream"), "unknown reasoning mode"),
])
def test_bad_input_is_refused_before_compute(tiny, kw, msg):
    calls = []
    tiny.model.backbone = lambda *a, **k: calls.append(1)
    try:
        ev = run(make_engine(tiny), **kw)
    finally:
        del tiny.model.backbone
    assert len(ev) == 1 and isinstance(ev[0], Error) and ev[0].kind == "invalid"
    assert msg in ev[0].message and not calls


def test_zero_size_and_missing_file_references(tiny, tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    ev = run(make_engine(tiny), prompt="x", images=[str(empty)])
    assert isinstance(ev[0], Error) and "reference image 1" in ev[0].message
    ev = run(make_engine(tiny), prompt="x", images=[str(tmp_path / "nope.png")])
    assert isinstance(ev[0], Error) and "not found" in ev[0].message


def test_serial_cfg_equals_batched(tiny):
    kw = dict(prompt="a red circle", images=refs(1), bot_task="think", max_new_tokens=6, steps=2, seed=5, greedy=True)
    a = np.asarray(image_of(run(make_engine(tiny, preview_every=0), **kw)), dtype=np.float32)
    b = np.asarray(image_of(run(make_engine(tiny, preview_every=0, cfg_serial=True), **kw)), dtype=np.float32)
    assert np.abs(a - b).max() <= 1.0


def test_cache_grows_when_the_image_stage_needs_more_room(tiny):
    """If the image-stage sequence outgrows the cache allocated before the AR phase (re-tokenized CoT
    longer than the sampled ids), the cache grows and keeps the AR prefix: same image as with room."""
    kw = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=3, greedy=True)
    roomy = make_engine(tiny, preview_every=0)
    tight = make_engine(tiny, preview_every=0)
    tight.ctx.max_image_tokens = 1      # the budget then cannot hold the generated image
    a, b = run(roomy, **kw), run(tight, **kw)
    assert b[-1].timings.kv_reused_tokens == a[-1].timings.kv_reused_tokens > 0
    assert np.abs(np.asarray(image_of(a), dtype=np.float32) - np.asarray(image_of(b), dtype=np.float32)).max() <= 1.0


def test_previews_keep_to_their_share_of_the_denoise_time(tiny, monkeypatch):
    import time

    import engine.runtime.program as program

    def slow_preview(ctx, x0, aligned=None):     # a preview as costly as a CPU VAE decode
        time.sleep(0.05)
        return b"png"

    monkeypatch.setattr(program, "_preview", slow_preview)
    kw = dict(prompt="a red circle", bot_task="image", steps=12, seed=3)
    every = make_engine(tiny, preview_share=1e9)
    ev = run(every, **kw)
    assert [e.preview is not None for e in ev if isinstance(e, Step)] == [True] * 11 + [False]  # the image follows

    thrifty = make_engine(tiny)
    ev = run(thrifty, **kw)
    shown = sum(e.preview is not None for e in ev if isinstance(e, Step))
    compute_s = next(e for e in ev if isinstance(e, Done)).timings.dit_ms_per_step * 12 / 1e3
    assert shown >= 1 and ev[[isinstance(e, Step) for e in ev].index(True)].preview  # the first step shows
    assert 0.05 * (shown - 1) <= 0.25 * compute_s + 1e-3, (shown, compute_s)


def _png_array(ev: Image) -> np.ndarray:
    return np.asarray(PILImage.open(io.BytesIO(ev.png)), dtype=np.float64)


@pytest.mark.parametrize("fixture,guidance", [("tiny", 4.0), ("tiny_distil", None)])
def test_n_images_share_one_reasoning_pass_and_one_batched_denoise(fixture, guidance, request):
    """n=2: one AR phase, each denoise step one forward for both images (and both CFG branches), two
    images with seeds s and s+1; image 0 is the n=1 image of the same seed (same CoT, same noise)."""
    lm = request.getfixturevalue(fixture)
    pipe = make_engine(lm, preview_every=0)
    kw = dict(prompt="a red circle", bot_task="think", max_new_tokens=12, size="256x256", steps=3, seed=7,
              guidance=guidance)
    calls, phases = [], []
    orig = lm.model.backbone

    def counting(x, *a, **k):
        calls.append((phases[-1] if phases else "?", x.shape[0]))
        return orig(x, *a, **k)

    pipe.ctx.on_phase = phases.append
    lm.model.backbone = counting
    try:
        two = run(pipe, n=2, **kw)
        two_calls, two_phases = list(calls), list(phases)
        one = run(pipe, n=1, **kw)
    finally:
        del lm.model.backbone
    images = [e for e in two if isinstance(e, Image)]
    assert [(e.index, e.seed) for e in images] == [(0, 7), (1, 8)]
    assert two_phases == ["ar", "denoise"]
    branches = 2 if guidance else 1
    steps = [b for ph, b in two_calls if ph == "denoise"]
    assert steps[-3:] == [2 * branches] * 3           # every step: one forward with all rows
    a, b = _png_array(images[0]), _png_array(images[1])
    assert np.abs(a - b).mean() > 1.0                  # different noise, different images
    ref = _png_array(next(e for e in one if isinstance(e, Image)))
    mse = np.mean((a - ref) ** 2)
    assert mse == 0 or 10 * np.log10(255 ** 2 / mse) >= 40
    texts = [e.delta for e in two if isinstance(e, Text)]
    assert texts == [e.delta for e in one if isinstance(e, Text)]     # one reasoning, the same


def test_n_out_of_range_is_refused(tiny):
    ev = run(make_engine(tiny), prompt="a cat", n=5)
    assert isinstance(ev[-1], Error) and ev[-1].kind == "invalid" and "n (images per request)" in ev[-1].message


@pytest.mark.parametrize("fixture", ["tiny", "tiny_distil"])
def test_mask_free_steps_equal_the_masked_steps(fixture, request, monkeypatch):
    """After the prefix, a step's image rows run without a mask and only the 1 (Instruct) or 3 (Distil)
    meta rows keep theirs: the image equals the one computed with the whole dense mask."""
    from engine.runtime.denoise import DenoiseRunner
    lm = request.getfixturevalue(fixture)
    kw = dict(prompt="a blue star", bot_task="image", size="256x256", steps=3, seed=2)
    fast = image_of(run(make_engine(lm, preview_every=0), **kw))
    seen = []
    orig = DenoiseRunner._masked_rows
    # the same run with every range on its dense mask (what the fast path would have used is recorded)
    monkeypatch.setattr(DenoiseRunner, "_masked_rows", lambda self, *a: seen.append(orig(self, *a)))
    dense = image_of(run(make_engine(lm, preview_every=0), **kw))
    assert seen[-1] == (3 if lm.cfg.cfg_distilled else 1)      # the steps' range: only the meta rows masked
    a, b = np.asarray(fast, dtype=np.float64), np.asarray(dense, dtype=np.float64)
    mse = np.mean((a - b) ** 2)
    assert mse == 0 or 10 * np.log10(255 ** 2 / mse) >= 50


def test_the_prompt_is_tokenized_once_and_the_input_counted_where_it_is(tiny, monkeypatch):
    """The user turn is tokenized once, as the request starts: both phases' sequences and the next turn's
    view of it (the prefix cache's) continue it, and its count is the usage's input (`Started`); only the
    reasoning is read again (the image phase's template needs it). A reasoning request with a reference."""
    prompt, calls = "a small red circle on the left", []
    encode = type(tiny.tok).encode
    monkeypatch.setattr(type(tiny.tok), "encode", lambda self, text: (calls.append(text), encode(self, text))[1])
    ref = PILImage.new("RGB", (96, 64), (20, 200, 40))
    ev = run(make_engine(tiny, preview_every=0), prompt=prompt, images=[ref], bot_task="think_recaption",
             max_new_tokens=12, size="256x256", steps=2, seed=3)
    assert isinstance(ev[-1], Done) and sum(prompt in text for text in calls) == 1, calls
    started = ev[0]
    assert isinstance(started, Started) and started.input_image_tokens > 0
    monkeypatch.undo()
    p = prepare(Request(prompt=prompt, images=[ref], bot_task="think_recaption", seed=3), tiny)
    system = tiny.prompts.resolve(p.preset, p.bot_task, None)
    turn = user_turn(tiny.tok, system, prompt, [i.layout for i in p.images], (), tiny.cfg.cond_token_attn_type).seq
    assert (started.input_text_tokens, started.input_image_tokens) == (len(turn) - turn.image_tokens,
                                                                       turn.image_tokens)
