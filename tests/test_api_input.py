"""The /v1 API's front door, in process (starlette's TestClient) on a real engine server on the tiny
checkpoint: bad input is a 4xx in OpenAI's shape naming the field, never a 500; what OpenAI refuses
(unknown fields, another model) is refused; cross-site requests are refused; the event loop never
waits on the engine."""
from __future__ import annotations

import base64
import io
import json
import os
import threading
import time

import httpx
import pytest
from PIL import Image as PILImage
from starlette.testclient import TestClient

from engine.runtime.events import Error
from engine.runtime.request import MAX_PROMPT_CHARS, MAX_SYSTEM_PROMPT_CHARS
from engine.serve.client import Submission
from engine.serve.openai_api import ApiConfig, api_app
from engine.serve.openai_errors import ApiError
from engine.serve.openai_events import PreviewPicker

from studio_fixtures import engine_server, serve_app  # noqa: F401

CHEAP = {"size": "256x192", "num_inference_steps": 1, "bot_task": "image", "seed": 1}


@pytest.fixture(scope="module")
def http(engine_server):
    with TestClient(api_app(engine_server), raise_server_exceptions=False) as c:
        yield c


def png(size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def post_json(http, path: str, body, **headers):
    """The body as JSON text written by hand, so it can carry what a strict encoder would not (a lone
    surrogate escape)."""
    text = body if isinstance(body, str) else json.dumps(body)
    return http.post(path, content=text.encode(), headers={"Content-Type": "application/json", **headers})


def refused(r, status: int, param: str | None, code: str | None = None) -> dict:
    """An OpenAI-shaped refusal with this status and param."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# ---------------------------------------------------------------------------------------------- item 3
def test_a_lone_surrogate_is_400_on_the_field_that_holds_it(http):
    gen = '{"prompt": "a red \\ud800 circle", "size": "256x192"}'
    err = refused(post_json(http, "/v1/images/generations", gen), 400, "prompt", "invalid_value")
    assert "surrogate" in err["message"]
    refused(post_json(http, "/v1/images/generations", '{"prompt": "x", "system_prompt": "\\udfff"}'), 400,
            "system_prompt")
    chat = '{"messages": [{"role": "user", "content": "\\ud800"}]}'
    refused(post_json(http, "/v1/chat/completions", chat), 400, "messages")


@pytest.mark.parametrize("value", [5, ["a", "list"], {"a": 1}])
def test_a_system_prompt_that_is_not_text_is_400(http, value):
    err = refused(post_json(http, "/v1/images/generations", {"prompt": "a red circle", "system_prompt": value}),
                  400, "system_prompt")
    assert "must be text" in err["message"]


@pytest.mark.parametrize("content", [5, {"text": "x"}, [{"type": "text", "text": 7}], [3]])
def test_chat_content_of_the_wrong_kind_is_400(http, content):
    # the refusal names the message and its field (issue 29: a chat carries a whole conversation)
    refused(post_json(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}),
            400, "messages[0].content")


def test_deeply_nested_json_is_400_in_openais_shape(http):
    deep = "[" * 100_000 + "]" * 100_000
    for path in ("/v1/images/generations", "/v1/chat/completions"):
        err = refused(post_json(http, path, deep), 400, None, "invalid_json")
        assert "nested" in err["message"]
    just_past = {"messages": json.loads("[" * 70 + "]" * 70)}     # below the parser's own limit
    refused(post_json(http, "/v1/chat/completions", just_past), 400, None, "invalid_json")


# ---------------------------------------------------------------------------------------------- item 4
def test_a_mask_file_is_refused_not_ignored(http):
    files = [("image", ("a.png", png(), "image/png")), ("mask", ("m.png", png(), "image/png"))]
    err = refused(http.post("/v1/images/edits", files=files, data={"prompt": "make it blue", **CHEAP}), 400,
                  "mask", "unsupported_parameter")
    assert "not supported" in err["message"]
    files = [("image", ("a.png", png(), "image/png")), ("style_image", ("s.png", png(), "image/png"))]
    refused(http.post("/v1/images/edits", files=files, data={"prompt": "x"}), 400, "style_image",
            "unknown_parameter")


# ---------------------------------------------------------------------------------------------- item 5
def test_a_custom_system_prompt_has_a_limit_and_its_refusal_names_it(http, engine_server):
    long = "x" * (MAX_SYSTEM_PROMPT_CHARS + 1)
    err = refused(post_json(http, "/v1/images/generations", {"prompt": "a red circle", "system_prompt": long}),
                  400, "system_prompt")
    assert "custom system prompt is too long" in err["message"] and str(MAX_SYSTEM_PROMPT_CHARS) in err["message"]
    chat = {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "a red circle"}]}
    refused(post_json(http, "/v1/chat/completions", chat), 400, "messages")
    assert engine_server.health()["queue"] == 0 and engine_server.health()["running"] == 0


# ---------------------------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_routes_take_json_content_types_only(http, ctype):
    body = json.dumps({"prompt": "a red circle", **CHEAP}).encode()
    headers = {"Content-Type": ctype} if ctype else {}
    for path in ("/v1/images/generations", "/v1/chat/completions"):
        r = http.post(path, content=body, headers=headers)
        refused(r, 415, None, "unsupported_media_type")


def test_cross_site_posts_are_refused(http):
    bad = {"prompt": "a red circle", "num_inference_steps": 0}      # would be a 400 if it got that far
    for origin in ("https://evil.example", "null", "http://localhost:3000"):
        refused(post_json(http, "/v1/images/generations", bad, Origin=origin), 403, None, "cross_origin_forbidden")
        r = http.post("/v1/images/edits", files=[("image", ("a.png", png(), "image/png"))],
                      data={"prompt": "x"}, headers={"Origin": origin})
        refused(r, 403, None, "cross_origin_forbidden")
    # the server's own origin (a page it serves) is not cross-site
    refused(post_json(http, "/v1/images/generations", bad, Origin="http://testserver"), 400, "num_inference_steps")
    assert "access-control-allow-origin" not in {k.lower() for k in
                                                 post_json(http, "/v1/images/generations", bad).headers}


# ---------------------------------------------------------------------------------------------- item 8
def test_another_model_is_404_model_not_found(http, engine_server):
    for path, body in (("/v1/images/generations", {"prompt": "x", "model": "dall-e-2"}),
                       ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})):
        err = refused(post_json(http, path, body), 404, "model", "model_not_found")
        assert "dall-e-2" in err["message"] or "gpt-4o" in err["message"]
    name = engine_server.info.name
    refused(post_json(http, "/v1/images/generations", {"prompt": "x", "model": name, "num_inference_steps": 0}),
            400, "num_inference_steps")                # the served model is accepted


def test_unknown_fields_are_refused_as_openai_does(http):
    err = refused(post_json(http, "/v1/images/generations", {"prompt": "x", "num_inference_step": 4}), 400,
                  "num_inference_step", "unknown_parameter")
    assert err["message"] == "Unknown parameter: 'num_inference_step'."
    refused(http.post("/v1/images/edits", files=[("image", ("a.png", png(), "image/png"))],
                      data={"prompt": "x", "strength": "0.5"}), 400, "strength", "unknown_parameter")
    chat = {"messages": [{"role": "user", "content": "x"}], "extra_body": {"heigth": 256}}
    refused(post_json(http, "/v1/chat/completions", chat), 400, "heigth", "unknown_parameter")
    refused(post_json(http, "/v1/chat/completions", {**chat, "extra_body": {}, "tools": [{"type": "function"}]}),
            400, "tools", "unsupported_parameter")
    # OpenAI's own fields that cannot change an image pass (here up to the refusal of a bad step count)
    ok = {"prompt": "x", "user": "u1", "style": "vivid", "moderation": "low", "num_inference_steps": 0}
    refused(post_json(http, "/v1/images/generations", ok), 400, "num_inference_steps")
    chat = {"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0, "logprobs": False, "stop": None,
            "user": "u1", "num_inference_steps": 0}
    refused(post_json(http, "/v1/chat/completions", chat), 400, "num_inference_steps")


# ---------------------------------------------------------------------------------------------- item 9
class _SlowSubmit:
    """An engine whose submit blocks (as decoding 4096x4096 references does) until released."""

    def __init__(self, info):
        self.info, self.entered, self.release = info, threading.Event(), threading.Event()

    def health(self) -> dict:
        return {"state": "ready", "queue": 0, "running": None}

    def submit(self, request):
        self.entered.set()
        self.release.wait(30)
        sub = Submission(request, lambda request_id: False)
        sub.push(Error("busy", "the queue is full"))
        return sub


def test_submit_runs_off_the_event_loop(engine_server):
    slow = _SlowSubmit(engine_server.info)
    with TestClient(api_app(slow), raise_server_exceptions=False) as c:
        answers: dict = {}
        gen = threading.Thread(target=lambda: answers.update(
            gen=post_json(c, "/v1/images/generations", {"prompt": "a red circle"})), daemon=True)
        gen.start()
        try:
            assert slow.entered.wait(10)
            probe = threading.Thread(target=lambda: answers.update(health=c.get("/health")), daemon=True)
            probe.start()
            probe.join(10)
            assert "health" in answers and answers["health"].status_code == 200, "the loop waited on submit"
        finally:
            slow.release.set()
        gen.join(10)
    refused(answers["gen"], 429, None, "queue_full")


# ---------------------------------------------------------------------------------------------- item 11
def test_a_number_past_pythons_digit_limit_is_a_bad_seed_not_bad_json(http):
    huge = "9" * 5000
    err = refused(post_json(http, "/v1/images/generations", '{"prompt": "x", "seed": %s}' % huge), 400, "seed")
    assert "5000-digit" in err["message"] and "JSON" not in err["message"]
    err = refused(http.post("/v1/images/edits", files=[("image", ("a.png", png(), "image/png"))],
                            data={"prompt": "x", "seed": huge}), 400, "seed")
    assert "5000-digit" in err["message"]
    refused(post_json(http, "/v1/images/generations", '{"prompt": "x", "guidance_scale": %s}' % huge), 400,
            "guidance_scale")


def test_image_errors_do_not_show_python_objects(http):
    err = refused(http.post("/v1/images/edits", files=[("image", ("a.png", b"not an image", "image/png"))],
                            data={"prompt": "x"}), 400, "image")
    assert "cannot be read" in err["message"] and "object at 0x" not in err["message"], err
    ref = "data:image/png;base64," + base64.b64encode(b"GIF89a broken").decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}},
                                                      {"type": "text", "text": "x"}]}]}
    err = refused(post_json(http, "/v1/chat/completions", chat), 400, "messages")
    assert "object at 0x" not in err["message"], err


def test_404_and_405_are_openai_shaped(http):
    err = refused(http.get("/v1/nope"), 404, None, "not_found")
    assert "/v1/nope" in err["message"]
    r = http.get("/v1/images/generations")
    refused(r, 405, None, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    refused(http.delete("/health"), 405, None, "method_not_allowed")
    refused(http.post("/v1/models"), 405, None, "method_not_allowed")


def test_usage_counts_the_input_and_chat_prompt_tokens_are_set(http):
    r = post_json(http, "/v1/images/generations", {"prompt": "a red circle", **CHEAP})
    assert r.status_code == 200, r.text[:300]
    u = r.json()["usage"]
    assert u["input_tokens"] == u["input_tokens_details"]["text_tokens"] > 3
    assert u["input_tokens_details"]["image_tokens"] == 0
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    longer = post_json(http, "/v1/images/generations", {"prompt": "a red circle " * 20, **CHEAP}).json()["usage"]
    assert longer["input_tokens"] > u["input_tokens"]
    ref = "data:image/png;base64," + base64.b64encode(png()).decode()
    chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}},
                                                      {"type": "text", "text": "make it blue"}]}],
            "extra_body": {"height": 192, "width": 256, "num_inference_steps": 1, "bot_task": "image", "seed": 1}}
    r = post_json(http, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text[:300]
    u = r.json()["usage"]
    assert isinstance(u["prompt_tokens"], int) and u["prompt_tokens_details"]["image_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_a_late_preview_leaves_the_next_partial_to_the_following_previews():
    from engine.runtime.events import Step

    def picked(count: int, n: int, previewed) -> list[int]:
        p = PreviewPicker(count)
        return [i for i in range(1, n + 1) if p.take(Step(i, n, b"png" if previewed(i) else None))]

    assert picked(3, 10, lambda i: i in (1, 8, 9)) == [1, 8, 9]      # was [1, 8]: step 8 spent two targets
    assert picked(3, 4, lambda i: i in (1, 2, 3)) == [1, 2, 3]


# ------------------------------------------------------------------------------- the refusal names its field
BAD_FIELDS = [
    ("prompt", {"prompt": "   "}),
    ("prompt", {"prompt": 7}),
    ("images", {"images": [b"not an image"]}),
    ("images", {"images": [png()] * 4}),
    ("bot_task", {"bot_task": "dream"}),
    ("size", {"size": "huge"}),
    ("size", {"size": 1024}),
    ("steps", {"steps": 0}),
    ("guidance", {"guidance": 99.0}),
    ("system_prompt", {"system_prompt": "nonsense"}),
    ("custom_system_prompt", {"system_prompt": "custom", "custom_system_prompt": "x" * (MAX_SYSTEM_PROMPT_CHARS + 1)}),
    ("max_new_tokens", {"max_new_tokens": -1}),
    ("seed", {"seed": -5}),
    ("n", {"n": 0}),
    ("temperature", {"temperature": "hot"}),
    ("lora", {"lora": "nobody"}),
    ("history_policy", {"history_policy": "everything"}),
]


@pytest.mark.parametrize("field,kw", BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_every_refusal_carries_the_request_field_it_is_about(engine_server, field, kw):
    """The engine's refusal names its field (Error.param), so the API and the page never guess it from the
    message's words."""
    from engine.runtime.history import Turn
    from engine.runtime.request import Request
    kw = dict(kw)
    if field == "history_policy":
        kw["history"] = (Turn("a red circle", (), "", png()),)
    events = list(engine_server.submit(Request(**{"prompt": "a red circle", **kw})))
    assert len(events) == 1 and isinstance(events[0], Error) and events[0].kind == "invalid", events
    assert events[0].param == field, (events[0].param, events[0].message)


# ------------------------------------------------------------------------------- issue 44, item 2: large bodies
def _while_probed(url: str, send) -> tuple[httpx.Response, list[float]]:
    """`send()` in a thread while /health is asked every 0.05 s: its answer and each probe's seconds."""
    out: dict = {}
    sender = threading.Thread(target=lambda: out.update(r=send()), daemon=True)
    sender.start()
    probes = []
    with httpx.Client(timeout=30) as c:
        while sender.is_alive() or not probes:
            t0 = time.monotonic()
            assert c.get(url + "/health").status_code == 200
            probes.append(time.monotonic() - t0)
            time.sleep(0.05)
    sender.join()
    return out["r"], probes


CHAT_HEAD = b'{"messages": [{"role": "user", "content": "a red circle"}], '


def test_an_80_mb_body_leaves_health_answering(engine_server):
    """Issue 44: 40 M zeros in an unknown field, and 20 000 numbers of 4000 digits in the ignored `metadata`
    (80 MB each): /health answers within 1 s while they arrive, and each is refused naming the problem
    (the chat route's limit has room for 80 MB of images; the generation route's is far smaller)."""
    zeros = lambda: b"0," * (40_000_000 - 1) + b"0"                 # noqa: E731 - built one at a time
    numbers = lambda: b",".join([b"9" * 4000] * 20_000)              # noqa: E731
    cases = [("/v1/chat/completions", lambda: CHAT_HEAD + b'"junk": [' + zeros() + b"]}", 400, "junk",
              "unknown_parameter"),
             ("/v1/chat/completions", lambda: CHAT_HEAD + b'"metadata": [' + numbers() + b"]}", 400, "metadata",
              "too_many_values"),
             ("/v1/images/generations", lambda: b'{"prompt": "x", "metadata": {"a": [' + numbers() + b"]}}", 413,
              None, "request_too_large")]
    with serve_app(api_app(engine_server)) as url, httpx.Client(timeout=120) as big:
        for path, make, status, param, code in cases:
            body = make()
            assert len(body) > 80_000_000
            r, probes = _while_probed(url, lambda: big.post(url + path, content=body,
                                                            headers={"Content-Type": "application/json"}))
            err = refused(r, status, param, code)
            print(f"{path} {code}: {len(probes)} probes, slowest {max(probes):.3f} s")
            assert max(probes) < 1.0, (path, code, probes)
            if status == 413:           # the limit is named, with what it has room for
                assert "limit on this route" in err["message"] and "prompt of 8000" in err["message"], err
    assert engine_server.health()["queue"] == 0 and engine_server.health()["running"] == 0


def test_a_large_legal_chat_is_parsed_off_the_event_loop(engine_server):
    """Three 20 MB references as data URLs (80 MB of JSON, within the limit): parsed and decoded in a thread
    while /health answers; here they are no images, so the engine refuses them, naming the message."""
    url_part = b'{"type": "image_url", "image_url": {"url": "data:image/png;base64,' + \
        base64.b64encode(os.urandom(20 * 2**20 - 4096)) + b'"}}'
    body = b'{"messages": [{"role": "user", "content": [' + b", ".join([url_part] * 3) + \
        b', {"type": "text", "text": "x"}]}], "height": 256, "width": 256}'
    del url_part
    with serve_app(api_app(engine_server)) as url, httpx.Client(timeout=120) as big:
        r, probes = _while_probed(url, lambda: big.post(url + "/v1/chat/completions", content=body,
                                                        headers={"Content-Type": "application/json"}))
    err = refused(r, 400, "messages")
    assert "cannot be read as an image" in err["message"], err
    print(f"80 MB chat: {len(probes)} probes, slowest {max(probes):.3f} s")
    assert max(probes) < 1.0, probes


def test_body_limits_are_what_a_legal_request_needs(http):
    """A generation body has room for the longest prompt and system prompt, escaped as JSON can escape them
    (an astral character: 12 bytes), and not much more; the 413 says what the limit is for."""
    astral = "\U0001F600"
    longest = json.dumps({"prompt": astral * MAX_PROMPT_CHARS, "system_prompt": astral * MAX_SYSTEM_PROMPT_CHARS,
                          "metadata": {f"k{i}": "v" * 512 for i in range(16)}, **CHEAP})    # ensure_ascii: \ud83d\ude00
    assert len(longest) > 12 * (MAX_PROMPT_CHARS + MAX_SYSTEM_PROMPT_CHARS)
    r = post_json(http, "/v1/images/generations", longest)
    assert r.status_code != 413, r.text[:300]
    err = refused(post_json(http, "/v1/images/generations", {"prompt": "x" * 400_000}), 413, None,
                  "request_too_large")
    assert "the limit on this route is" in err["message"] and "system prompt" in err["message"], err


def test_the_largest_legal_chat_fits_the_value_budget():
    """MAX_JSON_VALUES against the values of the largest chat the engine takes: MAX_TURNS earlier turns,
    each user message with 3 references and a text, each answer with its reasoning and image, a system
    message, every extension field."""
    from engine.runtime.history import MAX_TURNS
    from engine.serve.openai_api import CHAT_JSON
    from engine.serve.openai_body import MAX_JSON_VALUES, JsonScan
    ref = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "system", "content": "be brief"}]
    for _ in range(MAX_TURNS):
        messages += [{"role": "user", "content": [ref] * 3 + [{"type": "text", "text": "x"}]},
                     {"role": "assistant", "reasoning_content": "r", "content": [ref, {"type": "text", "text": "y"}]}]
    messages.append({"role": "user", "content": [ref] * 3 + [{"type": "text", "text": "x"}]})
    body = {"messages": messages, "modalities": ["image"], "stream_options": {"include_usage": True},
            "metadata": {f"k{i}": "v" for i in range(16)},
            "extra_body": {"height": 256, "width": 256, "num_inference_steps": 2, "seed": 1, "bot_task": "think"}}
    scan = JsonScan(CHAT_JSON)
    scan.feed(json.dumps(body).encode())
    print(f"the largest legal chat holds {scan.values} values; the budget is {MAX_JSON_VALUES}")
    assert scan.values * 4 < MAX_JSON_VALUES


