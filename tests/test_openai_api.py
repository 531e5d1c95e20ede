"""The OpenAI-compatible API, end to end: `python app.py` as a real process on the embedded model (the
page and the API on one server, one engine), driven by the official `openai` client; plus one
`--api-only` process, and a load test with clients that disconnect."""
from __future__ import annotations

import base64
import io
import os
import random
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image as PILImage

from bench.served import AppNotReady, ServedApp
from engine.serve.image_meta import read_record

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-key"
READY_TIMEOUT_S = 180
MAX_QUEUE = 8                 # the studio's default
UPLOAD_MB, UPLOAD_PIXELS = 0.25, 200_000
# cheap on a 2-core machine: no reasoning pass (explicit size, bot_task image), two steps
FAST = dict(num_inference_steps=2, bot_task="image", seed=11)
THINK = dict(bot_task="think", max_new_tokens=8, seed=3)
PATIENT_S = 600               # a client that does not give up: slowness is not loss
ROUNDS = 5                    # the soak's identical warm rounds, over which the worker's RSS slope is read


class App(ServedApp):
    """A `python app.py` process (bench/served.py) and the `openai` client the tests drive it with."""

    def wait_ready(self) -> None:
        try:
            super().wait_ready(READY_TIMEOUT_S)
        except AppNotReady as e:
            pytest.fail(str(e))

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", KEY),
                             max_retries=kw.pop("max_retries", 0), timeout=kw.pop("timeout", 120), **kw)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # one request at a time (--max-batch 1): the queue tests count the waiting ones behind a single runner
    a = App("--api-key", KEY, "--max-queue", str(MAX_QUEUE), "--max-batch", "1", "--max-upload-mb", str(UPLOAD_MB),
            "--max-upload-pixels", str(UPLOAD_PIXELS), log=tmp_path_factory.mktemp("app") / "app.log")
    try:
        a.wait_ready()
        yield a
    finally:
        a.stop()


@pytest.fixture(scope="module")
def client(app):
    c = app.client()
    yield c
    c.close()


def png_bytes(color, size=(96, 128), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, fmt)
    return buf.getvalue()


def decoded(b64: str) -> PILImage.Image:
    img = PILImage.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def wh(size: str) -> tuple[int, int]:
    w, h = size.split("x")
    return int(w), int(h)


