"""The engine's event stream as OpenAI's wire formats: the JSON bodies of a finished request, and the
Server-Sent Events of a streamed one (image generations and edits; chat completion chunks).

Image streams follow what the official `openai` client parses (`client.images.generate(..., stream=True)`
and `client.images.edit`): `<kind>.partial_image` events carry step previews, `<kind>.completed` one
event per image with its usage, then `data: [DONE]`. The reasoning, which OpenAI's image API does not
have, streams before them as `<kind>.reasoning.delta` events only when the request asks for them with
`stream_reasoning: true`: the client types every image-stream event by a closed union, so an event type
it does not know becomes a partial-image event with no image, which breaks a caller that dispatches on
the class. Chat streams carry the reasoning by default (`delta.reasoning_content`, a field the client
keeps). An error mid-stream is a payload with an `error` key, which the client raises as
`openai.APIError`.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator

from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Event, Image, Ratio, Started, Step, Text
from engine.runtime.history import reasoning_of
from engine.serve.client import Submission
from engine.serve.image_meta import image_record, reasoning_text, with_record
from engine.serve.info import ModelInfo
from engine.serve.openai_params import ApiError, ImageParams
from engine.serve.usage import InputTokens

KEEPALIVE_S = 10.0          # an SSE comment this often while nothing happens (proxies close idle streams)
MIME = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode(png: bytes, output_format: str, compression: int) -> bytes:
    """The engine's PNG in the requested format (PNG as it came; JPEG/WebP at quality `compression`)."""
    if output_format == "png":
        return png
    with PILImage.open(io.BytesIO(png)) as img:
        out = io.BytesIO()
        img.convert("RGB").save(out, format=output_format.upper(), quality=max(1, compression))
        return out.getvalue()


