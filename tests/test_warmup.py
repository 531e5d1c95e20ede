"""Warm-up at start (engine/runtime/warmup.py, `--warmup`) on the CPU: the denoise step keys it runs, the
storages it makes at their size (so later default requests neither grow them nor drop graphs captured on
them), that nothing of it shows in a request's result, a failure that names its part, and the flag from
the command line to /health. Its CUDA graphs: tests/test_gpu.py `test_warmup_captures_what_default_requests_need`."""
from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image as PILImage

from app import parse_args
from engine.runtime.decode_step import DecodeStep
from engine.runtime.denoise import TAIL_GRAIN
from engine.runtime.events import Done, Error, Image, Text
from engine.runtime.request import Request
from engine.runtime.warmup import TAIL_MAX, WarmupError, warm_up
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer
from engine_drive import make_engine

REQUESTS = [dict(prompt="a red circle on a white table", bot_task="think", max_new_tokens=24, steps=2, seed=5,
                 size="256x256"),
            dict(prompt="a blue square", bot_task="image", steps=2, seed=6, size="256x256"),
            dict(prompt=" ".join(["a small green boat"] * 120), bot_task="recaption", max_new_tokens=16, steps=2,
                 seed=7, size="256x256")]


def result(events) -> tuple[str, np.ndarray]:
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors, errors
    img = next(e for e in events if isinstance(e, Image))
    return ("".join(e.delta for e in events if isinstance(e, Text)),
            np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64))


@pytest.fixture(scope="module")
def warmed(tiny):
    pipe = make_engine(tiny, preview_every=0, max_batch=4)
    return pipe, warm_up(pipe)


def test_the_warm_up_runs_every_decode_bucket_and_each_tail_grain_longest_first(warmed):
    pipe, w = warmed
    grains = list(range(TAIL_MAX, 0, -TAIL_GRAIN))        # the tiny model's 4096 positions hold them all
    assert w.parts == ("decode 1", "decode 2", "decode 4", *(f"denoise 256x256 {g}" for g in grains), "sampling"), w.parts
    # the tails the pipeline itself computed for the warm-up's requests (its denoise step keys)
    tails = [k[3] for k in pipe.graphs.recent]             # the sampling part's key is the shortest grain's
    assert tails == grains, tails
    assert w.graphs == 0                                   # the CPU captures none


def test_default_requests_after_it_grow_no_storage_and_give_what_a_cold_engine_gives(warmed, tiny):
    """The storages the warm-up made hold default requests (a prompt of several hundred tokens among them): nothing is
    made again (which would drop the graphs captured on them); and each request's text and image are
    what a pipeline that never warmed up gives."""
    pipe, _ = warmed
    made = pipe.pool.allocations
    cold = make_engine(tiny, preview_every=0, max_batch=4)
    for kw in REQUESTS:
        text, img = result(list(pipe.run(Request(**kw))))
        text0, img0 = result(list(cold.run(Request(**kw))))
        assert text == text0, kw["prompt"][:40]
        assert np.array_equal(img, img0), kw["prompt"][:40]
    assert pipe.pool.allocations == made, "a default request grew a storage the warm-up made"


def test_a_failed_part_is_named(tiny, monkeypatch):
    def boom(self, b):
        raise RuntimeError("no memory for the step")
    monkeypatch.setattr(DecodeStep, "_forward", boom)
    with pytest.raises(WarmupError, match=r"warm-up of decode 1 failed: RuntimeError: no memory for the step"):
        warm_up(make_engine(tiny, preview_every=0, max_batch=2))


def test_the_flag_takes_sizes():
    assert parse_args([]).engine.warmup == ()
    assert parse_args(["--warmup"]).engine.warmup == ("default",)
    assert parse_args(["--warmup", "1024x1024, 768x1280"]).engine.warmup == ("1024x1024", "768x1280")
    with pytest.raises(SystemExit):
        parse_args(["--warmup", " , "])


def test_a_warmed_hybrid4_server_says_so_and_serves(tiny_dir):
    """Four gloo ranks run the same warm-up in step (its requests' collectives), then serve."""
    with pytest.raises(ValueError, match="not understood"):
        EngineServer(EngineConfig(tiny_dir, warmup=("huge",)))           # refused before anything is spawned
    server = EngineServer(EngineConfig(tiny_dir, plan="hybrid4", warmup=("default",), max_batch=2))
    try:
        assert server.wait_ready(120), server.health()
        h = server.health()
        assert h["warmup"]["parts"] == 3 + TAIL_MAX // TAIL_GRAIN and h["warmup"]["graphs"] == 0, h["warmup"]
        for kw in REQUESTS[:2]:
            events = list(server.submit(Request(**kw)))
            assert isinstance(events[-1], Done), events[-1]
    finally:
        server.close()
