"""What a request emits while it runs. Plain, picklable dataclasses: the same objects travel from the
engine's worker processes to the server, the CLI, the studio and the benchmarks."""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np
from PIL import Image as PILImage


@dataclass
class Started:
    """The request runs. Its input as the model reads it, the user turn (system prompt, earlier turns, this
    turn's prompt and reference images), counted in tokens: text (markers included) and images' tokens."""
    request_id: str
    bot_task: str
    size: str                 # "auto" or "HxW"
    steps: int
    guidance: float
    seed: int = 0             # the request's seed (drawn where it entered the engine when none was given)
    input_text_tokens: int = 0
    input_image_tokens: int = 0
    kernels: str = ""         # the kernels of its quantized weights where they are not ours ("experts on
                              # humming-fp8 (W4A8)"): the same seed gives the same pixels only with the same ones


@dataclass
class Text:
    """A piece of decoded text. `section` is where it belongs: think, recaption, answer (free text)."""
    delta: str
    section: str


@dataclass
class Ratio:
    """The image size is fixed (chosen by the model for size `auto`, or from the request)."""
    height: int
    width: int
    bucket: int


@dataclass
class Denoising:
    """The request's denoising begins: its turn came. One image is denoised at a time (unless its bucket
    batches, engine/runtime/denoise_batch.py), so a request whose reasoning is done may first wait for
    the images ahead of it: `waited_ms` (the engine's clock, from asking for the turn to getting it)."""
    steps: int
    waited_ms: float = 0.0


@dataclass(eq=False)
class Step:
    """Denoising step i of n finished; `preview` is a small PNG (bytes) of the current estimate, or None.
    `preview_data`: that PNG, or its pixels until it is first asked for (as `Image`'s)."""
    i: int
    n: int
    preview_data: bytes | np.ndarray | Any = None      # Any: pixels on their way from the GPU (images.HostPixels)

    @property
    def preview(self) -> bytes | None:
        if self.preview_data is not None and not isinstance(self.preview_data, bytes):
            self.preview_data = png_of(self.preview_data)
        return self.preview_data

    def __eq__(self, other: object) -> bool:      # by the preview's pixels, however far along they are
        return isinstance(other, Step) and (self.i, self.n) == (other.i, other.n) and \
            _same_pixels(self.preview_data, other.preview_data)


@dataclass(eq=False)
class Image:
    """One finished image. A request for n images emits n of these, `index` 0..n-1; image k's noise
    was drawn with seed `seed` (the request's seed + k); all share the request's reasoning. `data`: its
    PNG, or its pixels (uint8 [height, width, 3]) until the PNG is first asked for: the engine hands the
    pixels over and the PNG is encoded outside its loop (a 1024 px PNG is ~0.1-0.2 s of a CPU core that
    the GPU would otherwise wait for: engine/serve/worker.py `Sender`), and only where it is read."""
    data: bytes | np.ndarray
    width: int
    height: int
    seed: int
    index: int = 0

    @property
    def png(self) -> bytes:
        if not isinstance(self.data, bytes):
            self.data = png_of(self.data)
        return self.data

    def __eq__(self, other: object) -> bool:      # by the pixels, however far along they are (none encoded)
        return isinstance(other, Image) and (self.width, self.height, self.seed, self.index) == \
            (other.width, other.height, other.seed, other.index) and _same_pixels(self.data, other.data)


def _same_pixels(a: Any, b: Any) -> bool:
    """Whether two images' data (a PNG's bytes, or pixels) hold the same pixels: an equality test (the tests'
    comparison of two runs' events) must not encode, or wait for, what the sender would."""
    if a is None or b is None:
        return a is b
    if isinstance(a, bytes) and isinstance(b, bytes):
        return a == b
    return np.array_equal(_decoded(a), _decoded(b))


def _decoded(data: Any) -> np.ndarray:
    return np.asarray(PILImage.open(io.BytesIO(data))) if isinstance(data, bytes) else np.asarray(data)


