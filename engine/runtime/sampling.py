"""Next-token choice: temperature, top-k, top-p (in that order, as the HF warpers), seeded
multinomial; or greedy. Optionally restricted to an allowed id set (the ratio tokens)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.6
    top_k: int = 1024
    top_p: float = 0.95
    greedy: bool = False


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] fp32 -> token id (0-d long tensor on the logits' device).

    `allowed` (ids) restricts the choice and forces greedy, as the official ratio-token processor does.
    """
    if allowed is not None:
        return allowed[logits.index_select(0, allowed).argmax()]
    if params.greedy:
        return logits.argmax()
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= (1 - params.top_p)
        drop[-1] = False                      # keep at least the most likely token
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = x.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[0]