# ---------------------------------------------------------------------------------------------- basics
def test_models_health_and_the_page_on_one_server(app, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["HunyuanImage-3.0-Instruct-Distil"]
    assert "256x256" in models.data[0].model_extra["sizes"]
    h = app.health()
    assert h["status"] == "ok" and h["state"] == "ready" and h["queue"] == 0 and h["max_queue"] == MAX_QUEUE
    assert h["kernels"] == {"experts": "triton", "mxfp8": "triton", "text": ""}    # what multiplies quantized weights
    assert h["scheduler"] == {"policy": "interleave", "decode_steps_per_denoise": 8, "lookahead": False}   # a CPU's
    page = httpx.get(app.url + "/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()       # the studio, same port


def test_generate_b64_png_of_the_reported_size(client):
    r = client.images.generate(prompt="a red circle on a white background", size="1024x768", extra_body=FAST)
    assert r.size == "256x192"                 # 4:3 snapped to the embedded model's bucket, width first
    assert len(r.data) == 1 and r.data[0].url is None
    img = decoded(r.data[0].b64_json)
    assert img.format == "PNG" and img.size == wh(r.size) == (256, 192)
    assert r.model_extra["seeds"] == [FAST["seed"]] and r.data[0].model_extra["seed"] == FAST["seed"]
    assert r.model_extra["timings"]["dit_steps"] == 2 and r.model_extra["timings"]["total_s"] > 0
    assert r.usage.output_tokens_details.image_tokens == (256 // 16) * (192 // 16)
    # the PNG says what made it (issue 43), as the page's do
    rec = read_record(base64.b64decode(r.data[0].b64_json))
    assert (rec["prompt"], rec["seed"], rec["steps"], rec["mode"], rec["size"], rec["step_cache"], rec["lora"]) == \
        ("a red circle on a white background", FAST["seed"], 2, "image", "256x192", "none", None)
    assert rec["model"] and rec["guidance"] == 2.5 and rec["timings"]["dit_steps"] == 2      # the checkpoint's guidance


def test_url_response_and_jpeg_output(client):
    r = client.images.generate(prompt="a blue square", size="256x256", response_format="url",
                               output_format="jpeg", extra_body=FAST)
    assert r.data[0].b64_json is None and r.data[0].url.startswith("data:image/jpeg;base64,")
    assert decoded(r.data[0].url.split(",", 1)[1]).format == "JPEG" and r.output_format == "jpeg"


def test_edit_with_two_images(client):
    r = client.images.edit(image=[("red.png", png_bytes((200, 30, 30)), "image/png"),
                                  ("blue.png", png_bytes((30, 30, 200), (128, 96)), "image/png")],
                           prompt="put the two shapes side by side", size="256x256", extra_body=FAST)
    img = decoded(r.data[0].b64_json)
    assert img.format == "PNG" and img.size == (256, 256) and r.size == "256x256"


def test_an_edit_can_keep_its_references_aspect(client):
    """`infer_align_image_size` (the official option): the reference is stretched into its bucket and the
    output resized to its aspect (a 300x200 reference in the 304x208 bucket: 314x209, about 256^2 pixels); the
    response, the PNG and its record say so. On generations (no reference) it is refused by name."""
    ref = ("ref.png", png_bytes((30, 160, 30), (300, 200)), "image/png")
    r = client.images.edit(image=ref, prompt="make it red", size="304x208",
                           extra_body=dict(FAST, infer_align_image_size=True))
    img = decoded(r.data[0].b64_json)
    assert img.size == (314, 209) and r.size == "314x209"
    rec = read_record(base64.b64decode(r.data[0].b64_json))
    assert rec["infer_align_image_size"] is True and rec["size"] == "314x209"
    plain = client.images.edit(image=ref, prompt="make it red", size="304x208", extra_body=FAST)
    assert decoded(plain.data[0].b64_json).size == (304, 208)
    assert read_record(base64.b64decode(plain.data[0].b64_json))["infer_align_image_size"] is False
    with pytest.raises(openai.BadRequestError) as bad:
        client.images.generate(prompt="a red circle", extra_body=dict(FAST, infer_align_image_size=True))
    assert bad.value.body["param"] == "infer_align_image_size" and "reference images" in bad.value.body["message"]


def test_n2_two_images_from_one_reasoning(client):
    r = client.images.generate(prompt="a yellow star", size="256x256", n=2,
                               extra_body=dict(THINK, num_inference_steps=2))
    assert len(r.data) == 2 and [d.model_extra["index"] for d in r.data] == [0, 1]
    assert r.model_extra["seeds"] == [THINK["seed"], THINK["seed"] + 1]
    a, b = (decoded(d.b64_json) for d in r.data)
    assert a.size == b.size == (256, 256) and a.tobytes() != b.tobytes()
    recs = [read_record(base64.b64decode(d.b64_json)) for d in r.data]
    assert [x["seed"] for x in recs] == [THINK["seed"], THINK["seed"] + 1] and recs[0]["reasoning"] == \
        r.model_extra["reasoning"] == recs[1]["reasoning"]
    assert r.model_extra["reasoning"]                       # one reasoning pass ...
    assert r.model_extra["timings"]["ar_tokens"] <= THINK["max_new_tokens"] + 2     # ... not one per image


# ---------------------------------------------------------------------------------------------- streaming
def test_streaming_order_reasoning_then_previews_then_completed(client):
    stream = client.images.generate(prompt="a green triangle", size="256x256", stream=True, partial_images=2,
                                    extra_body=dict(THINK, num_inference_steps=6, stream_reasoning=True))
    events = list(stream)
    types = [e.type for e in events]
    kinds = [t.split(".", 1)[1] for t in types]
    assert set(t.split(".")[0] for t in types) == {"image_generation"}
    assert kinds[0] == "reasoning.delta" and kinds[-1] == "completed" and kinds.count("completed") == 1
    last_reasoning = max(i for i, k in enumerate(kinds) if k == "reasoning.delta")
    partials = [i for i, k in enumerate(kinds) if k == "partial_image"]
    assert partials and 1 <= len(partials) <= 2 and last_reasoning < partials[0]
    assert [events[i].partial_image_index for i in partials] == list(range(len(partials)))
    text = "".join(e.delta for e in events if e.type.endswith("reasoning.delta"))
    assert text.strip()
    done = events[-1]
    assert decoded(done.b64_json).size == wh(done.size) == (256, 256)
    assert done.usage.output_tokens > 0 and done.model_extra["seed"] == THINK["seed"]
    rec = read_record(base64.b64decode(done.b64_json))
    assert rec["seed"] == THINK["seed"] and rec["steps"] == 6 and rec["reasoning"] == done.model_extra["reasoning"]


def test_the_sdks_typed_stream_is_right_by_default(client):
    """Without `stream_reasoning` an image stream holds only the events the official client types: each
    partial image carries its image, the completed event its usage with the input side; with it, the
    reasoning comes too (the SDK then hands those events over as partial-image objects without an image,
    which is why they are opt-in)."""
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
    events = list(client.images.generate(prompt="a green triangle", size="256x256", stream=True, partial_images=2,
                                         extra_body=dict(THINK, num_inference_steps=6)))
    assert events and all(isinstance(e, (ImageGenPartialImageEvent, ImageGenCompletedEvent)) for e in events)
    for e in events:
        assert isinstance(e.b64_json, str) and decoded(e.b64_json).format == "PNG", e.type     # previews are small
    done = events[-1]
    assert decoded(done.b64_json).size == (256, 256)
    assert isinstance(done, ImageGenCompletedEvent) and sum(isinstance(e, ImageGenCompletedEvent) for e in events) == 1
    assert done.usage.input_tokens == done.usage.input_tokens_details.text_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    opted = [e.type for e in client.images.generate(prompt="a green triangle", size="256x256", stream=True,
                                                    extra_body=dict(THINK, num_inference_steps=2,
                                                                    stream_reasoning=True))]
    assert opted[0] == "image_generation.reasoning.delta" and opted[-1] == "image_generation.completed"
    chat = client.chat.completions.create(model="HunyuanImage-3.0-Instruct-Distil", modalities=["image"],
                                          messages=[{"role": "user", "content": "a red circle"}],
                                          extra_body={"height": 256, "width": 256, **FAST})
    assert chat.usage.prompt_tokens > 0 and chat.usage.total_tokens == chat.usage.prompt_tokens + \
        chat.usage.completion_tokens


def test_streamed_edit_uses_the_edit_event_types(client):
    stream = client.images.edit(image=("red.png", png_bytes((200, 30, 30)), "image/png"), prompt="make it blue",
                                size="256x256", stream=True, partial_images=1,
                                extra_body=dict(FAST, num_inference_steps=3))
    types = [e.type for e in stream]
    assert types[-1] == "image_edit.completed" and all(t.startswith("image_edit.") for t in types)


def test_chat_completions_in_the_recipe_form(app, client):
    # the recipe's curl: `extra_body` sent literally, the image as a data URL in the message content
    body = {"modalities": ["image"], "messages": [{"role": "user", "content": "a purple diamond"}],
            "extra_body": {"height": 256, "width": 256, "num_inference_steps": 2, "guidance_scale": 2.5,
                           "seed": 5, "bot_task": "think", "max_new_tokens": 8}}
    r = httpx.post(app.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=120).json()
    url = r["choices"][0]["message"]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,") and decoded(url.split(",", 1)[1]).size == (256, 256)
    rec = read_record(base64.b64decode(url.split(",", 1)[1]))
    assert (rec["prompt"], rec["seed"], rec["mode"], rec["max_new_tokens"]) == ("a purple diamond", 5, "think", 8)
    assert r["choices"][0]["message"]["reasoning_content"] and r["object"] == "chat.completion"
    # the openai client's form: extra_body merged into the top level; an edit with a data-URL reference
    ref = "data:image/png;base64," + base64.b64encode(png_bytes((30, 200, 30))).decode()
    chat = client.chat.completions.create(
        model="HunyuanImage-3.0-Instruct-Distil", modalities=["image"],
        messages=[{"role": "user", "content": [{"type": "text", "text": "make it red"},
                                               {"type": "image_url", "image_url": {"url": ref}}]}],
        extra_body={"height": 256, "width": 256, **FAST})
    part = chat.choices[0].message.content[0]
    assert decoded(part["image_url"]["url"].split(",", 1)[1]).size == (256, 256)


def test_chat_stream_sends_reasoning_deltas_then_the_image(client):
    chunks = list(client.chat.completions.create(
        model="HunyuanImage-3.0-Instruct-Distil", modalities=["image"], stream=True, messages=[{"role": "user", "content": "an orange circle"}],
        extra_body={"height": 256, "width": 256, "num_inference_steps": 2, **THINK}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    reasoning = [c.choices[0].delta.model_extra.get("reasoning_content") for c in chunks[1:-1]]
    assert reasoning and all(reasoning)
    last = chunks[-1].choices[0]
    assert last.finish_reason == "stop" and last.delta.content[0]["image_url"]["url"].startswith("data:image/png")


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("field, kwargs", [
    ("num_inference_steps", dict(extra_body={"num_inference_steps": 0})),
    ("guidance_scale", dict(extra_body={"guidance_scale": 1e9})),
    ("seed", dict(extra_body={"seed": -1})),
    ("bot_task", dict(extra_body={"bot_task": "dream"})),
    ("use_system_prompt", dict(extra_body={"use_system_prompt": "pirate"})),
    ("size", dict(size="huge")),
    ("n", dict(n=99)),
    ("output_format", dict(output_format="gif")),
    ("partial_images", dict(stream=True, partial_images=7)),
    ("prompt", dict(prompt="   ")),
])
def test_bad_values_are_400_naming_the_field(app, client, field, kwargs):
    kwargs = {"prompt": "a red circle", **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(**kwargs)
    assert f"'{field}'" in e.value.message and e.value.body["param"] == field, e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    if field == "size":
        assert "256x256" in e.value.message                # the valid sizes are listed
    assert app.health()["queue"] == 0                        # nothing was queued


def test_bad_edit_uploads(client):
    with pytest.raises(openai.BadRequestError, match="'image'.*at most 3"):
        client.images.edit(image=[("a.png", png_bytes((1, 2, 3)), "image/png")] * 4, prompt="x")
    with pytest.raises(openai.BadRequestError, match="'image'.*cannot be read"):
        client.images.edit(image=("a.png", b"not an image", "image/png"), prompt="x")
    big = os.urandom(int(UPLOAD_MB * 1024 * 1024) + 1)
    with pytest.raises(openai.APIStatusError) as e:
        client.images.edit(image=("big.png", big, "image/png"), prompt="x")
    assert e.value.status_code == 413 and "bytes" in e.value.message
    # a small file that declares more pixels than allowed is refused from its header, before decoding
    wide = png_bytes((0, 0, 0), (1000, 1000))
    assert len(wide) < UPLOAD_MB * 1024 * 1024
    with pytest.raises(openai.APIStatusError) as e:
        client.images.edit(image=("wide.png", wide, "image/png"), prompt="x")
    assert e.value.status_code == 413 and "pixels" in e.value.message


def test_401_without_the_key(app):
    with pytest.raises(openai.AuthenticationError) as e:
        app.client(api_key="wrong").images.generate(prompt="a red circle")
    assert e.value.body["code"] == "invalid_api_key"
    no_key = httpx.post(app.url + "/v1/images/generations", json={"prompt": "a red circle"}, timeout=5)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(app.url + "/v1/models", timeout=5).status_code == 401
    assert httpx.get(app.url + "/health", timeout=5).status_code == 200      # probes need no key


def test_with_only_an_api_key_the_pages_api_needs_it_too(app):
    """--api-key alone: the page's Gradio API (uploads, /t2i) generates on the same engine and queue, so it
    asks for the key as well (any user name, the key as password); /health says what is protected."""
    from gradio_client import Client
    assert httpx.post(app.url + "/gradio_api/upload", files={"files": ("a.png", png_bytes((1, 2, 3)))},
                      timeout=10).status_code == 401
    assert httpx.post(app.url + "/gradio_api/call/t2i", json={"data": ["a red circle"]}, timeout=10).status_code == 401
    with pytest.raises(Exception):
        Client(app.url, verbose=False)
    with pytest.raises(Exception):
        Client(app.url, auth=("anyone", "wrong"), verbose=False)
    c = Client(app.url, auth=("anyone", KEY), verbose=False)
    try:
        status, image, _, _ = c.predict("a red circle", mode="image", size="256:256", seed=1, random_seed=False,
                                        steps=2, api_name="/t2i")
        assert status.startswith("Done") and PILImage.open(image).size == (256, 256)
    finally:
        c.close()
    assert app.health()["auth"] == {"api": "key", "page": "login"}
    assert "access: /v1 needs the API key; page and its API needs a login" in app.log.read_text()


def test_access_notice_says_what_is_open():
    sys.path.insert(0, str(ROOT))
    import app as studio_app
    args = studio_app.parse_args([])
    assert "OPEN" in studio_app.access_notice(args) and studio_app.page_login(args) is None
    args = studio_app.parse_args(["--api-key", "k"])
    check = studio_app.page_login(args)
    assert check("anyone", "k") and not check("anyone", "x") and "OPEN" not in studio_app.access_notice(args)
    args = studio_app.parse_args(["--auth", "me:pw", "--api-key", "k"])
    assert studio_app.page_login(args) == ("me", "pw")
    args = studio_app.parse_args(["--api-only"])
    assert studio_app.access_notice(args) .startswith("access: /v1 OPEN") and "page" not in \
        studio_app.access_notice(args).split("<-")[0]


def test_429_past_the_queue(app, client):
    blocker = client.images.generate(prompt="a slow one", size="256x256", stream=True,
                                     extra_body=dict(FAST, num_inference_steps=200))
    waiting = []
    try:
        deadline = time.monotonic() + 30
        while not app.health()["running"]:
            assert time.monotonic() < deadline, app.health()
            time.sleep(0.05)
        for i in range(MAX_QUEUE):
            waiting.append(client.images.generate(prompt=f"waiting {i}", size="256x256", stream=True,
                                                  extra_body=FAST))
        assert app.health()["queue"] == MAX_QUEUE
        with pytest.raises(openai.RateLimitError) as e:
            client.images.generate(prompt="one too many", size="256x256", extra_body=FAST)
        assert "queue is full" in e.value.message and e.value.response.headers.get("retry-after")
    finally:
        for s in waiting + [blocker]:           # the waiting ones first, so none of them starts
            s.close()
    app.wait_idle(10)


def test_disconnect_mid_run_frees_the_engine(app, client):
    stream = client.images.generate(prompt="a long one", size="256x256", stream=True,
                                    extra_body=dict(THINK, num_inference_steps=200, stream_reasoning=True))
    for ev in stream:
        break                      # it is running (reasoning); 200 denoise steps would follow
    assert app.health()["running"]
    stream.close()
    # within 10 s: the 200 steps would run far longer, and one step of a loaded 2-core machine can take
    # seconds (2 s failed there once); the printed times say how fast it really is
    took = app.wait_idle(10.0)
    print(f"engine idle {took:.2f} s after a streamed request's disconnect")
    # a client that gives up on a request that is not streamed cancels it just the same
    with app.client(timeout=1.0) as impatient, pytest.raises(openai.APITimeoutError):
        impatient.images.generate(prompt="a long one", size="256x256", extra_body=dict(FAST, num_inference_steps=200))
    took = app.wait_idle(10.0)
    print(f"engine idle {took:.2f} s after a plain request's disconnect")
    r = client.images.generate(prompt="after", size="256x256", extra_body=FAST)
    assert decoded(r.data[0].b64_json).size == (256, 256)


# ---------------------------------------------------------------------------------------------- load
def test_soak_cancels_disconnects_and_a_killed_worker(app):
    """36 requests from 8 concurrent clients (generations, streams, edits, chats); 12 of them leave at a
    random point (a closed stream, a client timeout: in the queue, mid-reasoning, mid-denoise), and the
    engine worker is SIGKILLed once in the middle. Nothing is lost: every request ends with its image or
    an error that says what happened (the kill: the engine restarting). At the end the engine is idle and
    ready, memory and the server's open files have not grown beyond a bound."""
    n, clients = 36, 8
    rng = random.Random(1234)
    leavers = set(rng.sample(range(n), 12))
    plan = [(i, rng.choice(("generate", "stream", "edit", "chat")), i in leavers, rng.uniform(0.05, 2.0))
            for i in range(n)]
    results: dict[int, str] = {}
    rss: dict[str, int] = {}
    fds: dict[str, int] = {}
    detail: dict[str, dict] = {}
    finished: list[int] = []
    lock = threading.Lock()
    killed = threading.Event()
    before = app.health()

    def one(i: int, kind: str, leave: bool, after_s: float) -> str:
        extra = dict(FAST, seed=i, num_inference_steps=3)
        try:
            if kind == "stream":
                with app.client() as c:
                    s = c.images.generate(prompt=f"soak {i}", size="256x256", stream=True, partial_images=1,
                                          extra_body=dict(THINK, seed=i, num_inference_steps=3, stream_reasoning=True))
                    t0 = time.monotonic()
                    for ev in s:
                        if leave and time.monotonic() - t0 > after_s:
                            s.close()
                            return "left"
                        if ev.type.endswith("completed"):
                            assert decoded(ev.b64_json).size == (256, 256)
                            return "completed"
                    raise AssertionError("stream ended without an image or an error")
            # a timeout is a client that hangs up; the others wait as long as a loaded CI machine may need
            with app.client(timeout=after_s if leave else PATIENT_S) as c:
                if kind == "edit":
                    r = c.images.edit(image=("r.png", png_bytes((200, 30, 30)), "image/png"), prompt=f"soak {i}",
                                      size="256x256", extra_body=extra)
                    b64 = r.data[0].b64_json
                elif kind == "chat":
                    r = c.chat.completions.create(model="HunyuanImage-3.0-Instruct-Distil", modalities=["image"],
                                                  messages=[{"role": "user", "content": f"soak {i}"}],
                                                  extra_body={"height": 256, "width": 256, **extra})
                    b64 = r.choices[0].message.content[0]["image_url"]["url"].split(",", 1)[1]
                else:
                    r = c.images.generate(prompt=f"soak {i}", size="256x256", extra_body=extra)
                    b64 = r.data[0].b64_json
            assert decoded(b64).size == (256, 256)
            return "completed"
        except openai.APITimeoutError:
            assert leave, f"request {i} timed out without leaving"
            return "left"
        except openai.APIError as e:     # the kill: the running request fails, new ones wait or hear "restarting"
            message = getattr(e, "message", str(e))
            assert killed.is_set() and ("restart" in message or "loading" in message), message
            return "error"

    def run(item) -> None:
        i = item[0]
        outcome = one(*item)
        with lock:
            results[i] = outcome
            finished.append(i)
            if len(finished) == n // 2 and not killed.is_set():
                # the baseline: a warm engine (18 requests of every kind), just before it is killed
                rss["first"], fds["first"] = app.rss_bytes(), app.open_files()
                detail["first"] = app.rss_by_process()
                killed.set()
                os.kill(app.worker_pids()[0], signal.SIGKILL)

    t0 = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(run, plan))
    app.wait_idle(READY_TIMEOUT_S)
    took = time.monotonic() - t0
    # The killed worker is gone, so each process is compared with itself: the server over the whole soak,
    # the new worker over identical rounds once warm (its first requests of each kind and batch size
    # grow the allocator's caches; a leak grows it again in every later round).
    def round_(base: int) -> None:
        for k, kind in enumerate(("generate", "stream", "edit", "chat") * 2):
            assert one(base + k, kind, False, 0) == "completed"
        app.wait_idle(10)

    worker = {}
    for k in range(ROUNDS):
        round_(n + 1 + 20 * k)
        worker[f"round {k + 1}"] = app.rss_by_process()
    rss["last"], fds["last"] = app.rss_bytes(), app.open_files()
    detail["last"] = app.rss_by_process()
    assert sorted(results) == list(range(n)), "a request was lost"
    assert all(results[i] in ("completed", "error") for i in range(n) if i not in leavers), results
    h = app.health()
    assert h["status"] == "ok" and h["state"] == "ready" and h["restarts"] == before["restarts"] + 1, h
    server_growth = detail["last"]["server"] - detail["first"]["server"]
    wpid = app.worker_pids()[0]
    after = [worker[f"round {k + 1}"][f"worker {wpid}"] for k in range(ROUNDS)]
    # the least-squares slope over the rounds: a leak adds the same every round, the allocator's band does not
    mean_k, mean_b = (ROUNDS - 1) / 2, sum(after) / ROUNDS
    worker_growth = (sum((k - mean_k) * (b - mean_b) for k, b in enumerate(after))
                     / sum((k - mean_k) ** 2 for k in range(ROUNDS)))
    print(f"soak: {took:.1f} s, {sum(v == 'left' for v in results.values())} left, "
          f"{sum(v == 'error' for v in results.values())} failed by the kill; server RSS "
          f"{server_growth / 2**20:+.1f} MiB over the soak, new worker after {ROUNDS} warm rounds "
          f"{', '.join(f'{b / 2**20:.1f}' for b in after)} MiB; open files {fds['first']} -> {fds['last']}")
    # Bounds. Measured over 200 requests without a kill (2026-12-01): the server stays flat and a warm
    # worker moves 600-616 MiB with whether a request is mid-run. An idle worker's RSS after a round is one
    # sample of a band, not a level: eight identical sequential rounds read 633/617/617/633/617/... MiB
    # (2026-12-03, this machine), CI once read 510 then 577 MiB after two rounds (what the allocator
    # happened to hand back) and once 537 / 507 / 646 (2026-12-05: a 140 MiB band, so comparing the last
    # round with the two before it failed with no leak). So the growth is the slope over five rounds: the
    # band's noise averages out (readings spread over a 140 MiB band: about 13 MiB a round of slope), a leak adds the same
    # every round (48 MiB a round: 6 MiB a request, the bound).
    # (The old worker against its replacement is no leak measure: with batching, a worker's caches follow
    # the largest batch it happened to run: 507 vs 586 MiB seen on 2026-12-02.)
    # Open files: the server's own descriptors, which a leaked pipe of the killed engine or an unclosed
    # upload would grow; a few come and go with connections.
    assert server_growth < 48 * 2**20, detail
    assert worker_growth < 48 * 2**20, worker
    assert fds["last"] <= fds["first"] + 8, fds


# ---------------------------------------------------------------------------------------------- --api-only
def test_api_only_serves_the_api_without_the_page(tmp_path):
    a = App("--api-only", log=tmp_path / "api_only.log")
    try:
        a.wait_ready()
        assert httpx.get(a.url + "/", timeout=5).status_code == 404
        with a.client(api_key="unused") as c:                   # no --api-key, no --auth: /v1 is open
            r = c.images.generate(prompt="a red circle", size="256x256", extra_body=FAST)
        assert decoded(r.data[0].b64_json).size == (256, 256)
    finally:
        a.stop()
    assert a.proc.returncode == 0, a.log.read_text()[-2000:]


# ---------------------------------------------------------------------------------------------- in process
class _NotRunning:
    """An engine server that is loading (or restarting): nothing may be submitted to it."""

    def __init__(self, state: str):
        from engine import EMBEDDED_MODEL
        from engine.serve.info import ModelInfo
        self.info, self.state = ModelInfo.from_folder(EMBEDDED_MODEL), state

    def health(self) -> dict:
        return {"state": self.state, "loading": "3/7 layers" if self.state == "loading" else None, "queue": 0,
                "running": None}

    def submit(self, request):
        raise AssertionError("a request reached an engine that is not ready")


@pytest.mark.parametrize("state", ["loading", "restarting"])
def test_503_while_the_engine_loads_or_restarts(state):
    from starlette.testclient import TestClient
    from engine.serve.openai_api import api_app
    with TestClient(api_app(_NotRunning(state))) as http:
        r = http.post("/v1/images/generations", json={"prompt": "a red circle"})
        assert r.status_code == 503 and r.headers["retry-after"] and state in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503
        assert http.get("/v1/models").status_code == 200          # what is served is known before loading


def test_page_auth_without_an_api_key_closes_v1():
    from starlette.testclient import TestClient
    from engine.serve.openai_api import ApiConfig, api_app
    with TestClient(api_app(_NotRunning("loading"), ApiConfig(page_auth=True))) as http:
        r = http.get("/v1/models", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 401 and "--api-key" in r.json()["error"]["message"]
        assert http.get("/health").status_code == 503                # probes still answered



def test_a_body_without_content_length_is_cut_at_the_limit():
    """Chunked uploads declare no size: the body is counted as it arrives and refused past the limit."""
    from starlette.testclient import TestClient
    from engine.serve.openai_api import ApiConfig, api_app
    from engine.serve.openai_body import chat_limit
    from engine.serve.openai_params import UploadLimits
    limits = UploadLimits(max_bytes=100_000)

    def chunks(head: bytes, tail: bytes = b""):
        yield head
        for _ in range(chat_limit(limits.max_bytes).bytes // 10_000 + 1):       # past the largest route's limit
            yield b" " * 10_000
        yield tail

    form = b'--B\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
    with TestClient(api_app(_NotRunning("loading"), ApiConfig(limits=limits))) as http:
        for path, head, tail, ctype in (("edits", form, b"\r\n--B--\r\n", "multipart/form-data; boundary=B"),
                                        ("generations", b"{", b"}", "application/json")):
            r = http.post(f"/v1/images/{path}", content=chunks(head, tail), headers={"Content-Type": ctype})
            assert r.request.headers.get("transfer-encoding") == "chunked" and r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"

def test_partial_images_are_spread_over_the_steps():
    from engine.runtime.events import Step
    from engine.serve.openai_events import PreviewPicker

    def picked(count: int, n: int, previewed) -> list[int]:
        p = PreviewPicker(count)
        return [i for i in range(1, n + 1) if p.take(Step(i, n, b"png" if previewed(i) else None))]

    assert picked(3, 10, lambda i: i < 10) == [1, 4, 7]
    assert picked(3, 10, lambda i: i in (1, 9)) == [1, 9]       # a late preview covers the targets it passed
    assert picked(2, 10, lambda i: i in (3, 4, 5)) == [3]       # the next one waits for its own target
    assert picked(2, 2, lambda i: i == 1) == [1]
    assert picked(0, 10, lambda i: True) == []


class _FailsMidRun(_NotRunning):
    """A ready engine whose every request reasons a little, then fails."""

    def __init__(self):
        super().__init__("ready")

    def submit(self, request):
        from engine.runtime.events import Error, Started, Text
        from engine.serve.client import Submission
        sub = Submission(request, lambda request_id: False)
        for ev in (Started(request.request_id, "think", "auto", 4, 2.5, 1), Text("one red", "think"),
                   Error("engine", "the GPU caught fire")):
            sub.push(ev)
        return sub


def test_an_engine_error_mid_stream_reaches_the_client_as_api_error():
    from engine.serve.openai_api import api_app
    from studio_fixtures import serve_app
    with serve_app(api_app(_FailsMidRun())) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        seen = []
        with pytest.raises(openai.APIError, match="caught fire"):
            for ev in c.images.generate(prompt="a red circle", stream=True, extra_body={"stream_reasoning": True}):
                seen.append(ev.type)
        assert seen == ["image_generation.reasoning.delta"]
        with pytest.raises(openai.InternalServerError, match="caught fire"):   # not streamed: a 500
            c.images.generate(prompt="a red circle")