def png_of(pixels: Any) -> bytes:
    """uint8 [H, W, 3] (an array, or what `np.asarray` makes one of) -> the PNG's bytes."""
    buf = io.BytesIO()
    PILImage.fromarray(np.asarray(pixels)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Error:
    """kind: 'invalid' (bad input, nothing ran), 'busy' (the queue is full, nothing ran), 'cancelled',
    'engine' (a failure while running, or an engine that is not running). `param`: for 'invalid', the
    Request field at fault (RequestError.field), so a front end can name its own control or API field
    without reading the message; None when the request as a whole is at fault or nobody said."""
    kind: str
    message: str
    param: str | None = None


@dataclass
class Timings:
    ar_prefill_ms: float = 0.0
    ar_tokens: int = 0            # tokens the model sampled (each one decode step after the first)
    ar_forced: int = 0            # tokens the stage machine forced (they cost no step of their own)
    ar_ms_per_token: float = 0.0  # per sampled token after the first
    dit_steps: int = 0
    dit_ms_per_step: float = 0.0
    dit_full_steps: int = 0       # steps that ran the backbone; the others were forecast by the step cache
    vae_ms: float = 0.0
    total_s: float = 0.0
    dit_prefill_ms: float = 0.0   # the uncached prefix (the uncond branch's, with CFG) before the first step
    kv_reused_tokens: int = 0     # prefix tokens the denoise cond branch took from the AR cache
    ar_prompt_tokens: int = 0     # the AR phase's prompt (the whole sequence it read)
    ar_cached_tokens: int = 0     # of them, tokens whose K/V came from the prefix cache (not prefilled)

    def parts(self) -> list[str]:
        """The measured figures as short plain phrases (the page and the command line show them): the
        reasoning's sampled tokens (the ones the stage machine forced cost no step and are not counted),
        the prompt's read (prefill), the denoising steps, the image's decode, the engine's total."""
        out = []
        read = f"{self.ar_prefill_ms:.0f} ms"
        if self.ar_cached_tokens:
            read += f", {self.ar_cached_tokens} of its {self.ar_prompt_tokens} tokens cached"
        if self.ar_tokens > 1:
            out.append(f"reasoning {self.ar_tokens} tokens at {self.ar_ms_per_token:.1f} ms/token (prompt read in {read})")
        elif self.ar_tokens:     # one choice only (the size, with reasoning off): no decode to time
            out.append(f"prompt read and size chosen in {read}")
        if self.dit_steps:
            full = f" ({self.dit_full_steps} in full)" if 0 < self.dit_full_steps < self.dit_steps else ""
            out.append(f"denoising {self.dit_steps} steps{full} at {self.dit_ms_per_step:.0f} ms/step")
        if self.vae_ms:
            out.append(f"image decoded in {self.vae_ms:.0f} ms")
        out.append(f"engine total {self.total_s:.2f} s")
        return out

    def summary(self) -> str:
        return ", ".join(self.parts())


@dataclass
class Done:
    """The request's end. On a GPU its `timings` of device work (the image prefix's prefill, the steps, the
    VAE decode, the total until the image reached the host) are settled when first read (`later`): reading
    them waits for that work, which the engine's loop must not do (it goes on launching other requests'
    steps); the worker's sender reads them, off the loop, when it sends the event (a pickle settles them)."""
    timings: Timings = field(default_factory=Timings)
    cot_text: str = ""

    def later(self, settle: Callable[[Timings], None]) -> "Done":
        """Fill the device work's timings by `settle(timings)` when they are first read, not now."""
        self.__dict__["_settle"] = settle
        return self

    def __getstate__(self) -> dict:
        self.timings                                   # noqa: B018 - settles them: a closure does not travel
        return dict(self.__dict__)


def _done_timings(self: Done) -> Timings:
    settle = self.__dict__.pop("_settle", None)
    if settle is not None:
        settle(self.__dict__["_timings"])
    return self.__dict__["_timings"]


def _set_done_timings(self: Done, t: Timings) -> None:
    self.__dict__["_timings"] = t


# after @dataclass made its __init__, __eq__ and __repr__, which all read and write `timings` through this
Done.timings = property(_done_timings, _set_done_timings)     # type: ignore[assignment]


Event = Union[Started, Text, Ratio, Denoising, Step, Image, Error, Done]
