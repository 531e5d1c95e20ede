"""What the studio's controls offer and how their values become an engine `Request`. Pure functions,
no Gradio: the choices are built from the checkpoint (buckets, generation config), so they are always
the sizes and defaults the engine really uses."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from engine.runtime.request import Request, RequestError, random_seed
from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams, named_setting

if TYPE_CHECKING:      # the model's data types, as the server's ModelInfo carries them
    from engine.checkpoint.buckets import Bucket
    from engine.checkpoint.config import GenerationConfig

# (label, bot_task). The official tasks `recaption` and `auto` stay reachable through the engine CLI;
# the studio offers the three that make sense for a person choosing how much the model should reason.
REASONING_MODES: list[tuple[str, str]] = [
    ("Off", "image"),
    ("Think", "think"),
    ("Think + recaption", "think_recaption"),
]
AUTO_SIZE = "auto"
# (label, setting name: engine.runtime.step_cache.named_setting). Off first and by default: it gives the
# exact image; the others trade a little of it for fewer full denoise steps (README, "Step cache").
STEP_CACHES: list[tuple[str, str]] = [
    ("Off (every step in full)", "none"),
    ("Taylor cache, official setting: every 5th step in full, the others forecast", "taylor"),
    ("Adaptive block cache: skips a step's later layers when its first barely changed", "block"),
]
PRESET_LABELS = {
    "en_unified": "unified (official default)",
    "en_vanilla": "vanilla",
    "en_recaption": "recaption",
    "en_think_recaption": "think + recaption",
    "dynamic": "dynamic (by reasoning mode)",
    "custom": "custom text (below)",
    "None": "none",
}


def aspect_label(width: int, height: int) -> str:
    """'4:3', '16:9'... when the ratio has small terms, else the nearest whole or half ratio people say,
    'about 1:4' (a label such as '≈1:3.88' read as noise)."""
    f = Fraction(width, height)
    if f.numerator <= 21 and f.denominator <= 21:
        return f"{f.numerator}:{f.denominator}"
    r = max(width, height) / min(width, height)
    near = Fraction(round(r * 2), 2)
    long, short = near.numerator, near.denominator
    return f"about {long}:{short}" if width >= height else f"about {short}:{long}"


def size_choices(buckets: tuple[Bucket, ...]) -> list[tuple[str, str]]:
    """Dropdown (label, value) pairs: 'auto', then every bucket from the tallest to the widest.

    Labels put the width first ("W × H", the way people say sizes) and name the orientation, because
    the official app's H x W strings are easy to read backwards. Values are 'W:H' strings, which the
    engine's `parse_size` maps to exactly that bucket (bucket ratios are unique)."""
    out = [("auto — the model picks the aspect ratio", AUTO_SIZE)]
    for b in sorted(buckets, key=lambda b: b.width / b.height):
        shape = "square" if b.width == b.height else ("landscape" if b.width > b.height else "portrait")
        out.append((f"{b.width} × {b.height}  ({aspect_label(b.width, b.height)} {shape})", f"{b.width}:{b.height}"))
    return out


def default_mode(gen: GenerationConfig) -> str:
    """The reasoning mode the page starts in: the checkpoint's own bot_task (for the embedded model
    think_recaption, which measures best of the three: README, "Reasoning modes")."""
    values = [v for _, v in REASONING_MODES]
    if gen.bot_task in values:
        return gen.bot_task
    return "think_recaption" if gen.bot_task == "recaption" else "image"


def preset_choices(presets: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(PRESET_LABELS.get(p, p), p) for p in presets]


@dataclass(frozen=True)
class Settings:
    """The values of the shared controls, in the order the API endpoints take them (after the prompt
    and, for TI2I, the reference images)."""
    mode: str
    size: str
    seed: float | int | None
    random_seed: bool
    steps: float | int
    guidance: float
    system_prompt: str
    custom_system_prompt: str
    max_new_tokens: float | int
    step_cache: str = "none"          # the last three: API clients that do not send them get the defaults
    lora: str | None = None           # a LoRA adapter's name; None, "" or NO_LORA: the base model
    lora_scale: float = 1.0

    NAMES = ("mode", "size", "seed", "random_seed", "steps", "guidance", "system_prompt",
             "custom_system_prompt", "max_new_tokens", "step_cache", "lora", "lora_scale")


def as_int(v: Any) -> Any:
    """Gradio numbers arrive as floats (or None); whole floats become ints, anything else is passed on
    unchanged so that `prepare` reports it."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def build_request(prompt: str, images: list[Any], s: Settings, for_check: bool = False,
                  align: bool = False) -> Request:
    """The engine request for the given control values. With "Random seed" ticked a seed is drawn
    here; `for_check` keeps the seed box's value instead, so the validator judges what is in the box
    (a box holding -5 is wrong whether or not it is used). `align`: the edit tab's "keep the first
    reference's aspect" (the official align option, Request.stretch)."""
    if s.random_seed and not for_check:
        seed = random_seed()
    else:
        seed = as_int(s.seed if s.seed is not None else 0)
    try:
        taylor, block = named_setting(s.step_cache or "none")
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), "step_cache") from None
    return Request(
        prompt=prompt or "",
        images=list(images),
        bot_task=s.mode,
        size=s.size or AUTO_SIZE,
        steps=as_int(s.steps),
        guidance=float(s.guidance) if isinstance(s.guidance, (int, float)) else s.guidance,
        seed=seed,
        system_prompt=s.system_prompt or None,
        custom_system_prompt=(s.custom_system_prompt or None) if s.system_prompt == "custom" else None,
        max_new_tokens=as_int(s.max_new_tokens),
        taylor_cache=taylor,
        block_cache=block,
        lora=None if s.lora in (None, "", NO_LORA) else s.lora,
        lora_scale=1.0 if s.lora_scale is None else s.lora_scale,
        stretch=bool(align),
    )


NO_LORA = "none (base model)"          # the adapter picker's first choice

# The Request fields that a control of the page holds under another name.
CONTROL_OF_FIELD = {"bot_task": "mode", **{n: "step_cache" for n in (*TaylorCacheParams.names(),
                                                                    *BlockCacheParams.names())}}


def control_of(field: str | None, controls: tuple[str, ...]) -> str:
    """The control that shows a RequestError about `field` (the prompt, always visible, when none
    holds it: e.g. an error about the request as a whole)."""
    name = CONTROL_OF_FIELD.get(field or "", field)
    return name if name in controls else "prompt"
