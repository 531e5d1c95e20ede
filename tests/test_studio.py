"""The studio through its public API: gradio_client against an in-process launch on a real tiny
checkpoint, plus the pure helpers behind the controls."""
from __future__ import annotations

import io
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image as PILImage

from engine.checkpoint.buckets import parse_size
from engine.serve.image_meta import read_record
from engine.runtime.events import Done, Error, Text, Timings
from engine.runtime.events import Image as ImageEvent
from engine.serve.info import ModelInfo
from engine import EMBEDDED_MODEL
from engine.runtime.request import MAX_PROMPT_CHARS, SEED_RANGE, STEPS_RANGE, RequestError
from studio_fixtures import (ScriptedClient, engine_server, fast_request, final, launch_studio,  # noqa: F401
                             settings, start_server, studio, wait_for)
from webui.options import Settings, aspect_label, build_request, control_of, size_choices
from webui.runner import CotLog, timings_text

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402
from gradio_client.exceptions import AppError, AuthenticationError, ValidationError  # noqa: E402

STATUS, IMAGE, TIMINGS, COT = range(4)
README = Path(__file__).resolve().parents[1] / "README.md"


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
    """CoT deltas come before the first step; the canvas shows step previews while denoising, then the
    final image, a PNG of `size`."""
    statuses = [o[STATUS] for o in outputs]
    first_cot = next(i for i, o in enumerate(outputs) if is_set(o[COT]))
    first_step = next(i for i, s in enumerate(statuses) if isinstance(s, str) and s.startswith("step "))
    assert first_cot < first_step, statuses
    previews = [o[IMAGE] for o in outputs[first_step:-1] if is_set(o[IMAGE])]
    assert previews, "no step preview on the canvas"
    cots = [o[COT] for o in outputs if is_set(o[COT])]
    assert len(cots) >= 2 and cots[-1].startswith(cots[0]), "reasoning did not stream"
    last = outputs[-1]
    assert last[STATUS].startswith("Done")
    img = PILImage.open(last[IMAGE])
    assert img.format == "PNG" and img.size == size
    assert PILImage.open(previews[-1]).size == size        # the preview is drawn at the image's shape
    assert "ms/token" in last[TIMINGS] and "ms/step" in last[TIMINGS] and "total" in last[TIMINGS]


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


def test_an_edit_keeps_the_first_references_aspect_when_asked(client, tmp_path):
    """The edit tab's "Keep the first reference's aspect" (the official align option): a 300x200 reference in
    the 304x208 bucket gives a 314x209 image; unticked (and from a client that does not send it) the bucket's."""
    ref = tmp_path / "wide.png"
    PILImage.new("RGB", (300, 200), (30, 160, 30)).save(ref)
    from webui.options import NO_LORA
    kept = client.predict("make it red", gallery([str(ref)]), *settings(size="304:208"), "none", NO_LORA, 1.0, True,
                          api_name="/ti2i")
    assert kept[STATUS].startswith("Done") and PILImage.open(kept[IMAGE]).size == (314, 209)
    plain = client.predict("make it red", gallery([str(ref)]), *settings(size="304:208"), api_name="/ti2i")
    assert plain[STATUS].startswith("Done") and PILImage.open(plain[IMAGE]).size == (304, 208)


def test_stop_cancels_and_the_next_request_runs(client, studio, engine_server):
    job = client.submit("a long one", *settings(steps=80), api_name="/t2i")
    run_until_step(job)
    assert job.cancel()
    wait_for(lambda: engine_server.health()["state"] == "ready", 30)   # the engine stopped, not just the UI
    result = client.predict("the next one", *settings(), api_name="/t2i")
    assert result[STATUS].startswith("Done")


