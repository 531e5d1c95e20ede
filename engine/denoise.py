"""The denoise phase: flow-matching Euler with the SD3 shift, CFG or Distil guidance tokens, and the
prefix KV cache (the first step runs the sequence, later steps only the meta + image tokens).

Rectified flow: sigma goes 1 (noise) -> 0 (data), the model predicts v ~ noise - x0 and the update
is x <- x + v * (sigma_next - sigma), in fp32. Model inputs are t = sigma * 1000.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from .model import HunyuanImage3
from .sequence import GenImageSpan


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """[steps + 1] fp32: linspace(1, 0) then sigma' = s*sigma / (1 + (s - 1)*sigma)."""
    s = torch.linspace(1, 0, steps + 1)
    return (shift * s) / (1 + (shift - 1) * s) if shift != 1.0 else s


def tail_embeddings(model: HunyuanImage3, x: torch.Tensor, t: torch.Tensor, r: torch.Tensor | None,
                    guidance: torch.Tensor | None) -> torch.Tensor:
    """[B, meta + h*w, H] for the latent x [B, C, h, w] at time t [B] (t*1000 units): the <timestep>
    token, Distil's <guidance> and <timestep_r> tokens, then the patch-embedded image tokens."""
    dt = model.dtype
    parts = [model.timestep_emb(t).to(dt)[:, None]]
    if guidance is not None:
        parts.append(model.guidance_emb(guidance).to(dt)[:, None])
    if r is not None:
        parts.append(model.timestep_r_emb(r).to(dt)[:, None])
    parts.append(model.patch_embed(x.to(dt), model.time_embed(t)))
    return torch.cat(parts, dim=1)


def velocity(model: HunyuanImage3, hidden: torch.Tensor, t: torch.Tensor, span: GenImageSpan) -> torch.Tensor:
    """Image-token hidden states [B, h*w, H] (last layer, no ln_f) -> velocity [B, C, h, w] fp32."""
    return model.final_layer(hidden, model.time_embed_2(t), span.h, span.w).float()


def denoise(model: HunyuanImage3, span: GenImageSpan, noise: torch.Tensor, steps: int, shift: float,
            guidance: float, cfg: bool, distil: bool, first_step: Callable[[torch.Tensor], torch.Tensor],
            next_step: Callable[[torch.Tensor], torch.Tensor],
            cancelled: Callable[[], bool] = lambda: False) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yields (i, x_next, x0_estimate) after each step; stops early when `cancelled()`.

    first_step(tail) / next_step(tail) run the backbone on the tail embeddings [B, meta+hw, H]
    (first_step also computes the prefix) and return the hidden states of the image tokens.
    """
    dev = noise.device
    sig = flow_sigmas(steps, shift).to(dev)
    ts = sig * 1000.0
    B = 2 if cfg else 1
    x = noise.float()
    g = torch.full((B,), 1000.0 * guidance, device=dev).to(torch.bfloat16).float() if distil else None
    for i in range(steps):
        if cancelled():
            return
        t = ts[i].expand(B)
        r = ts[i + 1].expand(B) if distil and model.timestep_r_emb is not None else None
        tail = tail_embeddings(model, x.expand(B, -1, -1, -1), t, r, g)
        hidden = (first_step if i == 0 else next_step)(tail)
        v = velocity(model, hidden, t, span)
        if cfg:
            v = v[1:2] + guidance * (v[0:1] - v[1:2])
        x0 = x - sig[i] * v
        x = x + (sig[i + 1] - sig[i]) * v
        yield i, x, x0
