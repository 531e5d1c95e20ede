"""A generation request and its validation. Everything that can be refused is refused here, before
any compute, with a message a user can act on."""
from __future__ import annotations

import dataclasses
import random
import uuid
from dataclasses import dataclass, field

from PIL import Image

from engine.runtime.images import ImageError, open_image
from engine.runtime.sampling import SamplingParams
from engine.spec.buckets import Bucket, SizeError, parse_size
from engine.spec.config import GenerationConfig
from engine.spec.prompts import BOT_TASKS, PRESETS

MAX_IMAGES = 3
MAX_PROMPT_CHARS = 8000
STEPS_RANGE = (1, 200)
GUIDANCE_RANGE = (0.0, 30.0)
MAX_NEW_TOKENS_RANGE = (1, 8192)
N_RANGE = (1, 4)                     # images per request
RANDOM_SEED_BOUND = 2 ** 31          # random seeds are drawn below this (they fit every client's int)


class RequestError(ValueError):
    """Bad input: nothing was run."""


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
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclass
class Prepared:
    """A validated request with every default resolved."""
    req: Request
    images: list[Image.Image]
    bot_task: str
    bucket: Bucket | None                          # None: the model chooses (size auto)
    steps: int
    guidance: float
    seed: int
    preset: str
    max_new_tokens: int
    sampling: SamplingParams
    images_out: int                                # n: how many images the request makes


def with_seed(req: Request) -> Request:
    """The request with its seed fixed: a request without one gets a random seed HERE, where it enters
    the engine, once, so every rank of a plan computes the same request and the seed can be reported."""
    if req.seed is not None:
        return req
    return dataclasses.replace(req, seed=random.randrange(RANDOM_SEED_BOUND))


def prepare(req: Request, gen: GenerationConfig, buckets: tuple[Bucket, ...]) -> Prepared:
    """Validate `req` (its seed fixed: `with_seed`) and resolve every default."""
    prompt = req.prompt if isinstance(req.prompt, str) else ""
    if not prompt.strip():
        raise RequestError("the prompt is empty: describe the image you want")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"the prompt is too long ({len(prompt)} characters; the limit is {MAX_PROMPT_CHARS})")
    images = list(req.images or [])
    if len(images) > MAX_IMAGES:
        raise RequestError(f"{len(images)} reference images given; at most {MAX_IMAGES} are supported")
    try:
        pil = [open_image(src, f"reference image {i + 1}") for i, src in enumerate(images)]
    except ImageError as e:
        raise RequestError(str(e)) from None
    bot_task = req.bot_task or gen.bot_task
    if bot_task not in BOT_TASKS:
        raise RequestError(f"unknown reasoning mode {bot_task!r}; choose one of {', '.join(BOT_TASKS)}")
    try:
        bucket = parse_size(req.size or "auto", buckets)
    except SizeError as e:
        raise RequestError(str(e)) from None
    steps = gen.diff_infer_steps if req.steps is None else req.steps
    if not isinstance(steps, int) or not STEPS_RANGE[0] <= steps <= STEPS_RANGE[1]:
        raise RequestError(f"steps must be an integer in [{STEPS_RANGE[0]}, {STEPS_RANGE[1]}] (got {steps!r})")
    guidance = gen.diff_guidance_scale if req.guidance is None else req.guidance
    if not isinstance(guidance, (int, float)) or not GUIDANCE_RANGE[0] <= guidance <= GUIDANCE_RANGE[1]:
        raise RequestError(f"guidance must be in [{GUIDANCE_RANGE[0]}, {GUIDANCE_RANGE[1]}] (got {guidance!r})")
    preset = req.system_prompt or gen.use_system_prompt
    if preset not in PRESETS:
        raise RequestError(f"unknown system prompt preset {preset!r}; choose one of {', '.join(PRESETS)}")
    max_new = gen.max_new_tokens if req.max_new_tokens is None else req.max_new_tokens
    if not isinstance(max_new, int) or not MAX_NEW_TOKENS_RANGE[0] <= max_new <= MAX_NEW_TOKENS_RANGE[1]:
        raise RequestError(f"max_new_tokens must be in [{MAX_NEW_TOKENS_RANGE[0]}, {MAX_NEW_TOKENS_RANGE[1]}]")
    sampling = SamplingParams(
        temperature=gen.temperature if req.temperature is None else req.temperature,
        top_k=gen.top_k if req.top_k is None else req.top_k,
        top_p=gen.top_p if req.top_p is None else req.top_p,
        greedy=req.greedy or not gen.do_sample)
    if not sampling.greedy:
        for name, value, ok, rule in (("temperature", sampling.temperature, lambda v: v > 0, "> 0 (or greedy)"),
                                      ("top_p", sampling.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
                                      ("top_k", sampling.top_k, lambda v: v >= 0, ">= 0 (0: off)")):
            if not isinstance(value, (int, float)) or not ok(value):
                raise RequestError(f"{name} must be {rule} (got {value!r})")
    s = req.seed
    if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < 2 ** 63:
        raise RequestError(f"seed must be a non-negative integer (got {req.seed!r})")
    if not isinstance(req.n, int) or isinstance(req.n, bool) or not N_RANGE[0] <= req.n <= N_RANGE[1]:
        raise RequestError(f"n (images per request) must be an integer in [{N_RANGE[0]}, {N_RANGE[1]}] (got {req.n!r})")
    return Prepared(req, pil, bot_task, bucket, int(steps), float(guidance), s, preset, int(max_new), sampling,
                    req.n)

