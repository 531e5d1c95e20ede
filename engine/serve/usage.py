"""The input side of OpenAI's `usage`: the tokens of the request's user turn (system prompt, prompt and
reference images) as the model reads them, counted by building that turn with the engine's own sequence
builder and the checkpoint's tokenizer, so the figure is the engine's, not an estimate.

A reference image takes its VAE latent grid (by its resolution bucket) plus the ViT's fixed
`max_num_patches` slots and a few marker tokens; its size is read from the file's header (with its EXIF
orientation), nothing is decoded.
"""
from __future__ import annotations

import io
import threading
from dataclasses import dataclass

from PIL import Image as PILImage

from engine.model.vit import naflex_target_size
from engine.runtime.history import select
from engine.runtime.request import Request
from engine.runtime.sequence import CondImageLayout, PastTurnLayout, SequenceBuilder, user_turn
from engine.serve.info import ModelInfo
from engine.spec.buckets import nearest_bucket
from engine.spec.prompts import SystemPrompts
from engine.spec.tokenizer import Tokenizer

_ROTATED = (5, 6, 7, 8)          # EXIF orientations that swap width and height


@dataclass(frozen=True)
class InputTokens:
    text: int
    image: int

    @property
    def total(self) -> int:
        return self.text + self.image


class InputCounter:
    """Counts a request's input tokens; the tokenizer and system prompts are read once, on first use."""

    def __init__(self, info: ModelInfo):
        self.info = info
        self._lock = threading.Lock()
        self._tok: Tokenizer | None = None
        self._prompts: SystemPrompts | None = None

    def _load(self) -> tuple[Tokenizer, SystemPrompts]:
        with self._lock:
            if self._tok is None:
                self._tok = Tokenizer(self.info.folder / "tokenizer.json", self.info.cfg.image_base_size,
                                      len(self.info.buckets))
                self._prompts = SystemPrompts.load(self.info.folder)
            return self._tok, self._prompts

    def _layout(self, data: "bytes | PILImage.Image") -> CondImageLayout:
        if isinstance(data, PILImage.Image):               # an earlier turn's image, already opened
            w, h = data.size
        else:
            with PILImage.open(io.BytesIO(data)) as img:   # the header only
                w, h = img.size
                if img.getexif().get(0x0112, 1) in _ROTATED:
                    w, h = h, w
        f = self.info.cfg.vae_downsample_factor[0]
        b = nearest_bucket(self.info.buckets, h, w)
        proc = self.info.cfg.vit_processor
        p, slots = int(proc["patch_size"]), int(proc["max_num_patches"])
        vh, vw = naflex_target_size(h, w, p, slots)
        return CondImageLayout((b.height // f, b.width // f), b.index, (vh // p, vw // p), slots)

    def count(self, req: Request) -> InputTokens:
        """The request (validated, its images as bytes) as the model's user turn, with the earlier turns its
        history policy shows (engine/runtime/history.py): (text, image) tokens."""
        tok, prompts = self._load()
        gen = self.info.gen
        system = prompts.resolve(req.system_prompt or gen.use_system_prompt, req.bot_task or gen.bot_task,
                                 req.custom_system_prompt)
        seen, carried = select(req.history, len(req.images), req.history_policy)
        layouts = [self._layout(img) for img in carried + list(req.images)]
        past = [PastTurnLayout(t.prompt, tuple(self._layout(i) for i in t.images), t.reasoning,
                               None if t.image is None else self._layout(t.image)) for t in seen]
        seq = user_turn(SequenceBuilder(tok, self.info.cfg.cond_token_attn_type), system, req.prompt, layouts,
                        past).build()
        image = sum((s.vae.stop - s.vae.start) + (s.vit.stop - s.vit.start) for s in seq.cond_images)
        return InputTokens(len(seq.ids) - image, image)
