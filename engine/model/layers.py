"""Small shared building blocks: RMSNorm (the `rms_norm` kernel op) and the generalised 2D RoPE tables."""
from __future__ import annotations

import torch
from torch import nn

import hunyuan_kernels as kernels


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) in fp32, cast back to the input dtype, then times the weight
    (the official HunyuanRMSNorm; the weight multiply happens in the input dtype)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.call("rms_norm", x, self.weight, self.eps)


def rope_angles(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] (fp32) for 2D positions `pos` [T, 2] = (y, x).

    Frequency k of the head_dim/2 frequencies rotates by y when k is even and by x when k is odd; the
    head_dim/2 angles are tiled twice (rotate-half pairing of dims i and i + head_dim/2). For text
    tokens y == x == index, which is plain 1D RoPE.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float32) / head_dim))
    inv = inv.view(1, head_dim // 4, 2)
    ang = (pos.view(-1, 1, 2).float() * inv).reshape(pos.shape[0], head_dim // 2).repeat(1, 2)
    return ang.cos(), ang.sin()
