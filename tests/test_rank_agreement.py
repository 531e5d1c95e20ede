"""What every rank of a plan must agree on, on four gloo ranks: the seed of a request that came
without one (drawn once, where the request enters the engine, and reported), and a failure on one rank
(the request ends with that rank's message on every rank, and the engine serves the next request)."""
from __future__ import annotations

import io
import time

import numpy as np
from PIL import Image as PILImage

import engine.serve.workers as workers_module
from engine.runtime.events import Error, Image, Started, Text
from engine.runtime.request import Request
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer
from faults import FAULT_ENV, faulty_worker
from studio_fixtures import READY_TIMEOUT_S
from engine_drive import make_engine

REQ = dict(prompt="a red circle on gray", bot_task="think", max_new_tokens=10, size="256x256", steps=3)


def _pixels(ev: Image) -> np.ndarray:
    return np.asarray(PILImage.open(io.BytesIO(ev.png)), dtype=np.float64)


def test_a_request_without_a_seed_gives_the_tp1_image_of_the_reported_seed(tiny, tiny_dir):
    """... with each decode step launched ahead on the four ranks (the tokens the step feeds are rank 0's, broadcast
    before the launch), against tp1's plain decode steps."""
    config = EngineConfig(tiny_dir, plan="hybrid4", preview_every=0, decode_lookahead="on")
    with EngineServer(config) as server:
        assert server.wait_ready(READY_TIMEOUT_S), server.health()
        events = list(server.stream(Request(**REQ)))           # no seed
    started = next(e for e in events if isinstance(e, Started))
    image = next(e for e in events if isinstance(e, Image))
    assert image.seed == started.seed
    ref = list(make_engine(tiny, preview_every=0).run(Request(seed=started.seed, **REQ)))
    assert "".join(e.delta for e in events if isinstance(e, Text)) == "".join(e.delta for e in ref if isinstance(e, Text))
    mse = np.mean((_pixels(image) - _pixels(next(e for e in ref if isinstance(e, Image)))) ** 2)
    assert mse == 0 or 10 * np.log10(255 ** 2 / mse) >= 40


def test_a_failure_on_rank_1_ends_the_request_with_its_message_and_the_next_one_runs(tiny_dir, tmp_path,
                                                                                    monkeypatch):
    monkeypatch.setenv(FAULT_ENV, f"1:1:{tmp_path / 'fired'}")
    monkeypatch.setattr(workers_module, "worker_main", faulty_worker)     # what Workers.spawn starts
    with EngineServer(EngineConfig(tiny_dir, plan="hybrid4", preview_every=0)) as server:
        assert server.wait_ready(READY_TIMEOUT_S), server.health()
        t0 = time.monotonic()
        events = list(server.stream(Request(seed=1, **REQ)))
        took = time.monotonic() - t0
        assert (tmp_path / "fired").exists()
        err = events[-1]
        assert isinstance(err, Error) and err.kind == "engine", err
        assert "injected fault on rank 1 at denoise step 1" in err.message and "rank 1" in err.message
        assert took < 20, took
        events = list(server.stream(Request(seed=2, **REQ)))   # waits for the restarted engine, then runs
        assert any(isinstance(e, Image) for e in events), events[-1]
        assert server.health()["restarts"] == 1
