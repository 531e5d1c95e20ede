"""Next-token choice: temperature, top-k, top-p (in that order, as the HF warpers), seeded; or greedy.
Optionally restricted to an allowed id set (the ratio tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

import hunyuan_kernels as kernels


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.6
    top_k: int = 1024
    top_p: float = 0.95
    greedy: bool = False


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] fp32 -> token id (0-d long tensor on the logits' device), through the `sample` kernel
    op (hunyuan_kernels/sampling.py: no full-vocabulary sort, no host sync).

    `allowed` (ids) restricts the choice and forces greedy, as the official ratio-token processor does.
    """
    return kernels.call("sample", logits, params.temperature, params.top_k, params.top_p, generator,
                        params.greedy, allowed)


def choose_rows(logits: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None],
                allowed: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The tokens [B] (long, on the logits' device) of a batched decode step in one call: the i-th is
    `choose(logits[rows[i]], params[i], generators[i], allowed[i])` for the same generator state, through
    the `sample_rows` kernel op (no host sync)."""
    return kernels.call("sample_rows", logits, rows, [p.temperature for p in params], [p.top_k for p in params],
                        [p.top_p for p in params], generators, [p.greedy for p in params], allowed)