@dataclass
class Outcome:
    """What one request produced, gathered from its events."""
    images: dict[int, Image] = field(default_factory=dict)       # by Image.index (0..n-1)
    sections: dict[str, str] = field(default_factory=dict)       # think / recaption / answer text
    ratio: Ratio | None = None
    done: Done | None = None
    error: Error | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    bot_task: str = ""
    inputs: InputTokens = field(default_factory=lambda: InputTokens(0, 0))   # as the engine counted them
    started: Started | None = None

    def add(self, ev: Event) -> None:
        if isinstance(ev, Started):
            self.bot_task, self.started = ev.bot_task, ev
            self.inputs = InputTokens.of(ev)
        elif isinstance(ev, Text):
            self.sections[ev.section] = self.sections.get(ev.section, "") + ev.delta
        elif isinstance(ev, Ratio):
            self.ratio = ev
        elif isinstance(ev, Image):
            self.images[ev.index] = ev
        elif isinstance(ev, Done):
            self.done = ev
        elif isinstance(ev, Error):
            self.error = ev

    @property
    def size(self) -> str:
        """WIDTHxHEIGHT of the images (OpenAI's order), or 'auto' before the size is known."""
        if self.images:
            img = next(iter(self.images.values()))
            return f"{img.width}x{img.height}"
        return f"{self.ratio.width}x{self.ratio.height}" if self.ratio else "auto"

    @property
    def reasoning(self) -> str:
        """The thinking and the recaption, as the model wrote them, one after the other."""
        return reasoning_text(self.sections)

    @property
    def cot(self) -> str:
        """The reasoning as the image phase read it, tags kept: what a chat client sends back in its
        history (an assistant message's `cot`) for the next turn to see it as the model wrote it."""
        return reasoning_of(self.bot_task, self.done.cot_text) if self.done else ""

    @property
    def revised_prompt(self) -> str | None:
        return (self.sections.get("recaption") or "").strip() or None

    def ordered(self) -> list[tuple[int, Image]]:
        return sorted(self.images.items())

    def usage(self, info: ModelInfo) -> dict[str, Any]:
        """OpenAI's image usage: the input (the user turn, as the engine counted it: engine.serve.usage; of
        it, `cached_tokens` not prefilled again, engine/runtime/prefix_cache.py), and the output the engine
        made: the text it wrote and the image tokens it denoised."""
        inputs = self.inputs
        f = info.cfg.vae_downsample_factor
        image_tokens = sum((im.height // f[0]) * (im.width // f[1]) for im in self.images.values())
        text_tokens = self.done.timings.ar_tokens if self.done else 0
        # input tokens whose K/V came from the prefix cache (OpenAI's `cached_tokens`); a retry of the same
        # turn may also hit the start of the bot prefix, which the input count leaves out
        cached = min(self.done.timings.ar_cached_tokens, inputs.total) if self.done else 0
        return {"input_tokens": inputs.total,
                "input_tokens_details": {"text_tokens": inputs.text, "image_tokens": inputs.image,
                                         "cached_tokens": cached},
                "output_tokens": text_tokens + image_tokens, "total_tokens": inputs.total + text_tokens + image_tokens,
                "output_tokens_details": {"text_tokens": text_tokens, "image_tokens": image_tokens}}

    def extensions(self) -> dict[str, Any]:
        """What the engine reports beyond OpenAI's fields: seeds, reasoning, measured timings."""
        return {"seeds": [im.seed for _, im in self.ordered()],
                "reasoning": self.reasoning,
                "cot_output": self.done.cot_text if self.done else "",      # vLLM-Omni's name: the raw text
                "timings": asdict(self.done.timings) if self.done else None}


def failure(err: Error) -> ApiError:
    """An engine Error as the HTTP refusal a client can act on."""
    if err.kind == "invalid":
        return ApiError(400, err.message, None, "invalid_value")
    if err.kind == "busy":
        return ApiError(429, err.message, None, "queue_full", retry_after=1)
    if err.kind == "cancelled":
        return ApiError(500, f"the request was cancelled: {err.message}", None, "cancelled")
    if "restarting" in err.message or "not running" in err.message or "shut down" in err.message:
        return ApiError(503, err.message, None, "engine_unavailable", retry_after=5)
    return ApiError(500, err.message, None, "engine_error")


async def collect(sub: Submission) -> Outcome:
    """Every event of a request, until it ends."""
    out = Outcome()
    async for ev in sub:
        out.add(ev)
    return out


async def _encoded(ims: list[tuple[int, Image]], p: ImageParams, out: Outcome, info: ModelInfo) -> list[bytes]:
    """Re-encode off the event loop: a WebP of a 1024 px image takes tens of milliseconds. A PNG carries what
    made it in its text chunks (engine/serve/image_meta.py), as the page's do."""
    def one(im: Image) -> bytes:
        if p.output_format != "png":
            return encode(im.png, p.output_format, p.output_compression)
        return with_record(im.png, image_record(p.request, out.started, im, info.name, info.gen, out.reasoning,
                                                out.done.timings if out.done else None))
    return await asyncio.to_thread(lambda: [one(im) for _, im in ims])


def _data_url(data: bytes, fmt: str) -> str:
    return f"data:{MIME[fmt]};base64,{base64.b64encode(data).decode()}"


async def images_response(out: Outcome, p: ImageParams, info: ModelInfo) -> dict[str, Any]:
    """The body of a finished /v1/images/generations or /v1/images/edits request (OpenAI's ImagesResponse
    plus the engine's extensions)."""
    ims = out.ordered()
    data = []
    for (index, im), blob in zip(ims, await _encoded(ims, p, out, info)):
        item: dict[str, Any] = {"revised_prompt": out.revised_prompt, "index": index, "seed": im.seed}
        if p.response_format == "url":
            item["url"] = _data_url(blob, p.output_format)
        else:
            item["b64_json"] = base64.b64encode(blob).decode()
        data.append(item)
    return {"created": out.created, "data": data, "background": "opaque", "output_format": p.output_format,
            "quality": p.quality, "size": out.size, "usage": out.usage(info), **out.extensions(),
            **_conversation(p)}


def _conversation(p: ImageParams) -> dict[str, Any]:
    """The conversation an edit's turn was added to (an extension: the id to continue it with)."""
    return {"conversation_id": p.conversation_id} if p.conversation_id else {}


async def chat_response(out: Outcome, p: ImageParams, info: ModelInfo) -> dict[str, Any]:
    """The body of a finished /v1/chat/completions request: the images as data-URL parts of the message."""
    ims = out.ordered()
    parts = [{"type": "image_url", "image_url": {"url": _data_url(b, p.output_format)}}
             for b in await _encoded(ims, p, out, info)]
    u = out.usage(info)
    return {"id": f"chatcmpl-{p.request.request_id}", "object": "chat.completion", "created": out.created,
            "model": info.name,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": parts, "reasoning_content": out.reasoning,
                                     "cot": out.cot}}],
            "usage": _chat_usage(u), "size": out.size, "revised_prompt": out.revised_prompt, **out.extensions()}


def _chat_usage(u: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"], "total_tokens": u["total_tokens"],
            "prompt_tokens_details": u["input_tokens_details"], "completion_tokens_details": u["output_tokens_details"]}


# ---------------------------------------------------------------------------------------- streaming
def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


DONE_FRAME = b"data: [DONE]\n\n"
KEEPALIVE_FRAME = b": keep-alive\n\n"