def test_the_step_cache_runs_from_the_page_and_old_clients_still_work(client, studio):
    """The "Faster (step cache)" control through the page's API: the engine gets the setting (the timings
    say how many steps ran in full); a bad name is refused on the control before queueing; a client that
    sends the nine settings of before (no step cache) still runs, without one."""
    _, counting, _ = studio
    result = client.predict("a red circle", *settings(steps=7), "taylor", api_name="/t2i")
    assert result[STATUS].startswith("Done") and "7 steps (2 in full)" in result[TIMINGS].replace("**", "")
    assert counting.submitted[-1].taylor_cache is not None
    before = len(counting.submitted)
    with pytest.raises(ValidationError, match="Step cache setting 'fastest'"):
        client.predict("a red circle", *settings(), "fastest", api_name="/t2i")
    assert len(counting.submitted) == before
    assert client.predict("a red circle", *settings(), api_name="/t2i")[STATUS].startswith("Done")
    assert counting.submitted[-1].taylor_cache is None and counting.submitted[-1].block_cache is None


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
    with pytest.raises(ValidationError, match="cannot be read") as e:
        client.predict("edit me", gallery([str(bad)]), *settings(), api_name="/ti2i")
    assert "bad.png" in str(e.value) and "/tmp" not in str(e.value) and "gradio" not in str(e.value)
    assert len(counting.submitted) == before          # nothing reached the engine


@pytest.mark.parametrize("field,value,words", [
    ("steps", 0, f"steps must be an integer from {STEPS_RANGE[0]} to {STEPS_RANGE[1]} (got 0)"),
    ("steps", 10000, f"steps must be an integer from {STEPS_RANGE[0]} to {STEPS_RANGE[1]} (got 10000)"),
    ("guidance", -1, "guidance must be a number from 0 to 30 (got -1.0)"),
    ("size", "banana", "size 'banana' is not understood"),
    ("seed", -5, f"seed must be a whole number from 0 to {SEED_RANGE[1]} (got -5)"),
    ("seed", 2 ** 70, f"(got {2 ** 70})"),
    ("mode", "dream", "unknown reasoning mode (bot_task) 'dream'; choose one of image"),
    ("max_new_tokens", 0, "max_new_tokens must be an integer from 1 to 8192 (got 0)"),
    ("system_prompt", "nope", "unknown system prompt preset 'nope'; choose one of en_unified"),
])
def test_bad_values_through_the_api_name_the_field_and_its_range(client, studio, field, value, words):
    """Each bad value is refused before it is queued, on its own parameter, with the valid range (Gradio's
    own range and choice checks used to answer a bare 400)."""
    _, counting, _ = studio
    before = len(counting.submitted)
    with pytest.raises(ValidationError) as e:
        client.predict("a red circle", *settings(random_seed=False, **{field: value}), api_name="/t2i")
    assert f"- {field}:" in str(e.value) and words.lower() in str(e.value).lower(), str(e.value)
    assert len(counting.submitted) == before


def test_a_long_prompt_is_refused_not_cut(client):
    with pytest.raises(ValidationError, match=f"too long \\(10000 characters; the limit is {MAX_PROMPT_CHARS}\\)"):
        client.predict("x" * 10000, *settings(), api_name="/t2i")


def test_the_size_grammar_of_the_engine_works_through_the_api(client):
    """HxW (height first) and W:H name the bucket of that shape, as on the command line."""
    assert PILImage.open(client.predict("a red circle", *settings(size="192x256"), api_name="/t2i")[IMAGE]).size \
        == (256, 192)


def test_max_queue_holds_for_requests_arriving_together(client, engine_server):
    """With one request running and max_queue 8, 14 more sent at once: 8 wait, 6 are refused at once with
    the reason (the page's queue used to take them all: its size check ran before each validator's
    await, so simultaneous arrivals all passed it). The engine server's queue is the only one."""
    engine_server.max_queue = 8
    jobs = []
    try:
        jobs.append(client.submit("running", *settings(mode="image", steps=100), api_name="/t2i"))
        run_until_step(jobs[0])
        with ThreadPoolExecutor(14) as pool:
            jobs += pool.map(lambda i: client.submit(f"crowd {i}", *settings(mode="image", steps=100),
                                                     api_name="/t2i"), range(14))
        wait_for(lambda: sum(j.done() for j in jobs) >= 6, 60)
        time.sleep(0.5)
        refused = []
        for j in jobs:
            if j.done():
                with pytest.raises(AppError, match="^Not queued: the queue is full") as e:
                    j.result()
                refused.append(str(e.value))
        assert len(refused) == 6, refused
        assert all("(8 requests waiting)" in r for r in refused), refused
        assert engine_server.health()["queue"] == 8
    finally:
        engine_server.max_queue = None
        for j in jobs:
            cancel_patiently(j)
    wait_for(lambda: engine_server.health()["state"] == "ready" and engine_server.health()["queue"] == 0, 60)


