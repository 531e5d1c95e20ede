"""The studio through its public API: gradio_client against an in-process launch on a real tiny
checkpoint, plus the pure helpers behind the controls."""
from __future__ import annotations

import os
import signal
import time

import pytest
from PIL import Image as PILImage

from engine.spec.buckets import parse_size
from engine.runtime.events import Done, Text, Timings
from engine.runtime.events import Image as ImageEvent
from engine.serve.info import ModelInfo
from studio_fixtures import (engine_server, settings, studio, wait_for)  # noqa: F401
from webui.options import Settings, aspect_label, build_request, field_of, size_choices
from webui.runner import CotLog, timings_text

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError, AuthenticationError, ValidationError  # noqa: E402

STATUS, PREVIEW, IMAGE, DOWNLOAD, TIMINGS, COT = range(6)


@pytest.fixture(scope="module")
def client(studio):
    url, _, _ = studio
    c = Client(url, verbose=False)
    yield c
    c.close()


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refs")
    paths = []
    for i, color in enumerate(((200, 30, 30), (30, 200, 30), (30, 30, 200))):
        p = folder / f"ref{i}.png"
        PILImage.new("RGB", (96 + 32 * i, 128), color).save(p)
        paths.append(str(p))
    return paths


def gallery(paths):
    return [{"image": handle_file(p), "caption": None} for p in paths]


def is_set(v) -> bool:
    """A real value, not gr.skip() ({'__type__': 'update'}) and not empty."""
    return bool(v) and not (isinstance(v, dict) and v.get("__type__") == "update")


def check_stream(outputs, size=(256, 192)):
    """CoT deltas come before the first step, the final image after it, and it is a PNG of `size`."""
    statuses = [o[STATUS] for o in outputs]
    first_cot = next(i for i, o in enumerate(outputs) if is_set(o[COT]))
    first_step = next(i for i, s in enumerate(statuses) if isinstance(s, str) and s.startswith("step "))
    first_image = next(i for i, o in enumerate(outputs) if is_set(o[IMAGE]))
    assert first_cot < first_step < first_image, statuses
    assert any(is_set(o[PREVIEW]) for o in outputs[first_step:first_image]), "no step preview"
    cots = [o[COT] for o in outputs if is_set(o[COT])]
    assert len(cots) >= 2 and cots[-1].startswith(cots[0]), "reasoning did not stream"
    last = outputs[-1]
    assert last[STATUS].startswith("Done")
    img = PILImage.open(last[IMAGE])
    assert img.format == "PNG" and img.size == size
    assert "ms/token" in last[TIMINGS] and "ms/step" in last[TIMINGS] and "total" in last[TIMINGS]
    assert is_set(last[DOWNLOAD])


