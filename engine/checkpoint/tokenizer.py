"""The checkpoint's `tokenizer.json`, with every special token resolved by name.

Ids are never hard-coded: a tokenizer that lacks a token the engine needs fails at load with the
token's name. Text sections are encoded one by one without added specials (no BPE merge crosses a
section boundary), as the official template does; special-token strings inside a section become
their single ids because they are registered as added tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

# Every special token of the official tokenizer, in its registration order (names only; ids differ
# between our tiny tokenizers and the real one and are always looked up).
OFFICIAL_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|startoftext|>",
    "<boi>", "<eoi>", "<boa>", "<eoa>", "<bov>", "<eov>", "<img>", "<audio>", "<video>", "<pad>", "<cfg>",
    "<iw>", "<ih>", "<bot>", "<eot>", "<text>", "<mask>", "<timestep>", "<recaption>", "</recaption>",
    "<bof>", "<eof>", "<face>", "<think>", "</think>", "<answer>", "</answer>",
    "<und_boi>", "<und_eoi>", "<src_boi>", "<src_eoi>", "<gen_boi>", "<gen_eoi>", "<gen_img>",
    *(f"<img_size_{s}>" for s in (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)),
    *(f"<img_ratio_{i}>" for i in range(33)),
    "<joint_img_sep>", "<ref>", "</ref>", "<quad>", "</quad>",
    *(f"<pos_x_{i}>" for i in range(1000)),
    *(f"<pos_y_{i}>" for i in range(1000)),
    "<guidance>",
    *(f"<relation_{i}>" for i in range(10)),
    *(f"</relation_{i}>" for i in range(10)),
    *(f"<img_ratio_{i}>" for i in range(33, 37)),
    "<timestep_r>",
)


class TokenizerError(ValueError):
    """The tokenizer file is missing, unreadable, or lacks a token the engine needs."""


@dataclass(frozen=True)
class SpecialIds:
    bos: int
    eos: int
    pad: int
    boi: int
    eoi: int
    img: int
    cfg: int
    timestep: int
    timestep_r: int
    guidance: int
    joint_img_sep: int
    answer: int
    end_answer: int
    think: int
    end_think: int
    recaption: int
    end_recaption: int
    size: int                   # <img_size_{image_base_size}>
    ratio: tuple[int, ...]      # <img_ratio_k> for every bucket k, in bucket order (ids are not contiguous)


_NAMED = {
    "bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<pad>", "boi": "<boi>", "eoi": "<eoi>",
    "img": "<img>", "cfg": "<cfg>", "timestep": "<timestep>", "timestep_r": "<timestep_r>",
    "guidance": "<guidance>", "joint_img_sep": "<joint_img_sep>", "answer": "<answer>",
    "end_answer": "</answer>", "think": "<think>", "end_think": "</think>", "recaption": "<recaption>",
    "end_recaption": "</recaption>",
}


class Tokenizer:
    def __init__(self, path: str | Path, image_base_size: int, num_buckets: int):
        path = Path(path)
        if not path.exists():
            raise TokenizerError(f"tokenizer.json not found in {path.parent}")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed files
            raise TokenizerError(f"cannot read {path}: {e}") from None
        ids = {field: self.token_id(name) for field, name in _NAMED.items()}
        ids["size"] = self.token_id(f"<img_size_{image_base_size}>")
        ids["ratio"] = tuple(self.token_id(f"<img_ratio_{k}>") for k in range(num_buckets))
        self.special = SpecialIds(**ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int:
        i = self._tok.token_to_id(name)
        if i is None:
            raise TokenizerError(f"tokenizer.json lacks the special token {name!r}")
        return i

    def encode(self, text: str) -> list[int]:
        """One section: no BOS/EOS added, special-token strings become their ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Special tokens are kept, as the official CoT decode does."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TextStream:
    """Turns a stream of token ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        delta, self._emitted = text[self._emitted:], len(text)
        return delta
