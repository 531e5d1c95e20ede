"""The step cache (engine/runtime/step_cache.py): the official Taylor cache's schedule and forecast,
checked against hand-written expectations (the official counter traced by hand, backward differences
and a numpy FFT band split written out here), its effect in the pipeline (forwards counted, a cache that
never forecasts equals no cache, CFG rows forecast together), and its request, CLI and /v1 surface."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from engine.__main__ import main as cli_main
from engine.runtime.events import Done, Error, Image
from engine.runtime.request import Request, RequestError, prepare
from engine.runtime.step_cache import BlockCacheParams, TaylorCache, TaylorCacheParams, taylor_schedule
from engine.serve.info import ModelInfo
from engine.serve.openai_errors import ApiError
from engine.serve.openai_params import parse_generation, refusal

from engine_drive import backbone_rows, make_engine

P = TaylorCacheParams


def full_steps(params: TaylorCacheParams, steps: int) -> list[int]:
    return [i for i, s in enumerate(taylor_schedule(params, steps)) if s.full]


# ------------------------------------------------------------------------------------------ schedule
def test_schedule_follows_the_official_counter():
    # traced by hand from the official forward: step 0 is full; a forecast step advances a counter and
    # the step that finds it at interval - 1 is full (so every interval-th step); enhance adds steps
    assert full_steps(P(), 12) == [0, 5, 10]
    assert full_steps(P(taylor_cache_interval=1), 4) == [0, 1, 2, 3]
    assert full_steps(P(taylor_cache_enable_tailing_enhance=True), 12) == [0, 5, 10, 11]
    assert full_steps(P(taylor_cache_enable_tailing_enhance=True, taylor_cache_tailing_enhance_steps=3), 12) == \
        [0, 5, 9, 10, 11]
    first = P(taylor_cache_enable_first_enhance=True, taylor_cache_enable_tailing_enhance=True)
    assert full_steps(first, 12) == [0, 1, 2, 7, 11]
    sched = taylor_schedule(first, 12)
    # first enhance: the full steps before first_enhance_steps - 1 record nothing
    assert [i for i, s in enumerate(sched) if s.record] == [2, 7, 11]
    assert [sched[i].distance for i in (7, 11)] == [5, 4]            # record distance: since the last full step
    assert [sched[i].distance for i in (3, 4, 5, 6, 8)] == [1, 2, 3, 4, 1]   # forecast distance


# ------------------------------------------------------------------------------------------ forecast
def np_bands(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Low / high band along axis 1: keep the frequencies with |f| <= 0.1 max|f| (numpy's FFT)."""
    f = np.abs(np.fft.fftfreq(x.shape[1]))
    keep = (f <= 0.1 * f.max())[None, :, None]
    spec = np.fft.fft(x, axis=1)
    low = np.fft.ifft(spec * keep, axis=1).real
    return low, x - low


def recorded(interval: int, seed: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """Features for the full steps 0, interval, 2*interval of a 2-row (cond, uncond) request: a smooth
    trajectory in the step index plus per-token structure, [2, 40 tokens, 8 channels]."""
    rng = np.random.default_rng(seed)
    a, b, c = (rng.standard_normal((2, 40, 8)) for _ in range(3))
    steps = [0, interval, 2 * interval]
    return [a + b * (s / 10) + c * (s / 10) ** 2 for s in steps], steps


def run_cache(params: TaylorCacheParams, feats: list[np.ndarray], full: list[int], ask: list[int], steps: int):
    cache = TaylorCache(params, steps)
    assert full_steps(params, steps)[:len(full)] == full
    out = {}
    it = iter(feats)
    for i in range(steps):
        if cache.full(i):
            if i in full:
                cache.record(i, torch.tensor(next(it), dtype=torch.float64))
        elif i in ask:
            out[i] = cache.forecast(i).numpy()
        if i >= max(ask):
            break
    return out


def test_forecast_is_the_backward_difference_taylor_series():
    """Orders 2/2 (the default): the bands add back up, so the forecast k steps after the full step n is
    f_n + k (f_n - f_{n-1}) / D + k^2 / 2 (f_n - 2 f_{n-1} + f_{n-2}) / D^2 on both CFG rows."""
    D = 3
    feats, full = recorded(D)
    got = run_cache(P(taylor_cache_interval=D), feats, full, [7, 8], steps=12)
    f0, f1, f2 = feats
    for k, i in ((1, 7), (2, 8)):
        want = f2 + k * (f2 - f1) / D + k * k / 2 * (f2 - 2 * f1 + f0) / D ** 2
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)


