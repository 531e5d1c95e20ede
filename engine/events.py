"""What a request emits while it runs. Plain, picklable dataclasses: the same objects travel from the
engine's worker processes to the server, the CLI, the studio and the benchmarks."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Union


@dataclass
class Started:
    request_id: str
    bot_task: str
    size: str                 # "auto" or "HxW"
    steps: int
    guidance: float


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
class Step:
    """Denoising step i of n finished; `preview` is a small PNG (bytes) of the current estimate, or None."""
    i: int
    n: int
    preview: bytes | None = None


@dataclass
class Image:
    png: bytes
    width: int
    height: int
    seed: int


@dataclass
class Error:
    """kind: 'invalid' (bad input, nothing ran), 'cancelled', 'engine' (a failure while running)."""
    kind: str
    message: str


@dataclass
class Timings:
    ar_prefill_ms: float = 0.0
    ar_tokens: int = 0
    ar_ms_per_token: float = 0.0
    dit_steps: int = 0
    dit_ms_per_step: float = 0.0
    vae_ms: float = 0.0
    total_s: float = 0.0
    kv_reused_tokens: int = 0     # prefix tokens the denoise cond branch took from the AR cache

    def summary(self) -> str:
        parts = []
        if self.ar_tokens:
            parts.append(f"AR prefill {self.ar_prefill_ms:.0f} ms, {self.ar_tokens} tokens at "
                         f"{self.ar_ms_per_token:.1f} ms/token")
        if self.dit_steps:
            parts.append(f"DiT {self.dit_steps} steps at {self.dit_ms_per_step:.0f} ms/step")
        if self.vae_ms:
            parts.append(f"VAE {self.vae_ms:.0f} ms")
        parts.append(f"total {self.total_s:.2f} s")
        return ", ".join(parts)


@dataclass
class Done:
    timings: Timings = field(default_factory=Timings)
    cot_text: str = ""


Event = Union[Started, Text, Ratio, Step, Image, Error, Done]


def to_dict(e: Event) -> dict[str, Any]:
    return {"type": type(e).__name__, **asdict(e)}
