"""A generation request and its validation. Everything that can be refused is refused here, before
any compute, with a message a user can act on."""
from __future__ import annotations

import dataclasses
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Collection, Protocol

from engine.runtime import history as turns
from engine.runtime.history import MAX_IMAGES, HistoryError, SeenTurn, Turn
from engine.runtime.history import MAX_TURNS as MAX_TURNS   # a request's limit too: front ends read it here
from engine.runtime.images import ImageError, ImageReader, ModelImage
from engine.runtime.sampling import SamplingParams
from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
from engine.checkpoint.buckets import Bucket, SizeError, parse_size
from engine.checkpoint.config import GenerationConfig, ModelConfig
from engine.checkpoint.prompts import BOT_TASKS, PRESETS

# The limits of a request: one definition, used by the engine, the CLI, the studio's controls and API,
# and any other front end (they all validate through `prepare`).
MAX_PROMPT_CHARS = 8000
# A custom system prompt: room for the official presets (a few thousand characters) several times over;
# it is tokenized with the prompt, so an unbounded one holds the engine and its memory for nothing.
MAX_SYSTEM_PROMPT_CHARS = 16000
STEPS_RANGE = (1, 200)
GUIDANCE_RANGE = (0.0, 30.0)
MAX_NEW_TOKENS_RANGE = (1, 8192)
N_RANGE = (1, 4)                     # images per request
# Seeds: 0 .. 2**53 - 1, the largest range of integers every client holds exactly (a browser's number box
# and JSON readers in JavaScript use doubles); torch generators take any of them. Random seeds are drawn
# below RANDOM_SEED_BOUND: short to read and type again.
SEED_RANGE = (0, 2 ** 53 - 1)
RANDOM_SEED_BOUND = 2 ** 31
# A LoRA adapter's strength: its low-rank update times this (1: as trained; 0 < s, up to twice over-applied
# and a little more, past which an adapter's update dwarfs the weights it adapts)
LORA_SCALE_RANGE = (0.0, 4.0)


def random_seed() -> int:
    """A seed for a request that leaves it to the engine (or a page's "Random seed")."""
    return random.randrange(RANDOM_SEED_BOUND)


class RequestError(ValueError):
    """Bad input: nothing was run. `field` names the Request field at fault (prompt, images, bot_task,
    size, steps, guidance, seed, system_prompt, custom_system_prompt, max_new_tokens, temperature, top_k,
    top_p, n, taylor_cache_*, block_cache_*, lora, lora_scale, history_policy, history[i].<field>; None
    when the request as a whole is at fault), so a front end can put the message on its control or name
    the parameter in its error."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass
class Request:
    prompt: str
    images: list = field(default_factory=list)     # paths, bytes or PIL images (0-3)
    bot_task: str | None = None                   # None: the checkpoint's generation config
    size: str = "auto"                            # auto | HxW | W:H | <img_ratio_k>
    steps: int | None = None
    guidance: float | None = None
    seed: int | None = None                       # None: a random seed, reported in the Image event
    system_prompt: str | None = None              # preset name; None: the generation config's
    custom_system_prompt: str | None = None
    max_new_tokens: int | None = None
    greedy: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stretch: bool = False                         # fit references by stretching (official align option)
    text_only: bool = False                       # stop after the text phase (the `text` CLI)
    n: int = 1                                    # images sharing one reasoning pass, denoised as a batch
    taylor_cache: TaylorCacheParams | None = None  # the official Taylor step cache (None: off)
    block_cache: BlockCacheParams | None = None    # or the adaptive first-block step cache
    lora: str | None = None                       # a loaded LoRA adapter, by name (None: the base model)
    lora_scale: float = 1.0                       # its strength
    history: tuple[Turn, ...] = ()                # a conversation's earlier turns, oldest first
    history_policy: str | None = None             # what of them the model sees (history.POLICIES; None: default)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass
class Prepared:
    """A request as the engine runs it: every field checked, every default resolved, its images read
    once into what the model consumes of them (their layouts in the sequence included). The one account
    of the request from here on: nothing is read again from the Request it came from."""
    request_id: str
    prompt: str
    images: list[ModelImage]                       # this turn's references (the policy's carried image first)
    bot_task: str
    bucket: Bucket | None                          # None: the model chooses (size auto)
    steps: int
    guidance: float
    seed: int
    preset: str
    custom_system_prompt: str | None
    max_new_tokens: int
    sampling: SamplingParams
    images_out: int                                # n: how many images the request makes
    stretch: bool = False                          # references fitted by stretching (the outputs take their aspect)
    text_only: bool = False                        # it stops after the text phase
    taylor_cache: TaylorCacheParams | None = None
    block_cache: BlockCacheParams | None = None
    lora: str | None = None                        # the adapter's name (validated: loaded)
    lora_scale: float = 1.0
    history: list[SeenTurn] = field(default_factory=list)   # the earlier turns the sequence shows

    @property
    def sequence_images(self) -> list[ModelImage]:
        """Every image of the sequence in its order: the earlier turns' (each: references, then the
        model's image), then this turn's references."""
        return [img for t in self.history for img in t.all_images] + self.images


class Checkpoint(Protocol):
    """What `prepare` reads of the served checkpoint (engine/serve/info.py ModelInfo, or a loaded model)."""
    cfg: ModelConfig
    gen: GenerationConfig
    buckets: tuple[Bucket, ...]


def with_seed(req: Request) -> Request:
    """The request with its seed fixed: a request without one gets a random seed HERE, where it enters
    the engine, once, so every rank of a plan computes the same request and the seed can be reported."""
    if req.seed is not None:
        return req
    return dataclasses.replace(req, seed=random_seed())


# A Python object's default repr (`<_io.BytesIO object at 0x7f...>`), which PIL puts in its messages: it
# says nothing to the user and shows a server address.
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _text(value: object, field: str, what: str, limit: int) -> str | None:
    """A free-text field (None allowed): text, at most `limit` characters, and encodable as UTF-8 (JSON
    can carry a lone UTF-16 surrogate such as "\\ud800", which no tokenizer accepts)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"{what} must be text (got {type(value).__name__})", field)
    if len(value) > limit:
        raise RequestError(f"{what} is too long ({len(value)} characters; the limit is {limit})", field)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} contains a character that is not valid Unicode (a lone surrogate, "
                           f"{value[e.start]!r}, at position {e.start})", field) from None
    return value