@pytest.mark.parametrize("chunk", [1, 7, 64 * 1024])
def test_the_scan_reads_strings_and_escapes_across_chunks(chunk):
    """The scan sees only structure: brackets and commas inside strings (escaped quotes and backslashes
    included, split anywhere between chunks) are text, not values or fields."""
    from engine.serve.openai_api import GENERATION_JSON
    from engine.serve.openai_body import JsonScan
    tricky = '[{,}] \\" \\\\ \\\\\\" ' * 2000
    text = json.dumps({"prompt": tricky, "user": "a\\\"b", "size": "256x192"}).encode()
    scan = JsonScan(GENERATION_JSON, max_values=8)
    for at in range(0, len(text), chunk):
        scan.feed(text[at:at + chunk])
    assert scan.values == 3 and not scan.stack and not scan.in_string
    scan = JsonScan(GENERATION_JSON)
    with pytest.raises(ApiError) as e:
        bad = json.dumps({"prompt": tricky, "junk\\u00e9": 1}).encode()
        for at in range(0, len(bad), chunk):
            scan.feed(bad[at:at + chunk])
    assert e.value.param == "junk\\u00e9" and e.value.code == "unknown_parameter"


@pytest.mark.parametrize("field,value,message", [
    ("metadata", {f"k{i}": "v" for i in range(17)}, "17 pairs"),
    ("metadata", {"k": 5}, "must be strings"),
    ("metadata", [], "must be an object"),
    ("user", 7, "must be a string"),
    ("user", "u" * 513, "513 characters"),
    ("store", "yes", "true or false"),
])
def test_ignored_fields_are_checked_against_their_type(http, field, value, message):
    err = refused(post_json(http, "/v1/images/generations", {"prompt": "x", field: value}), 400, field)
    assert message in err["message"], err


