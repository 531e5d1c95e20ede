"""The OpenAI-compatible API's requests: the JSON, multipart and chat forms of a request become one
engine `Request` plus the output options, and every refusal becomes an OpenAI-shaped error naming the
field.

The engine's `prepare` is the one judge of values and ranges (steps, guidance, seed, prompt, reference
images, size, n, ...); this module only converts wire types (multipart sends every field as text), maps
OpenAI's and vLLM-Omni's field names onto the engine's, and routes a `prepare` message to the API
field it concerns (the `param` of its Error). What is checked here is the API's own vocabulary (which
fields a route knows, `model`, response and output formats, partial_images, upload bytes and pixels),
which the engine has no notion of.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
from dataclasses import dataclass, field
from typing import Any, Collection

from PIL import Image as PILImage

from engine.runtime.events import Error
from engine.runtime.history import Turn
from engine.runtime.images import MAX_PIXELS
from engine.runtime.request import MAX_IMAGES, Request
from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
from engine.serve.info import ModelInfo
from engine.serve.openai_errors import ApiError, invalid
from engine.serve.openai_body import chat_image_bytes
from engine.serve.openai_fields import (ALIGN_FIELD, CHAT_FIELDS, CHAT_NEUTRAL_ONLY, EDIT_FIELDS, GENERATION_FIELDS,
                                        REFUSED_FIELDS, check_fields, check_model, json_kind)
from engine.serve.openai_form import FilePart

RESPONSE_FORMATS = ("b64_json", "url")                 # url: answered with a data URL (nothing is hosted)
OUTPUT_FORMATS = ("png", "jpeg", "webp")
QUALITIES = ("auto", "low", "medium", "high", "standard", "hd")   # accepted and reported; steps decide quality
BACKGROUNDS = ("auto", "opaque", "transparent")        # accepted; images are always opaque (reported so)
PARTIAL_IMAGES_MAX = 3                                 # OpenAI's range for partial_images is 0-3


@dataclass(frozen=True)
class UploadLimits:
    """Per reference image: at most `max_bytes` of file and `max_pixels` of decoded image (checked from the
    header, before anything is decoded)."""
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = min(4096 * 4096, MAX_PIXELS)


@dataclass
class ImageParams:
    """One API request: the engine request and how its result is to be written back."""
    request: Request
    response_format: str = "b64_json"
    output_format: str = "png"
    output_compression: int = 100
    quality: str = "auto"
    background: str = "auto"
    stream: bool = False
    partial_images: int = 0
    stream_reasoning: bool = False       # image streams: the reasoning as events (the SDK cannot type them)
    include_usage: bool = False          # chat streams: a last chunk with the usage (stream_options)
    size: Any = "auto"                   # the size as the client wrote it (for messages)
    names: dict[str, str] = field(default_factory=dict)   # engine field -> the API field it came from
    turn: bool = False                   # a conversation's turn (edits): submitted with EngineServer.submit_turn
    conversation_id: str | None = None   # the one it continues (given) / was added to (after submit)
    branch_from_turn: Any = None         # or branch from its turn k


# ---------------------------------------------------------------------------------------- wire types
class HugeNumber:
    """An integer with more digits than Python converts (4300): kept as its text, so `prepare` refuses it
    as a value out of range with a readable description instead of the parser calling it bad JSON."""

    def __init__(self, text: str):
        self.text = text.strip()

    def __repr__(self) -> str:
        return f"a {len(self.text.lstrip('+-'))}-digit number"


def parse_int(text: str) -> int | HugeNumber:
    """json.loads' `parse_int`: an int, or a HugeNumber past the conversion limit."""
    try:
        return int(text)
    except ValueError:
        return HugeNumber(text)


def _int_like(v: Any) -> Any:
    """Whole numbers as int (JSON clients may send 4.0, multipart sends "4"); anything else unchanged,
    so that `prepare` reports it with the value it got."""
    if isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v):
        return parse_int(v)
    return v


def _float_like(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    if isinstance(v, HugeNumber):
        return float("inf") if not v.text.startswith("-") else float("-inf")
    return v


def _text_field(body: dict, name: str) -> str | None:
    """A field that takes text: None when left out, null or empty; a value of another type is refused, not
    taken for 'not given' (`false`, `0`, `[]`, `{}` were silently dropped)."""
    v = body.get(name)
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise invalid(name, f"must be text (got {json_kind(v)})")
    return v


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "1", "false", "0"):
        return v.strip().lower() in ("true", "1")
    if v is None:
        return False
    raise invalid(name, f"expected true or false (got {v!r})")