def test_a_full_queue_counts_the_waiting_in_words(engine_server):
    """Issue 43 item 10: one waiting request is "1 request waiting" (it read "1 requests waiting")."""
    from engine.runtime.events import Error as ErrorEvent, Started
    engine_server.max_queue = 1
    subs = []
    try:
        subs.append(engine_server.submit(fast_request("running", bot_task="image", steps=100)))
        assert isinstance(subs[0].get(timeout=60), Started)
        subs.append(engine_server.submit(fast_request("waiting")))
        ev = final(list(engine_server.submit(fast_request("one too many"))))
        assert isinstance(ev, ErrorEvent) and ev.kind == "busy", ev
        assert "the queue is full (1 request waiting)" in ev.message, ev.message
    finally:
        engine_server.max_queue = None
        for sub in subs:
            sub.cancel()
    wait_for(lambda: engine_server.health()["state"] == "ready" and engine_server.health()["queue"] == 0, 60)


def cancel_patiently(job, tries: int = 4) -> None:
    """Cancel a gradio_client job, trying again where the page answers too slowly: with a step running
    and eight waiting on CI's busy cores, one cancel call once timed out in gradio_client's HTTP request."""
    import httpx
    for i in range(tries):
        try:
            job.cancel()
            return
        except httpx.TimeoutException:
            if i == tries - 1:
                raise
            time.sleep(1)


def test_random_seed_is_reported(client):
    result = client.predict("a square", *settings(random_seed=True, seed=0), api_name="/t2i")
    assert "seed" in result[TIMINGS]


def test_killed_worker_shows_an_error_and_the_next_request_works(client, engine_server):
    job = client.submit("doomed", *settings(steps=80), api_name="/t2i")
    run_until_step(job)
    os.kill(engine_server.health()["worker_pids"][0], signal.SIGKILL)
    with pytest.raises(AppError, match="^Generation failed: .*restarting"):
        job.result(timeout=60)
    result = client.predict("after the crash", *settings(), api_name="/t2i")   # waits for the reload
    assert result[STATUS].startswith("Done")


def readme_api_example() -> str:
    """The README's client example (the python block of the Studio section that uses gradio_client)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if "gradio_client" in b]
    assert len(found) == 1, "the README should have one gradio_client example"
    return found[0]


@pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="no embedded model in assets/")
def test_the_readme_api_example_runs_as_written(tmp_path_factory, tmp_path, monkeypatch):
    """On the model `python app.py` serves (the embedded one), with the page's defaults: only the
    address is changed, to where this test's studio listens."""
    server = start_server(EMBEDDED_MODEL)
    url, counting, demo = launch_studio(server, tmp_path_factory)
    try:
        code = readme_api_example()
        assert "http://127.0.0.1:7860/" in code
        monkeypatch.chdir(tmp_path)
        scope: dict = {}
        exec(compile(code.replace("http://127.0.0.1:7860/", url), "README.md", "exec"), scope)
        assert [r.images for r in counting.submitted][-2:][0] == [] and len(counting.submitted[-1].images) == 1
        assert scope["status"].startswith("Done") and PILImage.open(scope["image"]).format == "PNG"
        scope["c"].close()
    finally:
        demo.close()
        server.close()


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
    assert aspect_label(368, 144) == "about 5:2" and aspect_label(144, 560) == "about 1:4"  # never "≈1:3.88"


def test_build_request_and_error_routing():
    s = Settings("think", "256:192", 12.0, False, 3.0, 4.5, "custom", "be brief", 16.0)
    req = build_request("a cat", ["a.png"], s)
    assert (req.seed, req.steps, req.max_new_tokens, req.bot_task) == (12, 3, 16, "think")
    assert req.custom_system_prompt == "be brief" and req.images == ["a.png"]
    r = build_request("a cat", [], Settings("image", "auto", -5, True, 3, 4.5, "en_unified", "ignored", 16))
    assert r.custom_system_prompt is None and SEED_RANGE[0] <= r.seed <= SEED_RANGE[1]
    assert build_request("a cat", [], Settings("image", "auto", -5, True, 3, 4.5, "en_unified", "", 16),
                         for_check=True).seed == -5        # the validator judges what the box holds
    controls = ("prompt", "images", *Settings.NAMES)
    assert control_of("bot_task", controls) == "mode" and control_of("steps", controls) == "steps"
    assert control_of("images", controls[:1] + controls[2:]) == "prompt"   # T2I has no images control
    assert control_of(None, controls) == "prompt"