def test_forecast_bands_take_their_own_orders():
    """Low band order 0 (held), high band order 2: the low band of the last full step plus the high band's
    own second-order series; and high order 0 with low order 2: the low band stops at order 1 (the
    official container moves derivatives order by order and stops at the first order the high band lacks)."""
    D = 3
    feats, full = recorded(D, seed=1)
    lows, highs = zip(*(np_bands(f) for f in feats))
    got = run_cache(P(taylor_cache_interval=D, taylor_cache_low_freqs_order=0), feats, full, [8], steps=12)
    k = 2
    want = lows[2] + highs[2] + k * (highs[2] - highs[1]) / D + k * k / 2 * (highs[2] - 2 * highs[1] + highs[0]) / D ** 2
    np.testing.assert_allclose(got[8], want, rtol=1e-5, atol=1e-5)
    got = run_cache(P(taylor_cache_interval=D, taylor_cache_high_freqs_order=0), feats, full, [8], steps=12)
    want = highs[2] + lows[2] + k * (lows[2] - lows[1]) / D
    np.testing.assert_allclose(got[8], want, rtol=1e-5, atol=1e-5)
    # taylor_cache_order caps both bands: order 1 is the first-order series whatever the band orders
    got = run_cache(P(taylor_cache_interval=D, taylor_cache_order=1), feats, full, [8], steps=12)
    np.testing.assert_allclose(got[8], feats[2] + k * (feats[2] - feats[1]) / D, rtol=1e-5, atol=1e-5)


def test_the_first_full_steps_record_one_derivative_each():
    """After the first record only order 0 exists (the forecast holds the features), after the second
    order 1 (a line through the last two full steps)."""
    feats, _ = recorded(5, seed=2)
    cache = TaylorCache(P(), 12)
    cache.record(0, torch.tensor(feats[0]))
    np.testing.assert_allclose(cache.forecast(3).numpy(), feats[0], atol=1e-6)
    cache.record(5, torch.tensor(feats[1]))
    np.testing.assert_allclose(cache.forecast(8).numpy(), feats[1] + 3 * (feats[1] - feats[0]) / 5, atol=1e-5)


# ------------------------------------------------------------------------------------------ pipeline
def image_of(events):
    imgs = [e for e in events if isinstance(e, Image)]
    assert imgs, [e for e in events if isinstance(e, Error)]
    return np.asarray(PILImage.open(io.BytesIO(imgs[0].png)), dtype=np.float64)


def counted_run(lm, **kw):
    """(events, batch rows of every backbone forward) for one request."""
    return counted_run_with(make_engine(lm, preview_every=0), lm, **kw)


REQ = dict(prompt="a red circle", bot_task="image", size="256x256", seed=3, steps=7, guidance=4.0)


def test_cache_that_never_forecasts_equals_no_cache(tiny):
    plain, _ = counted_run(tiny, **REQ)
    cached, _ = counted_run(tiny, **REQ, taylor_cache=P(taylor_cache_interval=1))
    assert np.array_equal(image_of(plain), image_of(cached))
    assert cached[-1].timings.dit_full_steps == 7 == plain[-1].timings.dit_full_steps


def test_forwards_run_only_on_the_official_full_steps_with_cfg_rows_together(tiny):
    _, plain = counted_run(tiny, **REQ)
    ev, calls = counted_run(tiny, **REQ, taylor_cache=P(taylor_cache_interval=3))
    # each branch's prefix once (1 row each), then per full step one forward of both CFG rows: 0, 3, 6 of 7
    assert plain == [1, 1] + [2] * 7
    assert calls == [1, 1] + [2] * 3
    t = ev[-1].timings
    assert (t.dit_steps, t.dit_full_steps) == (7, 3) and "(3 in full)" in t.summary()
    assert np.isfinite(image_of(ev)).all()


def test_distil_and_n_images_forecast_every_row(tiny_distil):
    ev, calls = counted_run(tiny_distil, prompt="a cat", bot_task="image", size="256x256", seed=0, steps=5, n=2,
                            taylor_cache=P(taylor_cache_interval=2, taylor_cache_enable_tailing_enhance=True))
    assert calls == [1] + [2] * 3          # the prefix once, then steps 0, 2 and 4 (the tailing step too)
    assert len([e for e in ev if isinstance(e, Image)]) == 2


