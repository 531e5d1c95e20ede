"""SigLIP2-so400m-patch16-naflex vision encoder, its NaFlex preprocessing, and the vision aligner.

Used for the ViT half of a TI2I reference image: ``vit_preprocess`` turns a PIL image into a padded
sequence of flattened 16x16 patches, ``Siglip2VisionModel`` encodes it, ``VisionAligner`` projects
it to the backbone width. Every one of the ``max_num_patches`` outputs, padding rows included, is
scattered into the ``<img>`` slots of the sequence, so padding rows must be computed exactly like
the official code does (they are not masked out of the output, only out of the attention keys).

State-dict keys equal the official ones under ``vision_model.`` / ``vision_aligner.``. The
official pooling head (``vision_model.head.*``) is never used at inference and is not built here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor, nn

__all__ = [
    "VitInput",
    "naflex_target_size",
    "vit_preprocess",
    "vit_resize",
    "vit_patches",
    "Siglip2VisionModel",
    "VisionAligner",
]


# --------------------------------------------------------------------------------------------
# Preprocessing (matches transformers' Siglip2ImageProcessorFast as called by the official code)
# --------------------------------------------------------------------------------------------


@dataclass
class VitInput:
    pixel_values: Tensor  # [N, C*p*p] float32, N = max_num_patches, rows are (p, p, C) channels-last
    pixel_attention_mask: Tensor  # [N] bool, True for real patches
    spatial_shapes: tuple[int, int]  # (h, w) in patches, h*w <= N


def naflex_target_size(height: int, width: int, patch_size: int, max_num_patches: int) -> tuple[int, int]:
    """Pixel size (h, w), multiples of ``patch_size``, that the image is resized to.

    Same bisection over a common scale factor as HF's ``get_image_size_for_max_num_patches``:
    each side is ``ceil(side * scale / p) * p`` (at least one patch), and the largest scale whose
    patch grid fits in ``max_num_patches`` wins. The float arithmetic is kept identical so the
    chosen grid matches the reference bit for bit (a different search would pick other sizes at
    the boundaries).
    """

    def scaled(side: int, scale: float) -> int:
        return max(patch_size, math.ceil(side * scale / patch_size) * patch_size)

    eps = 1e-5
    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        mid = (lo + hi) / 2
        n = (scaled(height, mid) / patch_size) * (scaled(width, mid) / patch_size)
        if n <= max_num_patches:
            lo = mid
        else:
            hi = mid
    return scaled(height, lo), scaled(width, lo)


def _resize_uint8(img: Tensor, size: tuple[int, int]) -> Tensor:
    """Antialiased bilinear resize of a [C, H, W] uint8 image, as torchvision's ``F.resize`` does it.

    On x86 CPUs with AVX2/AVX512 (and on aarch64) torchvision hands the uint8 tensor straight to
    ``F.interpolate(mode="bilinear", antialias=True, align_corners=False)``, whose uint8 kernel
    works in fixed point and rounds internally; we call the same kernel. Converting to float,
    interpolating and rounding (torchvision's path on GPU or on CPUs without AVX2) can differ
    by 1 grey level on some pixels, so we always resize on the CPU in uint8.
    """
    if tuple(img.shape[-2:]) == tuple(size):
        return img  # torchvision returns the input untouched when the size does not change
    out = F.interpolate(img.cpu().unsqueeze(0), size=size, mode="bilinear", align_corners=False, antialias=True)
    return out[0]


def vit_preprocess(image: Image.Image, proc_cfg: dict) -> VitInput:
    """NaFlex preprocessing of one image; ``proc_cfg`` is config.json's ``vit_processor``.

    Steps, in the reference's order: aspect-preserving resize so that the patch grid fits in
    ``max_num_patches`` (``vit_resize``); rescale+normalize; split into patches flattened channels-last
    (p, p, C); zero-pad the sequence to ``max_num_patches`` with a mask (``vit_patches``).

    The official loader (``transformers.image_utils.load_image``) applies the EXIF orientation and
    converts to RGB before this; we convert to RGB here too, EXIF handling is the caller's job.
    """
    return vit_patches(vit_resize(image, proc_cfg), proc_cfg)


def vit_resize(image: Image.Image, proc_cfg: dict) -> Tensor:
    """The image as the NaFlex preprocessing resizes it (the first step of ``vit_preprocess``): [C, h, w]
    uint8, RGB, h and w multiples of the patch size (with ``do_resize``). What the ViT consumes of an
    image of any size: a request keeps this, not the image it was given."""
    if proc_cfg.get("resample", 2) != 2:
        raise NotImplementedError(f"only bilinear resampling (2) is supported, got {proc_cfg.get('resample')}")
    p = int(proc_cfg["patch_size"])
    max_patches = int(proc_cfg["max_num_patches"])
    if image.mode != "RGB":
        image = image.convert("RGB")
    img = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)  # [C, H, W] uint8
    if proc_cfg.get("do_resize", True):
        img = _resize_uint8(img, naflex_target_size(img.shape[1], img.shape[2], p, max_patches))
    return img.contiguous()


def vit_patches(img: Tensor, proc_cfg: dict) -> VitInput:
    """The resized image [C, h, w] uint8 (``vit_resize``) rescaled, normalized and cut into the padded
    sequence of flattened patches (the rest of ``vit_preprocess``)."""
    p = int(proc_cfg["patch_size"])
    max_patches = int(proc_cfg["max_num_patches"])
    do_rescale, do_norm = proc_cfg.get("do_rescale", True), proc_cfg.get("do_normalize", True)
    rescale = float(proc_cfg.get("rescale_factor", 1 / 255))
    x = img.to(torch.float32)
    mean = torch.tensor(proc_cfg.get("image_mean", [0.5] * 3), dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(proc_cfg.get("image_std", [0.5] * 3), dtype=torch.float32).view(-1, 1, 1)
    if do_rescale and do_norm:
        # The reference folds the rescale into mean/std ((x - 255m) / 255s) instead of computing
        # (x/255 - m) / s; the two round differently in float32, so fold the same way.
        x = (x - mean * (1.0 / rescale)) / (std * (1.0 / rescale))
    elif do_norm:
        x = (x - mean) / std
    elif do_rescale:
        x = x * rescale

    c, height, width = x.shape
    hp, wp = height // p, width // p
    patches = x.reshape(c, hp, p, wp, p).permute(1, 3, 2, 4, 0).reshape(hp * wp, p * p * c)
    n = hp * wp
    if n > max_patches:
        raise ValueError(f"{n} patches exceed max_num_patches={max_patches} (do_resize off?)")
    pixel_values = torch.zeros(max_patches, p * p * c, dtype=torch.float32)
    pixel_values[:n] = patches
    mask = torch.zeros(max_patches, dtype=torch.bool)
    mask[:n] = True
    return VitInput(pixel_values=pixel_values, pixel_attention_mask=mask, spatial_shapes=(hp, wp))


# --------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------


def _activation(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda t: F.gelu(t, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported hidden_act {name!r}")


class _Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        p, c, d = cfg["patch_size"], cfg["num_channels"], cfg["hidden_size"]
        self.grid = math.isqrt(cfg["num_patches"])  # learned positions form a square grid
        if self.grid**2 != cfg["num_patches"]:
            raise ValueError(f"num_patches={cfg['num_patches']} is not a square")
        self.patch_embedding = nn.Linear(c * p * p, d)
        self.position_embedding = nn.Embedding(cfg["num_patches"], d)

    def positions(self, shape: tuple[int, int], length: int) -> Tensor:
        """Position grid resized to ``shape`` patches, flattened row-major and padded to ``length``.

        Bilinear, align_corners=False, antialias=True as in the reference (antialias matters when
        the grid shrinks below 16 on a side). Padding rows get the first resized position, as in
        the reference. The reference upcasts to fp32 only on CPU (no half-precision antialias
        kernel there) and otherwise interpolates in the weight dtype; we do the same, because the
        CUDA kernel rounds to bf16 between its two separable passes, so fp32-then-cast differs from
        it by one bf16 ulp on about a third of the elements (measured on an H200, torch 2.11).
        """
        h, w = shape
        weight = self.position_embedding.weight
        grid = weight.reshape(self.grid, self.grid, -1).permute(2, 0, 1).unsqueeze(0)
        if grid.device.type == "cpu":
            grid = grid.float()
        pos = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
        pos = pos.reshape(weight.shape[1], h * w).t().to(weight.dtype)
        if length > h * w:
            pos = torch.cat([pos, pos[:1].expand(length - h * w, -1)])
        return pos

    def forward(self, pixel_values: Tensor, spatial_shapes: list[tuple[int, int]]) -> Tensor:
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        n = pixel_values.shape[1]
        pos = torch.stack([self.positions((int(h), int(w)), n) for h, w in spatial_shapes])
        return x + pos


class _Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        d = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        if d % self.heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        b, n, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        # key_mask [B, 1, 1, N] bool: padded keys get no weight; padded queries are still computed
        # because their outputs are used downstream.
        o = F.scaled_dot_product_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
                                           attn_mask=key_mask)
        return self.out_proj(o.transpose(1, 2).reshape(b, n, d))


class _MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.fc1 = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.fc2 = nn.Linear(cfg["intermediate_size"], cfg["hidden_size"])
        self.act = _activation(cfg["hidden_act"])

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = _Attention(cfg)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = _MLP(cfg)

    def forward(self, x: Tensor, key_mask: Tensor | None) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class Siglip2VisionModel(nn.Module):
    """SigLIP2 NaFlex vision tower without the pooling head; ``cfg`` is config.json's ``vit``."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = dict(cfg)
        self.embeddings = _Embeddings(cfg)
        self.encoder = _Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    def forward(self, pixel_values: Tensor, pixel_attention_mask: Tensor | None,
                spatial_shapes: list[tuple[int, int]] | Tensor) -> Tensor:
        """[B, N, C*p*p] patches -> [B, N, hidden] (post_layernorm applied, padding rows included)."""
        x = self.embeddings(pixel_values, [tuple(s) for s in spatial_shapes])
        key_mask = None if pixel_attention_mask is None else pixel_attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)


class VisionAligner(nn.Module):
    """Projector from ViT width to backbone width; ``cfg`` is config.json's ``vit_aligner``.

    ``mlp_gelu`` is Linear, then (exact GELU, Linear) * (depth - 1), kept as one Sequential named
    ``layers`` so the checkpoint keys are ``layers.0``, ``layers.2``, ...
    """

    def __init__(self, cfg: dict):
        super().__init__()
        kind, d_in, d_out = cfg["projector_type"], cfg["input_dim"], cfg["n_embed"]
        if kind == "linear":
            self.layers: nn.Module = nn.Linear(d_in, d_out)
        elif kind == "mlp_gelu":
            mods: list[nn.Module] = [nn.Linear(d_in, d_out)]
            for _ in range(1, cfg["depth"]):
                mods += [nn.GELU(), nn.Linear(d_out, d_out)]
            self.layers = nn.Sequential(*mods)
        else:
            raise ValueError(f"unknown projector_type {kind!r}")

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)