def _in_range(value: object, lo: float, hi: float, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return False
    return lo <= value <= hi


def prepare(req: Request, ckpt: Checkpoint, adapters: Collection[str] = (),
            merged: tuple[str, float] | None = None) -> Prepared:
    """Check every field of `req` (its seed fixed: `with_seed`) against the limits above, resolve its
    defaults for the checkpoint `ckpt` and read its images (this turn's references, the earlier turns' the
    history policy shows); `adapters`: the names of the LoRA adapters loaded; `merged`: (name, strength) of
    the adapter folded into the weights (engine/model/lora_merge.py), the only one such an engine serves.
    Raises RequestError naming the field and what it accepts."""
    gen = ckpt.gen
    prompt = _text(req.prompt, "prompt", "the prompt", MAX_PROMPT_CHARS) or ""
    if not prompt.strip():
        raise RequestError("the prompt is empty: describe the image you want", "prompt")
    images, history = _read_images(req, ckpt)
    bot_task = req.bot_task or gen.bot_task
    if bot_task not in BOT_TASKS:
        raise RequestError(f"unknown reasoning mode (bot_task) {bot_task!r}; choose one of {', '.join(BOT_TASKS)}",
                           "bot_task")
    if not isinstance(req.size, (str, type(None))):
        raise RequestError(f"size must be a string: 'auto', 'HxW', 'W:H' or '<img_ratio_k>' (got {req.size!r})",
                           "size")
    try:
        bucket = parse_size(req.size or "auto", ckpt.buckets)
    except SizeError as e:
        raise RequestError(str(e), "size") from None
    steps = _ranged("steps", gen.diff_infer_steps if req.steps is None else req.steps, STEPS_RANGE, True)
    guidance = _ranged("guidance", gen.diff_guidance_scale if req.guidance is None else req.guidance,
                       GUIDANCE_RANGE, False)
    preset = req.system_prompt or gen.use_system_prompt
    if preset not in PRESETS:
        raise RequestError(f"unknown system prompt preset {preset!r}; choose one of {', '.join(PRESETS)}",
                           "system_prompt")
    custom = _text(req.custom_system_prompt, "custom_system_prompt", "the custom system prompt",
                   MAX_SYSTEM_PROMPT_CHARS)
    max_new = _ranged("max_new_tokens", gen.max_new_tokens if req.max_new_tokens is None else req.max_new_tokens,
                      MAX_NEW_TOKENS_RANGE, True)
    sampling = _sampling(req, gen)
    if not _in_range(req.seed, *SEED_RANGE, integer=True):
        raise RequestError(f"seed must be a whole number from {SEED_RANGE[0]} to {SEED_RANGE[1]} "
                           f"(got {req.seed!r})", "seed")
    if not _in_range(req.n, *N_RANGE, integer=True):
        raise RequestError(f"n (images per request) must be an integer in [{N_RANGE[0]}, {N_RANGE[1]}] (got {req.n!r})",
                           "n")
    _check_step_caches(req)
    _check_lora(req, adapters, merged)
    return Prepared(req.request_id, prompt, images, bot_task, bucket, int(steps), float(guidance), req.seed, preset,
                    custom, int(max_new), sampling, req.n, bool(req.stretch), bool(req.text_only), req.taylor_cache,
                    req.block_cache, req.lora, float(req.lora_scale), history)


def _ranged(name: str, value: object, bounds: tuple, integer: bool) -> object:
    """`value` if it is a number (an integer with `integer`) within `bounds`, else RequestError naming `name`."""
    if not _in_range(value, *bounds, integer=integer):
        what = "an integer" if integer else "a number"
        lo, hi = (f"{b}" if integer else f"{b:g}" for b in bounds)
        raise RequestError(f"{name} must be {what} from {lo} to {hi} (got {value!r})", name)
    return value


def _read_images(req: Request, ckpt: Checkpoint) -> tuple[list[ModelImage], list[SeenTurn]]:
    """This turn's references and the earlier turns the history policy shows, each image read once (one
    budget of decoded pixels for all of them): (the references, the carried image first; the turns)."""
    images = list(req.images or [])
    if len(images) > MAX_IMAGES:
        raise RequestError(f"{len(images)} reference images given; at most {MAX_IMAGES} are supported", "images")
    reader = ImageReader(ckpt.cfg, ckpt.buckets, bool(req.stretch))
    try:
        refs = [reader.read(src, f"reference image {i + 1}") for i, src in enumerate(images)]
    except ImageError as e:
        raise RequestError(_OBJECT_REPR.sub("", str(e)), "images") from None
    try:
        shown, carried = turns.select(req.history, len(refs), req.history_policy, MAX_PROMPT_CHARS)
        history, carried_image = turns.read(req.history, shown, carried, reader.read)
    except HistoryError as e:
        raise RequestError(_OBJECT_REPR.sub("", str(e)), e.where) from None
    return carried_image + refs, history


def _sampling(req: Request, gen: GenerationConfig) -> SamplingParams:
    sampling = SamplingParams(
        temperature=gen.temperature if req.temperature is None else req.temperature,
        top_k=gen.top_k if req.top_k is None else req.top_k,
        top_p=gen.top_p if req.top_p is None else req.top_p,
        greedy=req.greedy or not gen.do_sample)
    if not sampling.greedy:
        for name, value, ok, rule in (("temperature", sampling.temperature, lambda v: v > 0, "> 0 (or greedy)"),
                                      ("top_p", sampling.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
                                      ("top_k", sampling.top_k, lambda v: v >= 0, ">= 0 (0: off)")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise RequestError(f"{name} must be {rule} (got {value!r})", name)
    return sampling


def _check_step_caches(req: Request) -> None:
    for name, kind in (("taylor_cache", TaylorCacheParams), ("block_cache", BlockCacheParams)):
        value = getattr(req, name)
        if value is not None:
            if not isinstance(value, kind):
                raise RequestError(f"{name} must be {kind.__name__} or None (got {type(value).__name__})", name)
            if (bad := value.problem()) is not None:
                raise RequestError(bad[1], bad[0])
    if req.taylor_cache is not None and req.block_cache is not None:
        raise RequestError("choose one step cache: the Taylor cache or the block cache, not both", "block_cache")


def _check_lora(req: Request, adapters: Collection[str], merged: tuple[str, float] | None) -> None:
    if req.lora is not None:
        if not isinstance(req.lora, str):
            raise RequestError(f"lora must be the name of a loaded LoRA adapter (got {type(req.lora).__name__})",
                               "lora")
        if req.lora not in adapters:
            have = f"the loaded ones are {', '.join(sorted(adapters))}" if adapters else "none is loaded"
            raise RequestError(f"unknown LoRA adapter {req.lora!r}; {have}", "lora")
    lo, hi = LORA_SCALE_RANGE
    if not _in_range(req.lora_scale, lo, hi, integer=False) or req.lora_scale == lo:
        raise RequestError(f"the LoRA strength (lora_scale) must be a number in ({lo:g}, {hi:g}] "
                           f"(got {req.lora_scale!r})", "lora_scale")
    if merged is not None:
        name, strength = merged
        if req.lora != name:
            raise RequestError(f"this engine serves the LoRA adapter {name!r} merged into its weights "
                               f"(--lora-merged), so every request must name it (got {req.lora!r})", "lora")
        if req.lora_scale != strength:
            raise RequestError(f"the LoRA adapter {name!r} is merged into the weights at strength {strength:g}: "
                               f"lora_scale {req.lora_scale:g} cannot apply (serve it without --lora-merged)",
                               "lora_scale")