class PreviewPicker:
    """Which step previews become partial images: at most `count`, spread over the steps (the k-th at or
    after step 1 + k*n/count, so the first is the earliest preview). The engine does not preview every
    step (previews may take only a share of the denoise time), so a target is met by the first preview
    at or after it; a late preview meets one target only, so the ones after it can still be met by the
    previews that follow (fewer than `count` arrive only when the engine made fewer previews)."""

    def __init__(self, count: int):
        self.count, self.sent = count, 0

    def _target(self, k: int, n: int) -> int:
        return 1 + k * n // self.count

    def take(self, ev: Step) -> bool:
        if ev.preview is None or self.sent >= self.count or ev.i < self._target(self.sent, ev.n):
            return False
        self.sent += 1
        return True


async def _events(sub: Submission, out: Outcome) -> AsyncIterator[Event | None]:
    """The request's events (None when KEEPALIVE_S pass without one), each also added to `out`."""
    while True:
        ev = await sub.aget(timeout=KEEPALIVE_S)
        if ev is not None:
            out.add(ev)
        yield ev
        if isinstance(ev, (Done, Error)):
            return


def _error_frame(err: Error) -> bytes:
    e = failure(err)
    return sse(e.body(), "error")


async def image_stream(sub: Submission, p: ImageParams, info: ModelInfo, kind: str) -> AsyncIterator[bytes]:
    """SSE frames of a streamed generation (`kind` 'image_generation') or edit ('image_edit')."""
    out, picker, partials = Outcome(), PreviewPicker(p.partial_images), 0

    def common() -> dict[str, Any]:
        return {"created_at": int(time.time()), "size": out.size, "quality": p.quality, "background": "opaque",
                "output_format": p.output_format}

    try:
        async for ev in _events(sub, out):
            if ev is None:
                yield KEEPALIVE_FRAME
            elif isinstance(ev, Text) and p.stream_reasoning:
                yield sse({"type": f"{kind}.reasoning.delta", "delta": ev.delta, "section": ev.section,
                           "created_at": int(time.time())}, f"{kind}.reasoning.delta")
            elif isinstance(ev, Step) and picker.take(ev):
                blob = await asyncio.to_thread(encode, ev.preview, p.output_format, p.output_compression)
                yield sse({"type": f"{kind}.partial_image", "b64_json": base64.b64encode(blob).decode(),
                           "partial_image_index": partials, "step": ev.i, "steps": ev.n, **common()},
                          f"{kind}.partial_image")
                partials += 1
            elif isinstance(ev, Done):
                ims = out.ordered()
                usage, ext = out.usage(info), out.extensions()
                for (index, im), blob in zip(ims, await _encoded(ims, p, out, info)):
                    yield sse({"type": f"{kind}.completed", "b64_json": base64.b64encode(blob).decode(),
                               **common(), "usage": usage, "index": index, "seed": im.seed,
                               "revised_prompt": out.revised_prompt, "reasoning": ext["reasoning"],
                               "timings": ext["timings"], **_conversation(p)}, f"{kind}.completed")
                yield DONE_FRAME
            elif isinstance(ev, Error):
                yield _error_frame(ev)
                yield DONE_FRAME
    finally:
        if not sub.ended:          # the client went away (or the server is stopping): free the engine
            sub.cancel()


async def chat_stream(sub: Submission, p: ImageParams, info: ModelInfo) -> AsyncIterator[bytes]:
    """SSE `chat.completion.chunk`s: the role, the reasoning as `reasoning_content` deltas, then one chunk
    whose content holds the image parts (as in the non-streamed message), then the usage if asked."""
    out = Outcome()
    rid = f"chatcmpl-{p.request.request_id}"

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": out.created, "model": info.name,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra})

    section = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for ev in _events(sub, out):
            if ev is None:
                yield KEEPALIVE_FRAME
            elif isinstance(ev, Text) and ev.section in ("think", "recaption"):
                sep = "\n\n" if section is not None and ev.section != section else ""
                section = ev.section
                yield chunk({"reasoning_content": sep + ev.delta})
            elif isinstance(ev, Done):
                ims = out.ordered()
                parts = [{"type": "image_url", "image_url": {"url": _data_url(b, p.output_format)}}
                         for b in await _encoded(ims, p, out, info)]
                yield chunk({"content": parts, "cot": out.cot}, "stop", size=out.size,
                            revised_prompt=out.revised_prompt,
                            **{k: v for k, v in out.extensions().items() if k != "reasoning"})
                if p.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": out.created,
                               "model": info.name, "choices": [], "usage": _chat_usage(out.usage(info))})
                yield DONE_FRAME
            elif isinstance(ev, Error):
                yield _error_frame(ev)
                yield DONE_FRAME
    finally:
        if not sub.ended:
            sub.cancel()