@pytest.mark.parametrize("plan,sp", [("hybrid4", "ulysses"), ("tp2cfg2", None)])
def test_multi_rank_cached_run_equals_world1_cached_run(tiny_dir, tiny, plan, sp):
    """gloo ranks: under SP every rank forecasts the gathered tail, under CFG-parallel each its own branch;
    the cached image equals the one-rank cached image (PSNR >= 40 dB) with the same steps in full."""
    from engine.serve.engine_config import EngineConfig
    from engine.serve.server import EngineServer
    kw = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=5, seed=3, greedy=True,
              taylor_cache=P(taylor_cache_interval=2))
    ref = list(make_engine(tiny, preview_every=0).run(Request(**kw)))
    with EngineServer(EngineConfig(tiny_dir, plan=plan, sp_kind=sp, preview_every=0)) as server:
        assert server.wait_ready(300), server.health()
        ev = list(server.stream(Request(**kw)))
    assert psnr(image_of(ev), image_of(ref)) >= 40
    assert ev[-1].timings.dit_full_steps == ref[-1].timings.dit_full_steps == 3       # steps 0, 2, 4


# ------------------------------------------------------------------------------------------ block cache
B = BlockCacheParams


def test_block_cache_that_never_skips_equals_no_cache(tiny):
    plain, _ = counted_run(tiny, **REQ)
    ev, calls = counted_run(tiny, **REQ, block_cache=B(block_cache_max_skips=0))
    assert np.array_equal(image_of(plain), image_of(ev))
    assert calls == [1, 1] + [2, 2] * 7          # every step: the first block, then the other layers
    assert ev[-1].timings.dit_full_steps == 7


def test_block_cache_skips_within_its_limits_with_cfg_rows_together(tiny):
    """Threshold 1 (any change of the first block's residual smaller than itself): skipped wherever the
    limits allow: warm-up step 0, at most 2 skips in a row, the last step in full -> full 0, 3, 6, 7."""
    kw = dict(REQ, steps=8)
    ev, calls = counted_run(tiny, **kw, block_cache=B(block_cache_threshold=1.0, block_cache_warmup_steps=1,
                                                      block_cache_max_skips=2))
    assert ev[-1].timings.dit_full_steps == 4
    assert calls == [1, 1] + [2] * (8 + 4)      # every step's first block, the full steps' other layers: 2 rows
    plain, _ = counted_run(tiny, **kw)
    print(f"block cache vs none: PSNR {psnr(image_of(ev), image_of(plain)):.1f} dB")
    assert np.isfinite(image_of(ev)).all() and not np.array_equal(image_of(ev), image_of(plain))
    # threshold 0: every change is too large, nothing is skipped
    zero, _ = counted_run(tiny, **kw, block_cache=B(block_cache_threshold=0.0, block_cache_warmup_steps=1))
    assert zero[-1].timings.dit_full_steps == 8 and np.array_equal(image_of(zero), image_of(plain))


@pytest.mark.parametrize("plan,sp", [("hybrid4", "ulysses"), ("tp2cfg2", None)])
def test_multi_rank_block_cache_takes_one_decision(tiny_dir, tiny, plan, sp):
    """Every rank takes the same branch (a rank that skipped alone would leave the others waiting in a
    collective) and the image equals the one-rank one."""
    from engine.serve.engine_config import EngineConfig
    from engine.serve.server import EngineServer
    kw = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=6, seed=3, greedy=True,
              block_cache=B(block_cache_threshold=1.0, block_cache_warmup_steps=1, block_cache_max_skips=1))
    ref = list(make_engine(tiny, preview_every=0).run(Request(**kw)))
    with EngineServer(EngineConfig(tiny_dir, plan=plan, sp_kind=sp, preview_every=0)) as server:
        assert server.wait_ready(300), server.health()
        ev = list(server.stream(Request(**kw)))
    assert psnr(image_of(ev), image_of(ref)) >= 40
    assert ev[-1].timings.dit_full_steps == ref[-1].timings.dit_full_steps < 6


# ------------------------------------------------------------------------------------------ surface
@pytest.mark.parametrize("field,value", [("taylor_cache_interval", 0), ("taylor_cache_order", 5),
                                         ("taylor_cache_low_freqs_order", -1),
                                         ("taylor_cache_enable_first_enhance", "yes"),
                                         ("taylor_cache_first_enhance_steps", 2.5)])