def run_until_step(job, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        outs = job.outputs()
        if any(isinstance(o[STATUS], str) and o[STATUS].startswith("step ") for o in outs):
            return
        if job.done():
            raise AssertionError(f"finished before a step: {outs[-1] if outs else job.status()}")
        time.sleep(0.02)
    raise AssertionError("no step event in time")


# ------------------------------------------------------------------ end to end through gradio_client
def test_t2i_streams_cot_then_steps_then_png(client):
    job = client.submit("a red circle on white", *settings(size="256:192"), api_name="/t2i")
    outputs = list(job)
    assert outputs, job.status()
    check_stream(outputs, size=(256, 192))


@pytest.mark.parametrize("n", [1, 3])
def test_ti2i_with_reference_images(client, refs, n):
    job = client.submit("make it blue", gallery(refs[:n]), *settings(size="192:256"), api_name="/ti2i")
    outputs = list(job)
    check_stream(outputs, size=(192, 256))


def test_stop_cancels_and_the_next_request_runs(client, studio, engine_server):
    job = client.submit("a long one", *settings(steps=80), api_name="/t2i")
    run_until_step(job)
    assert job.cancel()
    wait_for(lambda: engine_server.health()["state"] == "ready", 30)   # the engine stopped, not just the UI
    result = client.predict("the next one", *settings(), api_name="/t2i")
    assert result[STATUS].startswith("Done")


def test_validation_errors_reach_the_client_without_queueing(client, studio, refs, tmp_path):
    _, counting, _ = studio
    before = len(counting.submitted)
    with pytest.raises(ValidationError, match="prompt is empty"):
        client.predict("   ", *settings(), api_name="/t2i")
    with pytest.raises(ValidationError, match="reference images"):
        client.predict("edit me", [], *settings(), api_name="/ti2i")
    with pytest.raises(ValidationError, match="at most 3"):
        client.predict("edit me", gallery(refs + refs[:1]), *settings(), api_name="/ti2i")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not an image")
    with pytest.raises(ValidationError, match="cannot be read"):
        client.predict("edit me", gallery([str(bad)]), *settings(), api_name="/ti2i")
    assert len(counting.submitted) == before          # nothing reached the engine


def test_random_seed_is_reported(client):
    result = client.predict("a square", *settings(random_seed=True, seed=0), api_name="/t2i")
    assert "seed" in result[TIMINGS]


def test_killed_worker_shows_an_error_and_the_next_request_works(client, engine_server):
    job = client.submit("doomed", *settings(steps=80), api_name="/t2i")
    run_until_step(job)
    os.kill(engine_server.health()["worker_pids"][0], signal.SIGKILL)
    with pytest.raises(AppError, match="restarting"):
        job.result(timeout=60)
    result = client.predict("after the crash", *settings(), api_name="/t2i")   # waits for the reload
    assert result[STATUS].startswith("Done")


def test_auth_refuses_a_client_without_credentials(engine_server, tmp_path):
    from webui.studio import build_studio, launch
    demo = build_studio(engine_server, engine_server.info, out_dir=tmp_path / "out", examples_dir=tmp_path / "ex")
    _, url, _ = launch(demo, host="127.0.0.1", auth=("alice", "s3cret"), prevent_thread_lock=True, quiet=True)
    try:
        with pytest.raises((AuthenticationError, ValueError)):
            Client(url, verbose=False)
        with pytest.raises((AuthenticationError, ValueError)):
            Client(url, auth=("alice", "wrong"), verbose=False)
        ok = Client(url, auth=("alice", "s3cret"), verbose=False)
        assert "/t2i" in ok.view_api(return_format="dict", print_info=False)["named_endpoints"]
        ok.close()
    finally:
        demo.close()


# ------------------------------------------------------------------ the helpers behind the controls
def test_size_choices_are_width_first_and_map_to_their_bucket(tiny_dir):
    buckets = ModelInfo.from_folder(tiny_dir).buckets
    choices = size_choices(buckets)
    assert choices[0][1] == "auto" and len(choices) == len(buckets) + 1
    for label, value in choices[1:]:
        w, h = (int(x) for x in value.split(":"))
        assert label.startswith(f"{w} × {h}")
        b = parse_size(value, buckets)
        assert (b.width, b.height) == (w, h)
    assert aspect_label(256, 192) == "4:3" and aspect_label(192, 256) == "3:4"
    assert aspect_label(368, 144).startswith("≈")


def test_build_request_and_error_routing():
    s = Settings("think", "256:192", 12.0, False, 3.0, 4.5, "custom", "be brief", 16.0)
    req = build_request("a cat", ["a.png"], s)
    assert (req.seed, req.steps, req.max_new_tokens, req.bot_task) == (12, 3, 16, "think")
    assert req.custom_system_prompt == "be brief" and req.images == ["a.png"]
    r = build_request("a cat", [], Settings("image", "auto", 0, True, 3, 4.5, "en_unified", "ignored", 16))
    assert r.custom_system_prompt is None and 0 <= r.seed < 2 ** 31
    assert field_of("the prompt is empty: describe the image you want") == "prompt"
    assert field_of("4 reference images given; at most 3 are supported") == "images"
    assert field_of("reference image 2 cannot be read as an image") == "images"
    assert field_of("steps must be an integer in [1, 200] (got 0)") == "steps"
    assert field_of("unknown system prompt preset 'x'") == "system_prompt"
    assert field_of("size 'banana' is not understood") == "size"


def test_cot_log_titles_sections_and_timings_text():
    log = CotLog()
    for d, sec in (("a", "think"), ("b", "think"), ("c", "recaption")):
        log.add(Text(d, sec))
    assert log.text == "[Thinking]\nab\n\n[Recaption]\nc" and log.tokens == 3
    t = Timings(ar_prefill_ms=10, ar_tokens=8, ar_ms_per_token=2.5, dit_steps=2, dit_ms_per_step=100,
                vae_ms=50, total_s=1.23)
    text = timings_text(Done(t), ImageEvent(b"", 256, 192, 7))
    assert "2.5 ms/token" in text and "100 ms/step" in text and "1.23 s" in text and "seed 7" in text


def test_advice_warns_without_stopping(engine_server, tmp_path):
    from webui.studio import Studio
    handlers = Studio(engine_server, engine_server.info, tmp_path)
    s = Settings("think", "auto", 0, True, 2, 1.0, "custom", "", 8)
    advice = " ".join(handlers.advice(s))
    assert "Guidance" in advice and "custom system prompt is empty" in advice
    wait_for(lambda: engine_server.health()["state"] == "ready", 60)
    assert handlers.advice(Settings("think", "auto", 0, True, 2, 5.0, "en_unified", "", 8)) == []