# ------------------------------------------------------------------------------- issue 44, item 5: small defects
@pytest.mark.parametrize("field,filename", [("prompt", "a green star on black"), ("size", "256x192"),
                                            ("num_inference_steps", "2"), ("conversation_id", "c1")])
def test_a_file_in_a_text_field_is_refused_naming_it(http, field, filename):
    files = [("image", ("a.png", png(), "image/png")), (field, (filename, b"\x89PNG...", "image/png"))]
    data = {k: v for k, v in {"prompt": "make it blue", **CHEAP}.items() if k != field}
    err = refused(http.post("/v1/images/edits", files=files, data=data), 400, field, "invalid_value")
    assert "not a file" in err["message"] and filename in err["message"], err


@pytest.mark.parametrize("field,value", [("system_prompt", False), ("system_prompt", 0), ("system_prompt", []),
                                         ("use_system_prompt", False), ("bot_task", {}), ("bot_task", 0),
                                         ("history_policy", [])])
def test_falsy_values_of_the_wrong_type_are_refused(http, field, value):
    """`false`, `0`, `[]`, `{}` in a field that takes text were taken for 'not given' and ignored."""
    if field != "history_policy":          # a conversation's field: chat and edits only
        body = {"prompt": "a red circle", field: value, **({} if field == "bot_task" else {"bot_task": "image"})}
        err = refused(post_json(http, "/v1/images/generations", body), 400, field, "invalid_value")
        assert "must be text" in err["message"], err
    chat = {"messages": [{"role": "user", "content": "a red circle"}], "extra_body": {field: value}}
    err = refused(post_json(http, "/v1/chat/completions", chat), 400, field, "invalid_value")
    assert "must be text" in err["message"], err