def test_the_step_cache_choice_reaches_the_request():
    """The page's "Faster (step cache)" choices are the engine's named settings; a bad one is an error on
    that control, as is an engine error about one of its fields."""
    from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
    from webui.options import STEP_CACHES
    base = ("think", "auto", 1, False, 12, 4.5, "en_unified", "", 16)
    assert [v for _, v in STEP_CACHES][0] == "none" and Settings(*base).step_cache == "none"
    plain = build_request("a cat", [], Settings(*base))
    assert plain.taylor_cache is None and plain.block_cache is None
    assert build_request("a cat", [], Settings(*base, "taylor")).taylor_cache == TaylorCacheParams()
    assert build_request("a cat", [], Settings(*base, "block")).block_cache == BlockCacheParams()
    with pytest.raises(RequestError) as e:
        build_request("a cat", [], Settings(*base, "fastest"))
    assert e.value.field == "step_cache" and "'fastest'" in str(e.value)
    controls = ("prompt", *Settings.NAMES)
    assert control_of("taylor_cache_interval", controls) == control_of("block_cache_threshold", controls) == "step_cache"


def test_cot_log_titles_sections_and_timings_text():
    log = CotLog()
    for d, sec in (("a", "think"), ("b", "think"), ("c", "recaption")):
        log.add(Text(d, sec))
    assert log.text == "[Thinking]\nab\n\n[Recaption]\nc" and log.chars == 3
    t = Timings(ar_prefill_ms=10, ar_tokens=8, ar_ms_per_token=2.5, dit_steps=2, dit_ms_per_step=100,
                vae_ms=50, total_s=1.23)
    text = timings_text(Done(t), ImageEvent(b"", 256, 192, 7))
    assert text == ("reasoning 8 tokens at 2.5 ms/token (prompt read in 10 ms) · denoising 2 steps at 100 ms/step · "
                    "image decoded in 50 ms · engine total 1.23 s · 256 × 192, seed 7")
    off = timings_text(Done(Timings(ar_prefill_ms=12, ar_tokens=1, dit_steps=2, dit_ms_per_step=100, total_s=1)),
                       None)         # reasoning off: only the size token is sampled
    assert "ms/token" not in off and "prompt read and size chosen in 12 ms" in off


def test_advice_warns_without_stopping(engine_server, tmp_path):
    from webui.studio import Studio
    handlers = Studio(engine_server, engine_server.info, tmp_path)
    s = Settings("think", "auto", 0, True, 2, 1.0, "custom", "", 8)
    advice = " ".join(handlers.advice(s))
    assert "Guidance" in advice and "custom system prompt is empty" in advice
    wait_for(lambda: engine_server.health()["state"] == "ready", 60)
    assert handlers.advice(Settings("think", "auto", 0, True, 2, 5.0, "en_unified", "", 8)) == []


def test_engine_line_shows_the_attempt_and_a_failed_engine_with_a_way_back(studio):
    """The page's engine line: the restart attempt and its wait; for a failed engine the reason and a
    button whose endpoint (`/gradio_api/run/reload`) reloads the model; on a running engine it does nothing."""
    import httpx
    from webui.studio import health_line
    line = health_line({"state": "restarting", "model_name": "m", "device": "cpu", "attempt": 3,
                        "restart_in_s": 2.0, "last_error": "the engine process stopped unexpectedly (SIGKILL)"})
    assert "attempt 3, next start in 2 s" in line and "SIGKILL" in line and "engine-reload" not in line
    line = health_line({"state": "failed", "model_name": "m", "device": "cpu", "attempt": 0,
                        "last_error": "the engine could not load the model: <shard> missing"})
    assert "could not load the model: &lt;shard&gt; missing" in line and 'class="engine-reload"' in line
    w4a8 = {"experts": "humming-fp8", "mxfp8": "triton", "text": "experts on humming-fp8 (W4A8)"}
    line = health_line({"state": "ready", "model_name": "m", "device": "cuda:0", "kernels": w4a8})
    assert line.endswith("cuda:0 · experts on humming-fp8 (W4A8)")      # the numerics that ran, said on the page
    ours = {"experts": "triton", "mxfp8": "triton", "text": ""}
    assert health_line({"state": "ready", "device": "cpu", "kernels": ours}).endswith("· cpu")
    url, _, _ = studio
    r = httpx.post(url.rstrip("/") + "/gradio_api/run/reload", json={"data": []}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0] == {"reloading": False}      # the engine is not failed
    h = httpx.post(url.rstrip("/") + "/gradio_api/run/health", json={"data": []}, timeout=30).json()["data"][0]
    assert h["state"] in ("ready", "busy") and h["attempt"] == 0