def _choice(body: dict, name: str, choices: tuple[str, ...], default: str) -> str:
    v = body.get(name)
    if v is None:
        return default
    if v not in choices:
        raise invalid(name, f"{v!r} is not one of {', '.join(choices)}")
    return v


def _ranged_int(body: dict, name: str, lo: int, hi: int, default: int) -> int:
    v = _int_like(body.get(name))
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise invalid(name, f"must be an integer in [{lo}, {hi}] (got {v!r})")
    return v


# ---------------------------------------------------------------------------------------- sizes
def size_list(info: ModelInfo) -> list[str]:
    """The checkpoint's buckets as OpenAI writes sizes (width x height), from the tallest to the widest."""
    return [f"{b.width}x{b.height}" for b in sorted(info.buckets, key=lambda b: b.width / b.height)]


_WXH = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def engine_size(size: Any) -> str:
    """OpenAI's `WxH` (width first) as the engine's `HxW` (height first), which `prepare` snaps to the
    nearest bucket; `auto` and the engine's own forms (`W:H`, `<img_ratio_k>`) pass through."""
    if size is None:
        return "auto"
    if not isinstance(size, str):
        return size                     # prepare refuses it; the message lists the sizes
    if m := _WXH.match(size):
        return f"{m.group(2)}x{m.group(1)}"
    return size


# ---------------------------------------------------------------------------------------- field routing
# The Request field at fault (`Error.param`, from RequestError.field) -> the API field that sets it.
API_FIELD = {"images": "image", "system_prompt": "use_system_prompt", "custom_system_prompt": "system_prompt",
             "steps": "num_inference_steps", "guidance": "guidance_scale", "lora": "model"}
def refusal(err: Error, params: ImageParams, info: ModelInfo) -> ApiError:
    """The engine refused the request (`Error('invalid')`): a 400 naming the API field."""
    message = err.message
    # every refusal names its field (RequestError.field); 'prompt' only for one that somehow does not
    name = API_FIELD.get(err.param, err.param) if err.param else "prompt"
    name = params.names.get(name, name)
    if name == "size":
        if "not understood" in message:     # the engine's own forms are height first; this API's are not
            message = f"{params.size!r} is not understood: use 'auto' or WIDTHxHEIGHT"
        message = f"{message}. Valid sizes: auto, {', '.join(size_list(info))} (any WIDTHxHEIGHT snaps to the " \
                  "nearest aspect ratio)"
    return invalid(name, message)


# ---------------------------------------------------------------------------------------- uploads
def check_upload(data: bytes, what: str, param: str, limits: UploadLimits) -> bytes:
    """Refuse an oversized file, or one whose header declares too many pixels (before decoding it)."""
    if len(data) > limits.max_bytes:
        raise ApiError(413, f"{what} is {len(data)} bytes; the limit is {limits.max_bytes} bytes per image",
                       param, "file_too_large")
    try:
        with PILImage.open(io.BytesIO(data)) as img:       # reads the header only
            w, h = img.size
    except PILImage.DecompressionBombError:
        raise ApiError(413, f"{what} declares too many pixels (a decompression bomb?); the limit is "
                            f"{limits.max_pixels} pixels", param, "image_too_large") from None
    except Exception:  # noqa: BLE001 - not an image: `prepare` says so with the engine's words
        return data
    if w * h > limits.max_pixels:
        raise ApiError(413, f"{what} is {w}x{h} = {w * h} pixels; the limit is {limits.max_pixels} pixels",
                       param, "image_too_large")
    return data