def test_a_size_with_thousands_of_digits_is_refused_naming_size(http):
    for size in ("1x" + "9" * 4300, "9" * 4301 + "x1", "1:" + "9" * 5000):
        for r in (post_json(http, "/v1/images/generations", {"prompt": "x", "size": size}),
                  http.post("/v1/images/edits", files=[("image", ("a.png", png(), "image/png"))],
                            data={"prompt": "x", "size": size})):
            err = refused(r, 400, "size", "invalid_value")
            assert "at most 9 digits" in err["message"] and "int_max_str_digits" not in err["message"], err
            assert "Valid sizes" in err["message"] and len(err["message"]) < 1000, err


def test_invalid_utf8_in_a_form_field_is_refused_naming_it(http):
    for field in ("prompt", "system_prompt", "size"):
        files = [("image", ("a.png", png(), "image/png")), (field, (None, b"a red \xff\xfe circle"))]
        data = {k: v for k, v in {"prompt": "make it blue"}.items() if k != field}
        err = refused(http.post("/v1/images/edits", files=files, data=data), 400, field, "invalid_value")
        assert "UTF-8" in err["message"], err


def test_bodies_held_at_once_have_a_budget():
    """Past what all bodies may hold together, the next one is refused with 503 and Retry-After; what a
    request held is returned when it ends, refused or not."""
    from engine.serve.openai_body import HeldBodies
    held = HeldBodies(100)
    with held.hold() as a, held.hold() as b:
        a(60)
        with pytest.raises(ApiError) as e:
            b(41)
        assert e.value.status == 503 and e.value.retry_after and e.value.code == "server_busy"
        b(40)
        assert held.held == 100
    assert held.held == 0


