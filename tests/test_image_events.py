"""An image leaves the engine's loop as pixels and becomes a PNG where it is first asked for (the worker's
sender thread, engine/serve/worker.py): the loop never spends a CPU core's ~0.1-0.2 s on it while the GPU
waits. The PNG holds exactly the pixels; one that cannot be encoded fails its request, not the engine."""
from __future__ import annotations

import io
import pickle

import numpy as np
from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Step
from engine.runtime.request import Request
from engine.serve.messages import EventOut
from engine.serve.worker import _encoded
from engine_drive import make_engine


def test_the_engine_hands_over_pixels_and_the_png_holds_them_exactly(tiny):
    events = list(make_engine(tiny, preview_every=0).run(Request(prompt="a red circle", bot_task="image",
                                                                 size="256x256", steps=2, seed=3)))
    img = next(e for e in events if isinstance(e, Image))
    assert isinstance(img.data, np.ndarray) and img.data.dtype == np.uint8 and img.data.shape == (256, 256, 3)
    pixels = img.data.copy()
    png = img.png                                      # encoded once, here, and kept
    assert img.png is png and isinstance(img.data, bytes)
    decoded = PILImage.open(io.BytesIO(png))
    assert decoded.format == "PNG" and np.array_equal(np.asarray(decoded.convert("RGB")), pixels)
    assert isinstance(events[-1], Done)


def test_step_previews_leave_as_pixels_too(tiny):
    events = list(make_engine(tiny, preview_every=1, preview_share=1.0).run(
        Request(prompt="a red circle", bot_task="image", size="256x256", steps=2, seed=3)))
    previews = [e for e in events if isinstance(e, Step) and e.preview_data is not None]
    assert previews and all(isinstance(e.preview_data, np.ndarray) for e in previews)
    pixels = previews[0].preview_data.copy()
    sent = _encoded(EventOut(1, previews[0]))
    assert sent.event.preview.startswith(b"\x89PNG") and isinstance(sent.event.preview_data, bytes)
    assert np.array_equal(np.asarray(PILImage.open(io.BytesIO(sent.event.preview)).convert("RGB")), pixels)


def test_the_sender_encodes_before_writing_and_a_failure_fails_only_its_request():
    pixels = np.random.default_rng(0).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    msg = _encoded(EventOut(4, Image(pixels, 6, 8, seed=1)))
    sent = pickle.loads(pickle.dumps(msg))             # what crosses the pipe: the PNG's bytes
    assert isinstance(sent.event.data, bytes)
    assert np.array_equal(np.asarray(PILImage.open(io.BytesIO(sent.event.png))), pixels)
    bad = _encoded(EventOut(5, Image(np.zeros((2, 2, 7), np.float64), 2, 2, seed=1)))     # no PNG mode for it
    assert bad.seq == 5 and isinstance(bad.event, Error) and bad.event.kind == "engine"
    assert "PNG" in bad.event.message