def test_bad_settings_are_refused_naming_the_field(tiny, field, value):
    req = Request(prompt="x", taylor_cache=P(**{field: value}), seed=1)
    with pytest.raises(RequestError) as e:
        prepare(req, tiny)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("field,value", [("block_cache_threshold", -0.1), ("block_cache_threshold", "high"),
                                         ("block_cache_first_blocks", 0), ("block_cache_max_skips", 1.5)])
def test_bad_block_cache_settings_are_refused_naming_the_field(tiny, field, value):
    with pytest.raises(RequestError) as e:
        prepare(Request(prompt="x", block_cache=B(**{field: value}), seed=1), tiny)
    assert e.value.field == field and field in str(e.value)
    with pytest.raises(RequestError, match="choose one step cache"):
        prepare(Request(prompt="x", block_cache=B(), taylor_cache=P(), seed=1), tiny)


def test_cli_takes_the_official_options(tiny_dir, tmp_path, capsys):
    out = tmp_path / "x.png"
    rc = cli_main(["generate", "--model", str(tiny_dir), "--prompt", "a red circle", "--bot-task", "image",
                   "--size", "256x256", "--steps", "4", "--seed", "1", "--out", str(out),
                   "--use-taylor-cache", "--taylor-cache-interval", "2", "--taylor-cache-order", "1"])
    assert rc == 0 and out.exists()
    assert "4 steps (2 in full)" in capsys.readouterr().out
    rc = cli_main(["generate", "--model", str(tiny_dir), "--prompt", "x", "--out", str(out), "--seed", "1",
                   "--use-taylor-cache", "--taylor-cache-interval", "0"])
    assert rc == 2 and "taylor_cache_interval must be an integer from 1" in capsys.readouterr().err
    rc = cli_main(["generate", "--model", str(tiny_dir), "--prompt", "a red circle", "--bot-task", "image",
                   "--size", "256x256", "--steps", "4", "--seed", "1", "--out", str(out),
                   "--use-block-cache", "--block-cache-threshold", "1", "--block-cache-warmup-steps", "1"])
    assert rc == 0 and "4 steps (" in capsys.readouterr().out     # step 1 or 2 skipped, the last in full


def test_v1_fields(tiny_dir, tiny):
    info = ModelInfo.from_folder(tiny_dir)
    body = {"prompt": "a red circle", "use_taylor_cache": True, "taylor_cache_interval": "3",
            "taylor_cache_enable_tailing_enhance": "true"}
    req = parse_generation(body, info.name).request
    assert req.taylor_cache == P(taylor_cache_interval=3, taylor_cache_enable_tailing_enhance=True)
    assert parse_generation({"prompt": "x"}, info.name).request.taylor_cache is None
    with pytest.raises(ApiError) as e:           # a setting that would change nothing is refused
        parse_generation({"prompt": "x", "taylor_cache_order": 1}, info.name)
    assert (e.value.status, e.value.param) == (400, "taylor_cache_order")
    with pytest.raises(ApiError) as e:
        parse_generation({"prompt": "x", "use_taylor_cache": "maybe"}, info.name)
    assert (e.value.status, e.value.param) == (400, "use_taylor_cache")
    params = parse_generation({"prompt": "x", "seed": 1, "use_taylor_cache": True, "taylor_cache_interval": 0},
                              info.name)
    with pytest.raises(RequestError) as re_:
        prepare(params.request, tiny)
    err = refusal(Error("invalid", str(re_.value), re_.value.field), params, info)
    assert (err.status, err.param) == (400, "taylor_cache_interval")
    req = parse_generation({"prompt": "x", "use_block_cache": "true", "block_cache_threshold": "0.1"}, info.name).request
    assert req.block_cache == B(block_cache_threshold=0.1) and req.taylor_cache is None