def decode_data_url(url: Any, what: str, param: str, limits: UploadLimits) -> bytes:
    if not isinstance(url, str) or not url.startswith("data:"):
        raise invalid(param, f"{what}: only data URLs (data:image/png;base64,...) are accepted; this server "
                             "fetches nothing")
    head, _, payload = url.partition(",")
    if ";base64" not in head:
        raise invalid(param, f"{what}: the data URL must be base64-encoded")
    if len(payload) > limits.max_bytes * 4 // 3 + 4:
        raise ApiError(413, f"{what} is larger than {limits.max_bytes} bytes", param, "file_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(param, f"{what}: the data URL is not valid base64") from None
    return check_upload(data, what, param, limits)


def _step_cache(body: dict, use: str, kind: type) -> Any:
    """A step cache's extension fields (`use_taylor_cache` and `taylor_cache_*`, the official
    generate_image arguments; `use_block_cache` and `block_cache_*`): its settings, or None when it is
    off. A setting without `use_...: true` is refused rather than ignored (it would change nothing,
    silently); values are judged by `prepare`."""
    given = {name: body[name] for name in kind.names() if body.get(name) is not None}
    if not _bool(use, body.get(use)):
        if given:
            raise invalid(next(iter(given)), f"applies only with {use}: true")
        return None
    defaults = kind()
    values = {name: _bool(name, v) if isinstance(getattr(defaults, name), bool) else
              _float_like(v) if isinstance(getattr(defaults, name), float) else _int_like(v)
              for name, v in given.items()}
    return kind(**values)


# ---------------------------------------------------------------------------------------- the forms
def _engine_request(body: dict, prompt: str, images: list[bytes], size: Any, lora: str | None = None) -> Request:
    """The engine request for OpenAI/vLLM-Omni field names (values converted, never range-checked);
    `lora`: the adapter `model` named, whose strength is `lora_scale`."""
    for name in sorted(REFUSED_FIELDS):
        if body.get(name) not in (None, ""):
            raise invalid(name, "not supported by this server", "unsupported_parameter")
    bot_task = _text_field(body, "bot_task")
    if bot_task == "auto":
        raise invalid("bot_task", "'auto' writes text and makes no image; use image, recaption, think or "
                                  "think_recaption")
    preset, custom = _text_field(body, "use_system_prompt"), _text_field(body, "system_prompt")
    if custom is not None and preset is None:
        preset = "custom"            # vLLM-Omni: a system_prompt text alone is the custom prompt
    n = _int_like(body.get("n"))
    scale = _float_like(body.get("lora_scale"))
    if scale is not None and lora is None:
        raise invalid("lora_scale", "applies only with `model` naming a LoRA adapter (GET /v1/models lists them)")
    return Request(prompt=prompt, images=images, bot_task=bot_task, size=size,
                   steps=_int_like(body.get("num_inference_steps")),
                   guidance=_float_like(body.get("guidance_scale")),
                   seed=_int_like(body.get("seed")),
                   system_prompt=preset,
                   custom_system_prompt=custom if preset == "custom" else None,
                   max_new_tokens=_int_like(body.get("max_new_tokens")),
                   n=1 if n is None else n,
                   taylor_cache=_step_cache(body, "use_taylor_cache", TaylorCacheParams),
                   block_cache=_step_cache(body, "use_block_cache", BlockCacheParams),
                   lora=lora, lora_scale=1.0 if scale is None else scale,
                   history_policy=_text_field(body, "history_policy"),
                   stretch=_bool(ALIGN_FIELD, body.get(ALIGN_FIELD)))


def _output_options(body: dict, params: ImageParams) -> None:
    params.response_format = _choice(body, "response_format", RESPONSE_FORMATS, "b64_json")
    params.output_format = _choice(body, "output_format", OUTPUT_FORMATS, "png")
    params.output_compression = _ranged_int(body, "output_compression", 0, 100, 100)
    params.quality = _choice(body, "quality", QUALITIES, "auto")
    params.background = _choice(body, "background", BACKGROUNDS, "auto")
    params.stream = _bool("stream", body.get("stream"))
    params.partial_images = _ranged_int(body, "partial_images", 0, PARTIAL_IMAGES_MAX, 0)
    params.stream_reasoning = _bool("stream_reasoning", body.get("stream_reasoning"))


def _prompt(body: dict) -> Any:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "a prompt is required", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise invalid("prompt", f"must be a string (got {type(prompt).__name__})")
    return prompt


def parse_generation(body: Any, served: str, adapters: Collection[str] = ()) -> ImageParams:
    """POST /v1/images/generations (JSON); `served`: the model name /v1/models lists, `adapters` the LoRA
    adapters it lists besides."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    check_fields(body, GENERATION_FIELDS)
    lora = check_model(body, served, adapters)
    req = _engine_request(body, _prompt(body), [], engine_size(body.get("size")), lora)
    if req.stretch:
        raise invalid(ALIGN_FIELD, "applies to reference images (it fits them by stretching and gives the output "
                                   "the first one's aspect): use /v1/images/edits or chat with images")
    params = ImageParams(req, size=body.get("size", "auto"))
    _output_options(body, params)
    return params


def parse_edit(fields_: dict[str, Any], images: list[bytes], served: str, adapters: Collection[str] = ()
               ) -> ImageParams:
    """POST /v1/images/edits (multipart): text fields as sent, reference images already read and checked; a
    file sent in a text field (a FilePart) is refused by that field's name."""
    check_fields(fields_, EDIT_FIELDS, typed=False)
    for name, value in fields_.items():
        if isinstance(value, FilePart) and name not in REFUSED_FIELDS:      # those: "not supported", below
            raise invalid(name, f"takes text, not a file (a file named {value.filename!r} was sent in it)")
    lora = check_model(fields_, served, adapters)
    conversation = fields_.get("conversation_id") or None
    if not images and conversation is None:
        raise invalid("image", "give 1 to 3 reference images (as `image` or repeated `image[]` files), or the "
                               "conversation_id of a conversation to continue", "missing_required_parameter")
    branch = _int_like(fields_.get("branch_from_turn")) if fields_.get("branch_from_turn") not in (None, "") else None
    req = _engine_request(fields_, _prompt(fields_), images, engine_size(fields_.get("size")), lora)
    params = ImageParams(req, size=fields_.get("size", "auto"), turn=True, conversation_id=conversation,
                         branch_from_turn=branch)
    _output_options(fields_, params)
    return params


def _chat_text(content: Any, what: str, param: str = "messages") -> tuple[list[str], list[Any]]:
    """A message's content as (texts, image_url values): a string, or a list of text / image_url parts;
    `param` is the field a refusal names."""
    if isinstance(content, str):
        return [content], []
    if content is None:
        return [], []
    if not isinstance(content, list):
        raise invalid(param, f"the {what} content must be a string or a list of content parts "
                             f"(got {type(content).__name__})")
    texts, urls = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid(param, f"a text part's `text` must be a string (got {type(text).__name__})")
            texts.append(text)
        elif kind == "image_url":
            url = part.get("image_url")
            urls.append(url.get("url") if isinstance(url, dict) else url)
        else:
            raise invalid(param, f"content parts must be text or image_url (got {kind!r})")
    return texts, urls


def _sampling(merged: dict, names: dict[str, str]) -> dict[str, Any]:
    """OpenAI's sampling fields of a chat request, for the model's reasoning text: temperature (0: greedy),
    top_p, and max_completion_tokens / max_tokens as the reasoning budget (unless max_new_tokens is given)."""
    out: dict[str, Any] = {}
    temperature = _float_like(merged.get("temperature"))
    if temperature is not None:
        if temperature == 0 and not isinstance(temperature, bool):
            out["greedy"] = True
        else:
            out["temperature"] = temperature
    if merged.get("top_p") is not None:
        out["top_p"] = _float_like(merged["top_p"])
    budget = next((k for k in ("max_completion_tokens", "max_tokens") if merged.get(k) is not None), None)
    if budget is not None and merged.get("max_new_tokens") is None:
        out["max_new_tokens"] = _int_like(merged[budget])
        names["max_new_tokens"] = budget          # a refusal names the field the client sent
    return out


def _chat_history(messages: list, limits: UploadLimits
                  ) -> tuple[tuple[Turn, ...], list[str], list[bytes], dict[str, str]]:
    """The chat's conversation: its earlier turns (each user message, or run of them, then the assistant's
    answer: its `cot`, `reasoning_content` or text, and the image it returned as an `image_url` part), this
    turn's texts and reference images (the last user messages), and where each turn came from (engine
    field -> `messages[i]...`, for a refusal). System messages are the system prompt (parse_chat)."""
    runs: list[tuple[str, list[int]]] = []           # (role, message indexes) of each run of one role
    for i, m in enumerate(messages):
        role = m["role"]
        if role in ("system", "developer"):
            continue
        if role not in ("user", "assistant"):
            raise invalid(f"messages[{i}].role", f"messages[{i}] has role {role!r}: this image model takes system, "
                                                  "user and assistant messages")
        if runs and runs[-1][0] == role:
            runs[-1][1].append(i)
        else:
            runs.append((role, [i]))
    if not runs or runs[-1][0] != "user":
        raise invalid("messages", "the last message must be the user's: the instruction for the image to make",
                      "missing_required_parameter" if not runs else "invalid_value")
    names = dict(image="messages", prompt="messages", history="messages", history_policy="history_policy")

    def user(indexes: list[int]) -> tuple[list[str], list[bytes]]:
        texts, images = [], []
        for i in indexes:
            t, urls = _chat_text(messages[i].get("content"), f"messages[{i}]", f"messages[{i}].content")
            texts += t
            images += [decode_data_url(u, f"messages[{i}] image {k + 1}", f"messages[{i}].content", limits)
                       for k, u in enumerate(urls)]
        return texts, images

    turns: list[Turn] = []
    k = 0
    while k + 1 < len(runs):
        (_, asked), (_, answered) = runs[k], runs[k + 1]
        texts, images = user(asked)
        reasoning, image = [], None
        for i in answered:
            m = messages[i]
            t, urls = _chat_text(m.get("content"), f"messages[{i}]", f"messages[{i}].content")
            # the reasoning as the model wrote it (`cot`, which this server's answers carry), else as shown
            name = "cot" if m.get("cot") else "reasoning_content"
            r = m.get(name)
            if r is not None and not isinstance(r, str):
                raise invalid(f"messages[{i}].{name}", f"must be a string (got {type(r).__name__})")
            reasoning += [r] if r else t
            if len(urls) > 1 or (urls and image is not None):
                raise invalid(f"messages[{i}].content", "an assistant turn holds at most one image (the one it made)")
            if urls:
                image = decode_data_url(urls[0], f"messages[{i}] image", f"messages[{i}].content", limits)
        n = len(turns)
        names.update({f"history[{n}]": f"messages[{asked[0]}]", f"history[{n}].prompt": f"messages[{asked[0]}].content",
                      f"history[{n}].images": f"messages[{asked[0]}].content",
                      f"history[{n}].reasoning": f"messages[{answered[0]}].reasoning_content",
                      f"history[{n}].image": f"messages[{answered[0]}].content"})
        turns.append(Turn("\n".join(texts), tuple(images), "\n".join(reasoning), image))
        k += 2
    texts, images = user(runs[-1][1])
    return tuple(turns), texts, images, names


def parse_chat(body: Any, limits: UploadLimits, served: str, adapters: Collection[str] = ()) -> ImageParams:
    """POST /v1/chat/completions in the vLLM-Omni recipe's form, with the whole conversation as chat
    clients send it: the last user message's text is the prompt and its `image_url` parts (data URLs, up
    to 3) the reference images; the messages before it are the earlier turns (`_chat_history`); a system
    message is the custom system prompt; the diffusion fields come in `extra_body` (sent literally by
    curl, merged into the top level by the openai client) and `height`/`width` give the size."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    check_fields(body, CHAT_FIELDS, CHAT_NEUTRAL_ONLY)
    extra = body.get("extra_body")
    if extra is not None and not isinstance(extra, dict):
        raise invalid("extra_body", f"must be an object of request fields (got {type(extra).__name__})")
    check_fields(extra or {}, CHAT_FIELDS - {"extra_body", "messages"}, CHAT_NEUTRAL_ONLY)
    merged = {**body, **(extra or {})}
    lora = check_model(merged, served, adapters)
    modalities = merged.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or "image" not in modalities):
        raise invalid("modalities", 'this server answers with images: use ["image"]')
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "a list of messages with one user message is required",
                      "missing_required_parameter")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("messages", "every message must be an object with a `role` (got "
                                      f"{type(m).__name__ if not isinstance(m, dict) else 'no role'})")
    history, texts, images, names = _chat_history(messages, limits)
    budget = chat_image_bytes(limits.max_bytes)
    total = sum(map(len, images)) + sum(len(i) for t in history for i in (*t.images, t.image) if i is not None)
    if total > budget:
        raise ApiError(413, f"the images of this conversation are {total} bytes together; the limit is {budget} "
                            f"bytes (the model sees at most {MAX_IMAGES} images of a request)", "messages",
                       "request_too_large")
    system = [m for m in messages if m["role"] in ("system", "developer")]
    if system and merged.get("system_prompt") is None:
        sys_texts, sys_urls = _chat_text(system[-1].get("content"), "system message's")
        if sys_urls:
            raise invalid("messages", "a system message holds text only")
        if "".join(sys_texts).strip():
            merged["system_prompt"] = "\n".join(sys_texts)
            names["system_prompt"] = "messages"
    h, w = merged.get("height"), merged.get("width")
    if (h is None) != (w is None):
        raise invalid("height" if h is None else "width", "give both height and width, or neither")
    if h is not None and _text_field(merged, "size") is not None:
        raise invalid("size", "give the size, or height and width, not both")
    size = f"{_int_like(h)}x{_int_like(w)}" if h is not None else engine_size(merged.get("size"))
    req = dataclasses.replace(_engine_request(merged, "\n".join(texts), images, size, lora), history=history,
                              **_sampling(merged, names))
    names["size"] = "size" if h is None else "height"
    params = ImageParams(req, names=names,
                         size=merged.get("size", "auto") if h is None else f"height {h}, width {w}")
    params.output_format = _choice(merged, "output_format", OUTPUT_FORMATS, "png")
    params.output_compression = _ranged_int(merged, "output_compression", 0, 100, 100)
    params.stream = _bool("stream", merged.get("stream"))
    opts = merged.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("stream_options", f"must be an object, as {{\"include_usage\": true}} (got {json_kind(opts)})")
    params.include_usage = _bool("stream_options", (opts or {}).get("include_usage"))
    return params