def test_a_chats_images_together_have_a_budget(engine_server):
    """A chat's images, history included, at most 3 times the upload limit together (the model sees at most
    3 of them): past it, 413 naming `messages`, each image within its own limit."""
    from engine.serve.openai_params import UploadLimits
    noisy = []
    for k in range(4):
        buf = io.BytesIO()
        PILImage.frombytes("RGB", (20, 20), os.urandom(1200)).save(buf, "PNG")
        noisy.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    limit = max(len(base64.b64decode(u.split(",")[1])) for u in noisy) + 10
    part = lambda u: {"type": "image_url", "image_url": {"url": u}}         # noqa: E731
    chat = {"messages": [{"role": "user", "content": [part(noisy[0]), part(noisy[1]), {"type": "text", "text": "x"}]},
                         {"role": "assistant", "content": [part(noisy[2])]},
                         {"role": "user", "content": [part(noisy[3]), {"type": "text", "text": "make it blue"}]}],
            "extra_body": {"height": 192, "width": 256, "num_inference_steps": 1, "bot_task": "image", "seed": 1}}
    with TestClient(api_app(engine_server, ApiConfig(limits=UploadLimits(max_bytes=limit))),
                    raise_server_exceptions=False) as c:
        err = refused(post_json(c, "/v1/chat/completions", chat), 413, "messages", "request_too_large")
        assert f"the limit is {3 * limit} bytes" in err["message"], err
        chat["messages"] = [{"role": "user", "content": [part(u) for u in noisy[:3]] + [{"type": "text", "text": "x"}]}]
        r = post_json(c, "/v1/chat/completions", chat)            # three images: within the budget
        assert r.status_code == 200, r.text[:300]