def test_schedule_cost_is_known_before_the_first_step():
    """50 steps at the official defaults: 10 full steps (0, 5, ..., 45); tailing enhance adds step 49."""
    assert len(full_steps(P(), 50)) == 10 == math.ceil(50 / 5)
    assert full_steps(P(taylor_cache_enable_tailing_enhance=True), 50)[-2:] == [45, 49]


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", ["embedded"])
def test_cuda_graph_cached_run_equals_eager_cached_run(tiny_dir, which):
    """bf16 on CUDA: a Taylor-cached request with the denoise step as a CUDA graph gives the eager cached
    run's image bytes; the full step's graph is captured once and replayed on the full steps only.
    Not the tiny checkpoint: on the H200 (2026-12-02) runs of this very request on it differed from one another
    from step 9 of 12, with and without the cache, eager or graph (the embedded model's runs were all equal),
    so its bytes cannot tell a graph from an eager run; that non-determinism is an open finding (issue 31)."""
    from engine import EMBEDDED_MODEL
    from engine.model.loader import load
    lm = load(tiny_dir if which == "tiny" else EMBEDDED_MODEL, "cuda", torch.bfloat16)
    kw = dict(prompt="two red circles and a blue star", bot_task="image", size="256x256", seed=11, steps=12,
              taylor_cache=P(taylor_cache_interval=3, taylor_cache_enable_tailing_enhance=True))
    out = {}
    for graph in (False, True):
        pipe = make_engine(lm, preview_every=0, cuda_graph=graph)
        ev, calls = counted_run_with(pipe, lm, **kw)
        out[graph] = (image_of(ev), ev[-1].timings, dict(pipe.graphs.captures), calls)
    assert out[True][0].tobytes() == out[False][0].tobytes()
    assert out[True][1].dit_full_steps == out[False][1].dit_full_steps == 5      # 0, 3, 6, 9, 11
    assert [k[0] for k in out[True][2]] == ["denoise"] and set(out[True][2].values()) == {1}
    plain = image_of(counted_run_with(make_engine(lm, preview_every=0), lm, **{**kw, "taylor_cache": None})[0])
    print(f"{which}: cached vs uncached PSNR {psnr(out[True][0], plain):.1f} dB")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_block_cache_runs_eagerly_and_skips():
    """bf16 on CUDA, the embedded model: the block cache that never skips stays close to no cache (its
    split stream rounds once more in bf16); at threshold 1 it skips; no graph is captured for its steps
    (the decision is read on the host). Prints the default's steps in full and PSNR vs no cache."""
    from engine import EMBEDDED_MODEL
    from engine.model.loader import load
    lm = load(EMBEDDED_MODEL, "cuda", torch.bfloat16)
    kw = dict(prompt="two red circles and a blue star", bot_task="image", size="256x256", seed=11, steps=50)
    pipe = make_engine(lm, preview_every=0)
    plain = image_of(counted_run_with(pipe, lm, **kw)[0])
    never, _ = counted_run_with(pipe, lm, **kw, block_cache=B(block_cache_max_skips=0))
    for threshold in (0.08, 1.0):
        pipe = make_engine(lm, preview_every=0)
        ev, _ = counted_run_with(pipe, lm, **kw, block_cache=B(block_cache_threshold=threshold))
        print(f"block cache at {threshold}: {ev[-1].timings.dit_full_steps}/50 in full, PSNR "
              f"{psnr(image_of(ev), plain):.1f} dB vs no cache")
        assert not pipe.graphs.captures
    print(f"never skipping: {psnr(image_of(never), plain):.1f} dB")
    assert psnr(image_of(never), plain) >= 35
    assert ev[-1].timings.dit_full_steps < 50           # threshold 1: skips wherever the limits allow


def counted_run_with(pipe, lm, **kw):
    with backbone_rows(lm) as calls:
        ev = list(pipe.run(Request(**kw)))
    return ev, calls


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255 ** 2 / max(((a - b) ** 2).mean(), 1e-12)))


def test_named_settings_are_the_documented_ones():
    """The names the page, train.evaluate and the benchmark share; a bad one names itself and the choices."""
    from engine.runtime.step_cache import named_setting
    assert named_setting("none") == (None, None)
    assert named_setting("taylor") == (P(), None)
    assert named_setting("taylor-enhance") == (P(taylor_cache_enable_first_enhance=True,
                                                   taylor_cache_enable_tailing_enhance=True), None)
    assert named_setting("taylor-3") == (P(taylor_cache_interval=3), None)
    assert named_setting("block") == (None, B()) and named_setting("block-0.12") == (None, B(block_cache_threshold=0.12))
    for bad, why in (("taylor-0", "from 1 to 200"), ("block-7", "from 0 to 1"), ("fast", "not a setting")):
        with pytest.raises(ValueError, match=why) as e:
            named_setting(bad)
        assert repr(bad) in str(e.value) and "taylor-N, block, block-T" in str(e.value)