# ------------------------------------------------------------------ what a new user met (issue 29)
def test_the_studio_queue_idles_without_polling_every_millisecond(tiny_dir, tmp_path):
    """Issue 43 item 10: Gradio's queue loop polled every 1 ms while idle (3-5% of a core with nothing to do);
    the studio's polls every 20 ms (its progress loop, unused, every 100 ms)."""
    from webui.launching import PROGRESS_POLL_S, QUEUE_IDLE_POLL_S
    from webui.studio import build_studio
    demo = build_studio(ScriptedClient([]), ModelInfo.from_folder(tiny_dir), out_dir=tmp_path / "out",
                        examples_dir=tmp_path / "ex")
    assert demo._queue.sleep_when_free == QUEUE_IDLE_POLL_S >= 0.02
    assert demo._queue.progress_update_sleep_when_free == PROGRESS_POLL_S >= 0.1


def test_previews_are_spaced_by_the_engines_step_time():
    """Issue 43 item 9: the page shows the first preview, then one per PREVIEW_GAP_S of denoising: every step of
    a slow model, every few of a fast one (a preview costs the page about the same whatever a step costs)."""
    from engine.runtime.events import Step
    from webui.runner import PREVIEW_GAP_S, PreviewRate

    def shown(step_s: float, n: int = 16) -> list[int]:
        rate = PreviewRate()
        return [i for i in range(1, n) if rate.due(Step(i, n, b"png"), i * step_s)]
    assert shown(PREVIEW_GAP_S) == list(range(1, 16))          # a slow model's steps: all of them
    every = -(-PREVIEW_GAP_S // 0.04)                           # ceil: a 40 ms step of the embedded model
    assert shown(0.04) == list(range(1, 16, int(every))) and len(shown(0.04)) <= 4
    assert PreviewRate().due(Step(1, 2, b"png"), None)         # the first always (a 2-step run has one)
    assert not PreviewRate().due(Step(1, 2, None), 0.1)        # a step the engine did not preview


def test_timings_are_plain_text():
    """The API's timings string is read as it is (it used to carry Markdown's ** around each label)."""
    t = Timings(ar_prefill_ms=10, ar_tokens=8, ar_ms_per_token=2.5, dit_steps=2, dit_ms_per_step=100,
                vae_ms=50, total_s=1.23)
    text = timings_text(Done(t), ImageEvent(b"", 256, 192, 7))
    assert "*" not in text and text.startswith("reasoning 8 tokens at 2.5 ms/token")
    # plain words (issue 43 item 6): no phase names nor the forced tokens ("AR ... + 4 forced (prefill 72 ms)")
    line = Timings(ar_prefill_ms=72, ar_tokens=30, ar_forced=4, ar_ms_per_token=7.3, dit_steps=8,
                   dit_ms_per_step=42, vae_ms=35, total_s=1.3).summary()
    assert not any(w in line for w in ("AR", "DiT", "VAE", "forced", "prefill")), line


def test_the_queue_line_counts_the_others_and_estimates_from_measured_runs():
    """A request in line is told how many wait ahead of it (never itself), how many run, and, once the
    studio has finished runs, a wait estimated from their measured durations; "Done in" counts the wait."""
    from webui.runner import RecentRuns, RunClock, done_status, waiting_status
    busy = {"state": "busy", "running": 1, "queue": 1}       # the engine's counts include this request
    assert waiting_status(busy, 0) == "Next in line (1 running)…"
    recent = RecentRuns(keep=2)
    for s in (9.0, 3.0, 5.0):
        recent.add(s)
    assert recent.mean() == 4.0                               # the last two only
    assert waiting_status(busy, 2, recent) == \
        "In line: 2 ahead of you (1 running) · about 12 s to start (recent runs took 4.0 s each)…"
    assert waiting_status(busy, None) == "Starting…"          # not in the line: being admitted
    assert "loading the model" in waiting_status({"state": "loading"}, 0)
    clock = RunClock(100.0, started=103.0, sized=104.5, image_wait_s=20.0)
    assert done_status(clock, 127.25) == \
        "Done in 27.2 s: 3.0 s waiting for a slot, 1.5 s reasoning, 20.0 s waiting for the image ahead, 2.8 s denoising"
    assert done_status(RunClock(0.0, started=0.01, sized=0.02, reasons=False), 2.0) == "Done in 2.0 s"
    assert done_status(RunClock(0.0, started=0.01, sized=0.5, reasons=False), 2.0) == \
        "Done in 2.0 s: 0.5 s reading the prompt, 1.5 s denoising"


def _png(size=(8, 6)) -> bytes:
    import io
    buf = io.BytesIO()
    PILImage.new("RGB", size, (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


def test_the_seed_box_takes_the_seed_of_the_image_event(tiny_dir, tmp_path):
    """The studio reads the seed from the engine's Image event (it used to parse it back out of the
    timings text); the final outputs carry it for the seed box."""
    import asyncio
    from engine.runtime.events import Started
    from webui.studio import Studio
    info = ModelInfo.from_folder(tiny_dir)
    events = [Started("r", "image", "auto", 2, 5.0), ImageEvent(_png(), 8, 6, seed=4242), Done(Timings(total_s=0.5))]
    studio_ = Studio(ScriptedClient(events), info, tmp_path)

    async def collect():
        s = Settings(*settings(random_seed=True))
        return [o async for o in studio_.generate("a cat", None, s)]

    outs = asyncio.run(collect())
    status, canvas, timings, _, result, record = outs[-1]
    assert status.startswith("Done in") and record["seed"] == 4242 and "seed 4242" in timings
    assert PILImage.open(result).tobytes() == PILImage.open(io.BytesIO(_png())).tobytes() and canvas == result
    assert read_record(Path(result).read_bytes()) == record and Studio.used_seed(record) == 4242


def test_an_engine_failure_stays_in_the_status_box(tiny_dir, tmp_path):
    """The failure's message is written to the Status box before the toast is raised (the toast hides
    after a few seconds; the box kept only a red "Error" badge)."""
    import asyncio
    import gradio as gr
    from engine.runtime.events import Started
    from webui.studio import Studio
    events = [Started("r", "image", "auto", 2, 5.0), Error("engine", "the engine process stopped unexpectedly (SIGKILL)")]
    studio_ = Studio(ScriptedClient(events), ModelInfo.from_folder(tiny_dir), tmp_path)
    outs = []

    async def collect():
        async for o in studio_.generate("a cat", None, Settings(*settings())):
            outs.append(o)

    with pytest.raises(gr.Error, match="Generation failed: the engine process stopped"):
        asyncio.run(collect())
    assert outs[-1][STATUS] == "Generation failed: the engine process stopped unexpectedly (SIGKILL)"


def test_reference_limits_are_the_apis(tmp_path):
    """A reference image is held to /v1's limits (16.7 MP, from the header, before decoding) and must
    be readable; each message names the file, never the server's path."""
    from engine.serve.openai_params import UploadLimits
    from webui.references import check_reference
    big = tmp_path / "huge-6000.png"
    PILImage.new("RGB", (6000, 6000), (9, 9, 9)).save(big)
    msg = check_reference(big)
    assert msg is not None and "huge-6000.png" in msg and "6000x6000" in msg and \
        str(UploadLimits().max_pixels) in msg and str(tmp_path) not in msg
    bad = tmp_path / "holiday.jpg"
    bad.write_bytes(b"\xff\xd8 not really a jpeg")
    assert check_reference(bad) == "holiday.jpg cannot be read as an image"
    ok = tmp_path / "fine.png"
    PILImage.new("RGB", (64, 48)).save(ok)
    assert check_reference(ok) is None
    from webui.studio import Studio
    kept = Studio.checked_references([(str(ok), None), (str(bad), None)])
    assert kept == [(str(ok), None)]                          # the bad one leaves the gallery at upload


def test_a_huge_reference_is_refused_on_its_field_before_queueing(client, studio, tmp_path):
    _, counting, _ = studio
    big = tmp_path / "big.png"
    PILImage.new("RGB", (6000, 6000), (9, 9, 9)).save(big)
    before = len(counting.submitted)
    with pytest.raises(ValidationError, match="big.png is 6000x6000"):
        client.predict("make it red", gallery([str(big)]), *settings(), api_name="/ti2i")
    assert len(counting.submitted) == before
