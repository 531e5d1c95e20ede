"""An image leaves the engine's loop as pixels and becomes a PNG where it is first asked for (the worker's
sender thread, engine/serve/worker.py): the loop never spends a CPU core's ~0.1-0.2 s on it while the GPU
waits. The PNG holds exactly the pixels; one that cannot be encoded fails its request, not the engine."""
from __future__ import annotations

import io
import pickle

import numpy as np
from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Step, Timings
from engine.runtime.images import Resized
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


def test_an_edit_that_takes_its_references_aspect_is_resized_where_its_pixels_are_read(tiny):
    """`stretch` (the official align option): the output takes the first reference's aspect in its bucket
    (a 300x200 reference: the 304x208 bucket's image becomes 314x209, about 256^2 pixels), resized with
    LANCZOS where its pixels are first read (images.Resized: on a GPU the engine's loop never waits for
    them); the event says that size and its PNG has it."""
    ref = PILImage.fromarray(np.random.default_rng(1).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    req = dict(prompt="make it blue", bot_task="image", size="208x304", steps=2, seed=3, images=[ref])
    engine = make_engine(tiny, preview_every=0)
    img = next(e for e in engine.run(Request(**req, stretch=True)) if isinstance(e, Image))
    assert (img.width, img.height) == (314, 209) and isinstance(img.data, Resized)
    want = np.asarray(PILImage.fromarray(np.asarray(img.data._pixels)).resize((314, 209), PILImage.LANCZOS))
    assert np.array_equal(np.asarray(img.data), want)
    assert PILImage.open(io.BytesIO(img.png)).size == (314, 209)
    plain = next(e for e in engine.run(Request(**req)) if isinstance(e, Image))     # no stretch: its bucket
    assert (plain.width, plain.height) == (304, 208) and np.asarray(plain.data).shape == (208, 304, 3)


def test_an_aligned_edit_previews_at_its_final_aspect(tiny):
    """The step previews take the final image's aspect (at their own scale): with `stretch` the reference's,
    without it the bucket's (which the pooled latent, 19x13 -> 9x6, does not keep by itself), so the picture
    does not change shape when the image arrives."""
    ref = PILImage.fromarray(np.random.default_rng(1).integers(0, 256, (200, 280, 3), dtype=np.uint8))
    req = dict(prompt="make it blue", bot_task="image", size="208x304", steps=3, seed=3, images=[ref])
    engine = make_engine(tiny, preview_every=1, preview_share=1.0)
    for stretch, aspect in ((True, 303 / 216), (False, 304 / 208)):       # the final image's sizes
        events = list(engine.run(Request(**req, stretch=stretch)))
        previews = [np.asarray(PILImage.open(io.BytesIO(e.preview))) for e in events
                    if isinstance(e, Step) and e.preview_data is not None]
        assert previews, stretch
        for a in previews:
            h, w = a.shape[:2]
            assert abs(w / h - aspect) <= 1 / h, (stretch, w, h)    # within a row's rounding
        if stretch:
            assert isinstance(next(e for e in events if isinstance(e, Step) and e.preview_data is not None)
                              .preview_data, bytes)


def test_resized_pixels_are_read_only_when_asked_for_and_once():
    class Lazy:
        reads = 0

        def __array__(self, dtype=None, copy=None):
            Lazy.reads += 1
            return np.full((4, 6, 3), 7, np.uint8)
    r = Resized(Lazy(), (3, 2))
    assert Lazy.reads == 0
    assert np.asarray(r).shape == (2, 3, 3) and np.asarray(r).shape == (2, 3, 3) and Lazy.reads == 1


def test_done_timings_settle_when_first_read_and_before_they_travel():
    """On a GPU a request's Done carries timings of device work that the engine's loop must not wait for:
    they settle where first read (the worker's sender: `_encoded`, or any pickle), once."""
    calls = []

    def settle(t: Timings) -> None:
        calls.append(1)
        t.vae_ms, t.total_s = 12.5, 3.0
    done = Done(Timings(ar_tokens=9), "cot").later(settle)
    assert calls == []
    sent = pickle.loads(pickle.dumps(_encoded(EventOut(2, done))))
    assert calls == [1] and sent.event.timings.vae_ms == 12.5 and sent.event.timings.ar_tokens == 9
    assert done.timings.total_s == 3.0 and calls == [1] and sent.event == done

    def broken(t: Timings) -> None:
        raise RuntimeError("CUDA error: an illegal memory access")
    failed = _encoded(EventOut(3, Done(Timings(), "").later(broken)))
    assert isinstance(failed.event, Error) and "timings could not be read" in failed.event.message


def test_a_message_that_cannot_be_sent_fails_only_its_request_and_the_sender_goes_on(capsys):
    """A message the sender cannot write (it does not pickle) must not end the sender's thread: every later
    request would wait on an engine that still runs. Its request gets an Error; another kind is reported."""
    import multiprocessing

    from engine.runtime.events import Text
    from engine.serve.messages import Stats
    from engine.serve.worker import Sender
    read, write = multiprocessing.Pipe(duplex=False)
    sender = Sender(write)
    sender.put(EventOut(1, Text(lambda: "no pickle", "think")))
    sender.put(Stats([{"rank": lambda: 0}]))
    sender.put(EventOut(2, Text("fine", "think")))
    sender.close(timeout=10)
    got = [read.recv() for _ in range(2) if read.poll(10)]
    assert len(got) == 2, got
    assert got[0].seq == 1 and isinstance(got[0].event, Error) and got[0].event.kind == "engine"
    assert "could not send" in got[0].event.message
    assert got[1].seq == 2 and got[1].event == Text("fine", "think") and not read.poll(0.2)
    assert "Stats message was dropped" in capsys.readouterr().err and not sender.broken
