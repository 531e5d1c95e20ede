"""The input side of OpenAI's `usage`: the tokens of the request's user turn (system prompt, earlier turns,
prompt and reference images) as the model reads them. The engine counts them where it builds that turn
(engine/runtime/program.py, from the request as it was prepared: the images' layouts computed once, where
the request entered) and reports them as it starts (`Started`); the server only passes the figure on, so
it is the engine's, not an estimate, and nothing is tokenized or decoded twice for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.events import Started


@dataclass(frozen=True)
class InputTokens:
    text: int
    image: int

    @property
    def total(self) -> int:
        return self.text + self.image

    @classmethod
    def of(cls, started: Started) -> "InputTokens":
        return cls(started.input_text_tokens, started.input_image_tokens)
