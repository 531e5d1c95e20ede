"""Which request fields each /v1 route knows, and the checks OpenAI itself makes before anything else:
an unknown field is refused (400 `unknown_parameter`, as OpenAI answers "Unknown parameter: 'x'."), a
`model` other than those in /v1/models (the checkpoint and its loaded LoRA adapters) is 404 `model_not_found`.

Why refuse rather than ignore: a misspelt or unsupported field (`num_inference_step`, `negative_prompt`)
that is silently dropped gives a different image than the caller asked for, with no sign of it; OpenAI's
API refuses unknown fields for the same reason, so clients written against it already expect the 400.
What a field of OpenAI's own schema means is kept: fields that cannot change an image (`user`, `style`,
`moderation`, `metadata`, ...) are accepted and ignored, as OpenAI ignores them on models they do not
apply to, and the chat fields of a text model that this server cannot honour (`tools`, `logprobs`,
`stop`, ...) are accepted only at their neutral value (null, false, 0, empty: what gateways send by
default) and refused as `unsupported_parameter` otherwise.
"""
from __future__ import annotations

from typing import Any, Collection, Iterable

from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
from engine.serve.openai_errors import ApiError, invalid

# The step caches' settings, as extension fields of every image route (the engine's names; the Taylor
# cache's are the official generate_image arguments).
STEP_CACHE_FIELDS = frozenset({"use_taylor_cache", *TaylorCacheParams.names(), "use_block_cache",
                               *BlockCacheParams.names()})

# The engine's own fields (and vLLM-Omni's names for them), on every image route.
# `lora_scale`: the strength of the LoRA adapter that `model` names. `infer_align_image_size` (the official
# generate_image argument): the reference images are stretched to their buckets, not cropped, and the output
# takes the first reference's aspect (with references only: refused on /v1/images/generations).
ALIGN_FIELD = "infer_align_image_size"
ENGINE_FIELDS = frozenset({"num_inference_steps", "guidance_scale", "seed", "bot_task", "use_system_prompt",
                           "system_prompt", "max_new_tokens", "lora_scale", ALIGN_FIELD}) | STEP_CACHE_FIELDS
# vLLM-Omni fields that would change the result but are not implemented: refused by name (openai_params).
REFUSED_FIELDS = frozenset({"negative_prompt", "lora", "mask", "true_cfg_scale", "flow_shift"})
# Accepted and ignored: they cannot change the image (vae_use_tiling is a memory option of vLLM-Omni). Each
# has the type OpenAI's schema gives it, checked on JSON bodies (`check_fields`): ignored is not unchecked,
# or they would be the one place a client could put anything, of any size (issue 44: 80 MB in `metadata`).
IGNORED_TYPES: dict[str, type] = {"user": str, "style": str, "moderation": str, "input_fidelity": str,
                                  "vae_use_tiling": bool, "metadata": dict, "store": bool, "service_tier": str,
                                  "prompt_cache_key": str, "safety_identifier": str}
IGNORED_FIELDS = frozenset(IGNORED_TYPES)
MAX_IGNORED_TEXT = 512                     # characters of an ignored text field
METADATA_PAIRS, METADATA_KEY_CHARS = 16, 64    # OpenAI's limits on `metadata` (its values: MAX_IGNORED_TEXT)
IMAGE_OUTPUT_FIELDS = frozenset({"model", "n", "size", "quality", "response_format", "background", "output_compression",
                                 "output_format", "partial_images", "stream", "stream_reasoning"})

GENERATION_FIELDS = frozenset({"prompt"}) | IMAGE_OUTPUT_FIELDS | ENGINE_FIELDS | REFUSED_FIELDS | IGNORED_FIELDS
# Conversations (engine/serve/conversation.py): an edit continues one by id, or branches from its turn k;
# what the model sees of the earlier turns is the history policy (chat too: its history is the messages).
CONVERSATION_FIELDS = frozenset({"conversation_id", "branch_from_turn", "history_policy"})
EDIT_FIELDS = GENERATION_FIELDS | {"image", "image[]"} | CONVERSATION_FIELDS
# Chat: OpenAI's chat fields this server uses, the image fields, and `extra_body` as curl sends it literally.
CHAT_FIELDS = frozenset({"messages", "model", "modalities", "stream", "stream_options", "n", "seed", "temperature",
                         "top_p", "max_tokens", "max_completion_tokens", "extra_body", "height", "width", "size",
                         "output_format", "output_compression", "history_policy"}) | ENGINE_FIELDS | REFUSED_FIELDS \
    | IGNORED_FIELDS
