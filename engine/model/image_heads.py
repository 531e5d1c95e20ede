"""Image-side embedders and heads of the transformer: timestep embedders, the UNet-style patch
embedding (latent -> tokens, `patch_embed`) and final layer (tokens -> velocity, `final_layer`).
Parameter names follow the official modules (patch_size 1, the released configuration)."""
from __future__ import annotations

import math

import torch
from torch import nn


def timestep_features(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of t [N] (in t*1000 units): cat[cos, sin], cos first."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int = 256, dtype=None, device=None):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden, dtype=dtype, device=device), nn.GELU(),
                                 nn.Linear(hidden, hidden, dtype=dtype, device=device))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_features(t, self.freq_dim).to(self.mlp[0].weight.dtype))


def _group_norm(ch: int, dtype, device) -> nn.GroupNorm:
    if ch % 32:
        raise ValueError(f"the image heads use GroupNorm(32, ·): {ch} channels are not a multiple of 32")
    return nn.GroupNorm(32, ch, dtype=dtype, device=device)


class ResBlock(nn.Module):
    """h = conv(silu(GN(x))); h = conv(silu(GN(h) * (1 + scale) + shift)); skip(x) + h."""

    def __init__(self, cin: int, emb: int, cout: int, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.in_layers = nn.Sequential(_group_norm(cin, **kw), nn.SiLU(), nn.Conv2d(cin, cout, 3, padding=1, **kw))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb, 2 * cout, **kw))
        self.out_layers = nn.Sequential(_group_norm(cout, **kw), nn.SiLU(), nn.Dropout(0.0),
                                        nn.Conv2d(cout, cout, 3, padding=1, **kw))
        self.skip_connection = nn.Identity() if cin == cout else nn.Conv2d(cin, cout, 1, **kw)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        scale, shift = self.emb_layers(emb)[..., None, None].chunk(2, dim=1)
        h = self.out_layers[0](h) * (1.0 + scale) + shift
        for layer in self.out_layers[1:]:
            h = layer(h)
        return self.skip_connection(x) + h


class UNetDown(nn.Module):
    """Latent [B, C, h, w] -> tokens [B, h*w, hidden] (row-major), conditioned on a time embedding."""

    def __init__(self, latent: int, inner: int, hidden: int, dtype=None, device=None):
        super().__init__()
        self.model = nn.ModuleList([nn.Conv2d(latent, inner, 3, padding=1, dtype=dtype, device=device),
                                    ResBlock(inner, hidden, hidden, dtype=dtype, device=device)])

    def forward(self, z: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        x = self.model[1](self.model[0](z), t_emb)
        return x.flatten(2).transpose(1, 2)


class UNetUp(nn.Module):
    """Tokens [B, h*w, hidden] -> velocity [B, C, h, w]."""

    def __init__(self, hidden: int, inner: int, latent: int, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.model = nn.ModuleList([ResBlock(hidden, hidden, inner, **kw),
                                    nn.Sequential(_group_norm(inner, **kw), nn.SiLU(),
                                                  nn.Conv2d(inner, latent, 3, padding=1, **kw))])

    def forward(self, tokens: torch.Tensor, t_emb: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)
        return self.model[1](self.model[0](x, t_emb))
