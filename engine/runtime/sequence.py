"""Token sequences in the official `instruct` template, with their 2D RoPE positions, attention
blocks and CFG-uncond twin.

Sections are tokenized one at a time (no BPE merge crosses a boundary). Image sections carry their
meta tokens (`<boi> <img_size_B> <img_ratio_k> <timestep> [<guidance> <timestep_r>] <img>... <eoi>`).
Positions: text tokens get (i, i); an image span of h x w tokens starting at L gets
y = L + (hw - h)//2 + r, x = L + (hw - w)//2 + c (the official centred grid, integer form), and the
token after the span continues at L + hw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.checkpoint.tokenizer import Tokenizer

ROLE_USER, ROLE_BOT, SEP = "User: ", "Assistant: ", "\n\n"


@dataclass(frozen=True)
class CondImageLayout:
    """A reference image as the sequence sees it: its VAE latent grid and its ViT patch grid."""
    vae_hw: tuple[int, int]
    ratio_index: int
    vit_hw: tuple[int, int]
    vit_len: int                       # always max_num_patches (padded)


@dataclass(frozen=True)
class PastTurnLayout:
    """An earlier turn of a conversation as its sequence shows it (engine/runtime/history.py)."""
    prompt: str
    images: tuple[CondImageLayout, ...] = ()       # the user's references
    reasoning: str = ""                            # tagged CoT, or plain assistant text, or ''
    image: CondImageLayout | None = None           # the image the model made, now a conditioning image


@dataclass(frozen=True)
class GenImageSpan:
    """Where the generated image lives in a sequence."""
    meta_start: int                    # index of <timestep>; guidance/timestep_r follow for Distil
    start: int                         # first <img>
    h: int
    w: int

    @property
    def stop(self) -> int:
        return self.start + self.h * self.w

    @property
    def tail(self) -> slice:
        """The tokens recomputed at every denoise step after the first: meta tokens + image tokens."""
        return slice(self.meta_start, self.stop)


@dataclass(frozen=True)
class CondImageSpan:
    timestep: int                      # index of its <timestep> (embedded with t = 0)
    vae: slice
    vit: slice


@dataclass
class Sequence:
    ids: list[int] = field(default_factory=list)
    uncondable: list[bool] = field(default_factory=list)   # True where the CFG uncond branch has <cfg>
    pos: list[tuple[int, int]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)         # full-attention block id, -1 = causal
    cond_images: list[CondImageSpan] = field(default_factory=list)
    gen_image: GenImageSpan | None = None

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def image_tokens(self) -> int:
        """The tokens its conditioning images take (each one's VAE grid and ViT slots; not their markers)."""
        return sum((s.vae.stop - s.vae.start) + (s.vit.stop - s.vit.start) for s in self.cond_images)

    def uncond_ids(self, cfg_id: int) -> list[int]:
        return [cfg_id if u else t for t, u in zip(self.ids, self.uncondable)]

    def tensors(self, device: torch.device | str = "cpu", length: int | None = None) -> dict[str, torch.Tensor]:
        """ids [L], pos [length, 2], blocks [length]; positions and blocks beyond the sequence (room for
        tokens the AR phase will append) continue as causal text."""
        n = len(self.ids)
        length = max(length or n, n)
        pos = torch.arange(length, dtype=torch.long).unsqueeze(1).repeat(1, 2)
        pos[:n] = torch.tensor(self.pos, dtype=torch.long).view(n, 2)
        blocks = torch.full((length,), -1, dtype=torch.long)
        blocks[:n] = torch.tensor(self.blocks, dtype=torch.long)
        return {"ids": torch.tensor(self.ids, dtype=torch.long, device=device), "pos": pos.to(device),
                "blocks": blocks.to(device)}


class SequenceBuilder:
    def __init__(self, tok: Tokenizer, cond_attn: str = "joint_full"):
        self.tok, self.sp, self.cond_attn = tok, tok.special, cond_attn
        self.seq = Sequence()
        self._next_block = 0

    def fork(self) -> "SequenceBuilder":
        """A builder that continues from where this one is, on its own copy of the sequence so far."""
        b = SequenceBuilder(self.tok, self.cond_attn)
        q = self.seq
        b.seq = Sequence(list(q.ids), list(q.uncondable), list(q.pos), list(q.blocks), list(q.cond_images),
                         q.gen_image)
        b._next_block = self._next_block
        return b

    def _tokens(self, ids: list[int], uncond: bool = False, block: int = -1) -> None:
        n0 = len(self.seq.ids)
        self.seq.ids += ids
        self.seq.uncondable += [uncond] * len(ids)
        self.seq.pos += [(i, i) for i in range(n0, n0 + len(ids))]
        self.seq.blocks += [block] * len(ids)

    def _grid(self, start: int, h: int, w: int) -> None:
        """Overwrite the positions of the first h*w tokens from `start` with the centred 2D grid."""
        hw = h * w
        for r in range(h):
            for c in range(w):
                self.seq.pos[start + r * w + c] = (start + (hw - h) // 2 + r, start + (hw - w) // 2 + c)

    def _new_block(self) -> int:
        self._next_block += 1
        return self._next_block - 1

    def text(self, text: str, uncond: bool = False) -> "SequenceBuilder":
        self._tokens(self.tok.encode(text), uncond)
        return self

    def token(self, token_id: int) -> "SequenceBuilder":
        self._tokens([token_id])
        return self

    def cond_image(self, img: CondImageLayout) -> "SequenceBuilder":
        sp = self.sp
        (h, w), (vh, vw) = img.vae_hw, img.vit_hw
        self._tokens([sp.boi, sp.size, sp.ratio[img.ratio_index], sp.timestep])
        ts = len(self.seq) - 1
        joint = self.cond_attn == "joint_full"
        vae_block = self._new_block() if self.cond_attn in ("joint_full", "full", "full_causal") else -1
        vae0 = len(self.seq)
        self._tokens([sp.img] * (h * w), block=vae_block)
        self._grid(vae0, h, w)
        self._tokens([sp.joint_img_sep], block=vae_block if joint else -1)
        vit_block = vae_block if joint else (self._new_block() if self.cond_attn == "full" else -1)
        vit0 = len(self.seq)
        self._tokens([sp.img] * img.vit_len, block=vit_block)
        self._grid(vit0, vh, vw)
        self._tokens([sp.eoi])
        self.seq.cond_images.append(CondImageSpan(ts, slice(vae0, vae0 + h * w), slice(vit0, vit0 + img.vit_len)))
        return self

    def gen_image(self, h: int, w: int, ratio_index: int, distil: bool) -> "SequenceBuilder":
        sp = self.sp
        self._tokens([sp.boi, sp.size, sp.ratio[ratio_index]])
        meta = len(self.seq)
        self._tokens([sp.timestep, sp.guidance, sp.timestep_r] if distil else [sp.timestep])
        start = len(self.seq)
        self._tokens([sp.img] * (h * w), block=self._new_block())
        self._grid(start, h, w)
        self._tokens([sp.eoi])
        self.seq.gen_image = GenImageSpan(meta, start, h, w)
        return self

    def cot(self, cot_text: str) -> "SequenceBuilder":
        """The CoT of the image-stage sequence, split on its tags as the official get_cot_sections:
        tags are their own sections, the think/recaption texts are uncond-able."""
        def sections(text: str) -> list[tuple[str, bool]]:
            if not text:
                return []
            for open_, close in (("<think>", "</think>"), ("<recaption>", "</recaption>")):
                if open_ in text and close in text:
                    before = text.split(open_)[0]
                    after = text.split(close)[1]
                    inner = text.split(open_)[1].split(close)[0]
                    return sections(before) + [(open_, False), (inner, True), (close, False)] + sections(after)
            return [(text, True)]

        for piece, uncond in sections(cot_text):
            self.text(piece, uncond)
        return self

    def assistant_text(self, text: str) -> "SequenceBuilder":
        """An earlier assistant message's text: a CoT (it opens with its tag; cut short by the token
        budget it may lack the closing one) as the image phase read it, else one uncond-able
        `<answer>text</answer>` section (the official template's untagged assistant text)."""
        if text.startswith(("<think>", "<recaption>")):
            return self.cot(text)
        return self.text(f"<answer>{text}</answer>", uncond=True)

    def build(self) -> Sequence:
        return self.seq


BOT_PREFIX = {"auto": ROLE_BOT, "image": "", "think": ROLE_BOT + "<think>", "recaption": ROLE_BOT + "<recaption>"}


def user_turn(tok: Tokenizer, system: str, prompt: str, cond_images: list[CondImageLayout],
              history: "tuple[PastTurnLayout, ...] | list[PastTurnLayout]" = (),
              cond_attn: str = "joint_full") -> SequenceBuilder:
    """`<bos> [system \\n\\n] [earlier turns] User: [images] prompt \\n\\n`: a request's user turn, tokenized
    once and common to both phases (`text_phase_sequence`, `image_phase_sequence` continue a fork of it).
    An earlier turn is `User: [images] prompt \\n\\nAssistant: [reasoning] [image] \\n\\n`
    (engine/runtime/history.py says why)."""
    b = SequenceBuilder(tok, cond_attn)
    b.token(b.sp.bos)
    if system:
        b.text(system).text(SEP)
    for turn in history:
        _assistant_message(_user_message(b, turn.images, turn.prompt), turn.reasoning, turn.image)
    return _user_message(b, cond_images, prompt)


def _user_message(b: SequenceBuilder, images: "tuple[CondImageLayout, ...] | list[CondImageLayout]",
                  prompt: str) -> SequenceBuilder:
    b.text(ROLE_USER)
    for img in images:
        b.cond_image(img)
    return b.text(prompt, uncond=True).text(SEP)


def _assistant_message(b: SequenceBuilder, reasoning: str, image: CondImageLayout | None) -> SequenceBuilder:
    b.text(ROLE_BOT)
    if reasoning:
        b.assistant_text(reasoning)
    if image is not None:
        b.cond_image(image)
    return b.text(SEP)


def text_phase_sequence(turn: SequenceBuilder, first_task: str, image_base_size: int) -> Sequence:
    """The AR (gen_text) prompt: the user turn then the bot prefix of the first task
    (`think`, `recaption`, `auto`, `image`, or `img_ratio` for the one-step ratio pass)."""
    b = turn.fork()
    if first_task == "img_ratio":
        return b.text(f"{ROLE_BOT}<answer><boi><img_size_{image_base_size}>").build()
    return b.text(BOT_PREFIX[first_task]).build()


def image_phase_sequence(turn: SequenceBuilder, cot_text: str | None, h: int, w: int, ratio_index: int,
                         distil: bool) -> Sequence:
    """The denoising sequence: user turn, `Assistant: ` [CoT] `<answer>` image `</answer>\\n\\n` (no eos)."""
    b = turn.fork().text(ROLE_BOT)
    if cot_text:
        b.cot(cot_text)
    return b.text("<answer>").gen_image(h, w, ratio_index, distil).text("</answer>").text(SEP).build()


def next_turn_view(turn: SequenceBuilder, reasoning: str) -> Sequence:
    """This turn as the next turn of its conversation lays it out (an earlier turn: its user message, then
    its reasoning; the image it is making is not there yet), up to the next turn's own user message: where
    the next turn's sequence can take this one's K/V from (engine/runtime/prefix_cache.py)."""
    return _user_message(_assistant_message(turn.fork(), reasoning, None), [], "").build()