# OpenAI chat fields of text models: accepted at their neutral value only.
CHAT_NEUTRAL_ONLY = frozenset({"frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
                               "stop", "response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
                               "function_call", "audio", "prediction", "reasoning_effort", "web_search_options",
                               "verbosity"})


def _neutral(value: Any) -> bool:
    return value is None or value is False or (not isinstance(value, bool) and value == 0) or value in ("", [], {})


def unknown_parameter(name: str) -> ApiError:
    return ApiError(400, f"Unknown parameter: '{_printable(name)}'.", _printable(name), "unknown_parameter")


def check_fields(body: dict[str, Any], known: Iterable[str], neutral_only: Iterable[str] = (), typed: bool = True
                 ) -> None:
    """Refuse the first field that `known` does not list (400 unknown_parameter), or a field of
    `neutral_only` set to anything but its neutral value (400 unsupported_parameter); with `typed` (a JSON
    body, not a form's texts), an ignored field of the wrong type or size."""
    known, neutral_only = frozenset(known), frozenset(neutral_only)
    for name, value in body.items():
        if name in neutral_only:
            if not _neutral(value):
                raise ApiError(400, f"Unsupported parameter: '{name}' is not supported by this image model "
                                    "(send it as null or leave it out).", name, "unsupported_parameter")
        elif name not in known:
            raise unknown_parameter(name)
        elif typed and name in IGNORED_TYPES and value is not None:
            _check_ignored(name, value)


def _check_ignored(name: str, value: Any) -> None:
    kind = IGNORED_TYPES[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise invalid(name, f"must be {_KIND_NAMES[kind]} (got {json_kind(value)})")
    if isinstance(value, str) and len(value) > MAX_IGNORED_TEXT:
        raise invalid(name, f"is {len(value)} characters; the limit is {MAX_IGNORED_TEXT}")
    if isinstance(value, dict):             # metadata, as OpenAI limits it
        if len(value) > METADATA_PAIRS:
            raise invalid(name, f"holds {len(value)} pairs; the limit is {METADATA_PAIRS}")
        for key, v in value.items():
            if len(key) > METADATA_KEY_CHARS:
                raise invalid(name, f"a key is {len(key)} characters; the limit is {METADATA_KEY_CHARS}")
            if not isinstance(v, str) or len(v) > MAX_IGNORED_TEXT:
                raise invalid(name, f"values must be strings of at most {MAX_IGNORED_TEXT} characters (got "
                                    f"{json_kind(v) if not isinstance(v, str) else f'{len(v)} characters'})")


_KIND_NAMES = {str: "a string", bool: "true or false", dict: "an object of string keys and values"}


def json_kind(value: Any) -> str:
    """What a JSON value is, for a message (never the value itself: it may be huge)."""
    return {bool: "a boolean", str: "a string", dict: "an object", list: "an array", type(None): "null"}.get(
        type(value), "a number")


def check_model(body: dict[str, Any], served: str, adapters: Collection[str] = ()) -> str | None:
    """`model`, when given, must be the served one or one of its LoRA adapters (as /v1/models lists them);
    returns the adapter's name (None: the base model)."""
    model = body.get("model")
    if model is None or model == served:
        return None
    if isinstance(model, str) and model in adapters:
        return model
    also = f" and the LoRA adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
    raise ApiError(404, f"The model {_printable(str(model))!r} does not exist; this server serves {served!r}{also} "
                        "(GET /v1/models)", "model", "model_not_found")


def _printable(name: str) -> str:
    """A field name as it can go back in a message (a client may send anything as a key)."""
    name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name if len(name) <= 64 else name[:61] + "..."
