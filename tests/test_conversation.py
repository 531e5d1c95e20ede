"""Conversations (issue 29): the history policy, the sequence of a turn with history, the server's store
(bounded, LRU, branches, nothing changed by bad input), and the API: a 3-turn edit conversation with
the official `openai` client, over chat completions (the client sends the history) and over edits
(by conversation id), on a tiny checkpoint."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image as PILImage

from engine.serve.conversation import ConversationError, ConversationStore, TurnRecorder
from engine.runtime.events import Done, Error, Image, Timings
from engine.runtime.history import MAX_IMAGES, HistoryError, Turn, reasoning_of, select
from engine.runtime.request import Request, RequestError, prepare
from engine.runtime.sequence import image_phase_sequence, user_turn
from engine.checkpoint.buckets import nearest_bucket

from engine_drive import make_engine
from studio_fixtures import engine_server, start_server  # noqa: F401 (fixture)

openai = pytest.importorskip("openai")

FAST = dict(bot_task="image", size="256x256", steps=2, seed=7)
MODEL = "HunyuanImage-3.0-Instruct"                # the tiny checkpoint's model_version


def png(color, size=(96, 128)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


RED, GREEN, BLUE, GREY = png((220, 40, 40)), png((40, 200, 60)), png((30, 60, 220)), png((128, 128, 128), (64, 64))


def pixels(png: bytes) -> bytes:
    """An image's pixels (a PNG's text chunks aside)."""
    return PILImage.open(io.BytesIO(png)).convert("RGB").tobytes()


# ------------------------------------------------------------------------------------------ the policy

def test_full_keeps_the_latest_whole_turns_within_three_images():
    turns = (Turn("a red square", (RED,), "", GREEN), Turn("make it blue", (), "", BLUE), Turn("smaller", (), "", GREY))
    kept, carried = select(turns, 0, "full")
    # turn 1 (its reference and its image) would make 4 images: the oldest turn is left out whole
    assert [turns[i].prompt for i in kept] == ["make it blue", "smaller"] and carried is None
    assert sum(turns[i].image_count for i in kept) <= MAX_IMAGES
    kept, _ = select(turns, 1, "full")          # one reference of its own: room for 2 earlier images
    assert [turns[i].prompt for i in kept] == ["make it blue", "smaller"]
    kept, _ = select(turns, 2, "full")
    assert [turns[i].prompt for i in kept] == ["smaller"]
    # no earlier turn fits beside 3 references... and the last image does not fit either
    with pytest.raises(HistoryError) as e:
        select(turns, 3, "full")
    assert e.value.where == "images"


def test_last_image_carries_the_models_last_image_as_the_first_reference(tiny):
    turns = (Turn("a red square", (RED,), "<think>x</think>", GREEN), Turn("no image came", (), "", None))
    kept, carried = select(turns, 1, "last_image")
    assert kept == [] and turns[carried].image is GREEN
    # full: a turn whose user references take the room of the image being edited is not kept
    turns = (Turn("three refs", (RED, BLUE, GREY), "", GREEN),)
    kept, carried = select(turns, 0, "full")
    assert kept == [] and turns[carried].image is GREEN
    # prepared, the carried image is this turn's first reference, read as the model consumes it
    p = prepare(Request(prompt="blue", images=[BLUE], history=turns, seed=1), tiny)
    green, blue = (np.asarray(i.vae)[0, 0].tolist() for i in p.images)
    assert green == [40, 200, 60] and blue == [30, 60, 220] and p.history == []


@pytest.mark.parametrize("history, policy, field", [
    ((Turn("x", (), "", b"not an image"),), None, "history[0].image"),
    ((Turn("x", (b"\x89PNG broken",), "", GREEN),), None, "history[0].images"),
    ((Turn(3, (), "", GREEN),), None, "history[0].prompt"),
    (("x",), None, "history[0]"),
    ((Turn("x", (), "", GREEN),), "everything", "history_policy"),
])
def test_bad_history_is_refused_naming_the_turn_and_field(tiny, history, policy, field):
    with pytest.raises(RequestError) as e:
        prepare(Request(prompt="y", history=history, history_policy=policy), tiny)
    assert e.value.field == field, str(e.value)


def test_reasoning_is_what_the_image_phase_read():
    assert reasoning_of("think_recaption", "a</think><recaption>b</recaption><answer><boi>") == \
        "<think>a</think><recaption>b</recaption>"
    assert reasoning_of("recaption", "b</recaption>") == "<recaption>b</recaption>"
    assert reasoning_of("think", "cut short") == "<think>cut short"
    assert reasoning_of("image", "<img_ratio_3>") == ""


# ------------------------------------------------------------------------------------------ the sequence
def test_a_turn_with_history_in_the_official_layout(tiny):
    tok, cfg = tiny.tok, tiny.cfg
    prepared = prepare(Request(prompt="now blue", seed=1, history_policy="full", history=(
        Turn("a red square", (RED,), "<think>hm</think><recaption>red</recaption>", GREEN),)), tiny)
    history = tuple(t.layout for t in prepared.history)
    ref, made = prepared.history[0].images[0].layout, prepared.history[0].image.layout
    # both images 96x128 (width x height): laid out at their bucket's latent grid, read once in `prepare`
    b, f = nearest_bucket(tiny.buckets, 128, 96), cfg.vae_downsample_factor[0]
    assert ref == made and ref.vae_hw == (b.height // f, b.width // f) and ref.ratio_index == b.index
    assert prepared.images == [] and history[0].images == (ref,) and history[0].image == made
    seq = image_phase_sequence(user_turn(tok, "", "now blue", [], history, cfg.cond_token_attn_type),
                               "<recaption>blue</recaption>", 2, 2, 16, False)
    img = tok.special.img
    text = tok.decode([t for t in seq.ids if t != img])
    # the earlier turn whole (user: its image, its instruction; assistant: its reasoning, its image), then
    # this turn; only the image being made is in <answer>
    assert text.startswith("<|startoftext|>User: <boi>") and "a red square\n\nAssistant: <think>hm</think>" \
        "<recaption>red</recaption><boi>" in text and "\n\nUser: now blue\n\nAssistant: <recaption>blue" in text
    assert text.count("<answer>") == 1 and len(seq.cond_images) == 2
    # the uncond branch blanks every instruction and reasoning text, the earlier turn's included
    un = tok.decode([t for t in seq.uncond_ids(tok.special.cfg) if t != img])
    assert "a red square" not in un and "hm" not in un and "red</recaption>" not in un and "now blue" not in un
    assert un.count("<think>") == 1 and un.count("<boi>") == 3


# ------------------------------------------------------------------------------------------ the engine
def _image(events) -> bytes:
    events = list(events)
    errs = [e for e in events if isinstance(e, Error)]
    assert not errs, errs
    return next(e for e in events if isinstance(e, Image)).png


def test_last_image_policy_is_the_plain_edit_of_the_last_image(tiny):
    pipe = make_engine(tiny, preview_every=0)
    first = _image(pipe.run(Request(prompt="a red square", **FAST)))
    history = (Turn("a red square", (), "", first),)
    chained = _image(pipe.run(Request(prompt="make it blue", history=history, history_policy="last_image", **FAST)))
    plain = _image(pipe.run(Request(prompt="make it blue", images=[first], **FAST)))
    assert chained == plain
    full = _image(pipe.run(Request(prompt="make it blue", history=history, history_policy="full", **FAST)))
    assert full != plain          # the model saw the earlier instruction too


# ------------------------------------------------------------------------------------------ the store
def test_store_is_bounded_lru_and_branches_leave_the_original():
    store = ConversationStore(max_conversations=2)
    a, b = store.create(), store.create()
    store.record(a.id, Turn("one", (), "", RED))
    store.get(a.id)                                   # a is now the most recently used
    c = store.create()
    assert len(store) == 2 and {a.id, c.id} == set(store._items)
    with pytest.raises(ConversationError):
        store.get(b.id)
    store.record(a.id, Turn("two", (), "", GREEN))
    br = store.create(store.turns_until(a.id, 1), (a.id, 1))
    store.record(br.id, Turn("other two", (), "", BLUE))
    assert [t.prompt for t in store.get(a.id).turns] == ["one", "two"]
    assert [t.prompt for t in store.get(br.id).turns] == ["one", "other two"]
    for bad in (3, -1, "1", True):
        with pytest.raises(ConversationError) as e:
            store.turns_until(a.id, bad)
        assert e.value.field == "branch_from_turn"
    by_bytes = ConversationStore(max_bytes=len(RED) * 2)
    kept = [by_bytes.create((Turn("x", (), "", RED),)) for _ in range(3)]
    assert len(by_bytes) == 2 and by_bytes.nbytes <= len(RED) * 2 and kept[-1].id in by_bytes._items


def test_recorder_adds_a_turn_only_when_it_made_its_image():
    store = ConversationStore()
    conv = store.create()
    req = Request(prompt="x", images=[RED])
    for events in ([Error("cancelled", "stopped")], [Done(Timings(), "")]):
        rec = TurnRecorder(store, conv.id, req, "think")
        for ev in events:
            rec.see(ev)
    assert store.get(conv.id).turns == []
    rec = TurnRecorder(store, conv.id, req, "think_recaption")
    for ev in (Image(GREEN, 96, 128, 1, 0), Done(Timings(), "a</think><recaption>b</recaption>")):
        rec.see(ev)
    (turn,) = store.get(conv.id).turns
    assert turn == Turn("x", (RED,), "<think>a</think><recaption>b</recaption>", GREEN)


# ------------------------------------------------------------------------------------------ the API
@pytest.fixture(scope="module")
def api(engine_server):  # noqa: F811
    from starlette.testclient import TestClient
    from engine.serve.openai_api import api_app
    with TestClient(api_app(engine_server)) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        yield engine_server, http, client


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _png_of(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def test_three_turn_chat_conversation_with_the_openai_client(api):
    _, _, client = api
    messages = [{"role": "user", "content": [{"type": "text", "text": "a red square on grey"},
                                             {"type": "image_url", "image_url": {"url": _data_url(RED)}}]}]
    prompt_tokens, cached = [], []
    for k, instruction in enumerate(("", "make it blue", "add a green dot")):
        if k:
            messages.append({"role": "user", "content": instruction})
        chat = client.chat.completions.create(model=MODEL, messages=messages, extra_body=dict(
            height=256, width=256, num_inference_steps=2, bot_task="think", max_new_tokens=4, seed=3,
            history_policy="full"))
        msg = chat.choices[0].message
        image = _png_of(msg.content[0]["image_url"]["url"])
        assert PILImage.open(io.BytesIO(image)).size == (256, 256)
        # the client sends the answer back as it got it: the image part, its reasoning, and the reasoning
        # as the model wrote it (`cot`, tags kept), which the next turn's sequence then holds
        assert msg.model_extra["cot"].startswith("<think>") and msg.reasoning_content
        messages.append(msg.model_dump(exclude_none=True, warnings=False))
        prompt_tokens.append(chat.usage.prompt_tokens)
        cached.append(chat.usage.prompt_tokens_details.cached_tokens)
    # each turn's prompt holds the turns before it (policy full: 2 and then 3 images fit)
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2], prompt_tokens
    # ... and takes them from the prefix cache: the previous turn's whole prompt and its reasoning
    assert cached[0] == 0 and prompt_tokens[0] < cached[1] < prompt_tokens[1] < cached[2] < prompt_tokens[2], cached


def test_chat_messages_become_turns():
    from engine.serve.openai_params import UploadLimits, _chat_history
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a red square"},
                                         {"type": "image_url", "image_url": {"url": _data_url(RED)}}]},
            {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _data_url(GREEN)}}],
             "reasoning_content": "hm\n\nred", "cot": "<think>hm</think><recaption>red</recaption>"},
            {"role": "user", "content": "now blue"}, {"role": "user", "content": "and small"},
            {"role": "assistant", "content": "plain words", "reasoning_content": "shown"},
            {"role": "user", "content": [{"type": "text", "text": "add a dot"}]}]
    turns, texts, images, names = _chat_history(msgs, UploadLimits())
    assert turns == (Turn("a red square", (RED,), "<think>hm</think><recaption>red</recaption>", GREEN),
                     Turn("now blue\nand small", (), "shown", None))
    assert texts == ["add a dot"] and images == []
    assert names["history[1].prompt"] == "messages[3].content" and names["history[1].image"] == "messages[5].content"


@pytest.mark.parametrize("messages, param", [
    ([{"role": "assistant", "content": "hi"}], "messages"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}, {"role": "user", "content": "z"}],
     "messages[1].role"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}, {"role": "user", "content": "z"}],
     "messages[1].content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(RED)}},
        {"type": "image_url", "image_url": {"url": _data_url(RED)}}]}, {"role": "user", "content": "z"}],
     "messages[1].content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "reasoning_content": 5, "content": None},
      {"role": "user", "content": "z"}], "messages[1].reasoning_content"),
])
def test_bad_history_over_chat_is_400_naming_the_message(api, messages, param):
    _, http, _ = api
    r = http.post("/v1/chat/completions", json={"messages": messages, "height": 256, "width": 256})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_edits_by_conversation_id_report_cached_tokens(api):
    _, _, client = api
    extra = dict(num_inference_steps=2, bot_task="think", max_new_tokens=4, seed=5, history_policy="full")
    conv, inputs, cached = None, [], []
    for prompt in ("a red square", "make it blue", "add a dot"):
        body = {**extra, "conversation_id": conv} if conv else extra
        r = client.images.edit(image=[] if conv else [("red.png", RED, "image/png")], prompt=prompt, size="256x256",
                               extra_body=body)
        assert r.data[0].b64_json and r.model_extra["conversation_id"] == (conv or r.model_extra["conversation_id"])
        conv = r.model_extra["conversation_id"]
        inputs.append(r.usage.input_tokens)
        cached.append(r.usage.input_tokens_details.model_extra["cached_tokens"])
    assert cached[0] == 0 and inputs[0] < cached[1] < inputs[1] < cached[2] < inputs[2], (inputs, cached)


def test_three_turn_edit_conversation_by_id_and_a_branch(api):
    server, http, client = api
    held = len(server.conversations)            # other tests' conversations on this server
    extra = dict(num_inference_steps=2, bot_task="image", seed=5)
    r1 = client.images.edit(image=[("red.png", RED, "image/png")], prompt="a red square", size="256x256",
                            extra_body=extra)
    conv = r1.model_extra["conversation_id"]
    r2 = client.images.edit(image=[], prompt="make it blue", size="256x256", extra_body={**extra, "conversation_id": conv})
    r3 = client.images.edit(image=[], prompt="add a dot", size="256x256", extra_body={**extra, "conversation_id": conv})
    assert r2.model_extra["conversation_id"] == r3.model_extra["conversation_id"] == conv
    turns = server.conversations.get(conv).turns
    assert [t.prompt for t in turns] == ["a red square", "make it blue", "add a dot"]
    # the image the conversation keeps is the one returned (whose PNG also carries its record: image_meta)
    assert pixels(turns[2].image) == pixels(base64.b64decode(r3.data[0].b64_json))
    # branch from turn 1: a new conversation; the original keeps its three turns
    rb = client.images.edit(image=[], prompt="make it green", size="256x256",
                            extra_body={**extra, "conversation_id": conv, "branch_from_turn": 1})
    branch = rb.model_extra["conversation_id"]
    assert branch != conv and [t.prompt for t in server.conversations.get(branch).turns] == \
        ["a red square", "make it green"]
    assert len(server.conversations.get(conv).turns) == 3
    # bad input changes nothing: an unknown id, a turn it does not have, a bad value
    for fields, param in ((dict(conversation_id="conv_nope"), "conversation_id"),
                          (dict(conversation_id=conv, branch_from_turn=7), "branch_from_turn"),
                          (dict(conversation_id=conv, num_inference_steps=0), "num_inference_steps")):
        form = {"prompt": "x", **fields}
        r = http.post("/v1/images/edits", files={k: (None, str(v)) for k, v in form.items()})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    assert len(server.conversations.get(conv).turns) == 3 and len(server.conversations) == held + 2
