"""Reference images as the model sees them, and the embedding of sequence ranges.

A reference image is encoded once per request: VAE posterior sample (drawn from the request's
generator, in image order, before the initial noise) through `patch_embed` at t=0, and SigLIP2 +
aligner features. Both phases (AR and denoise) and both CFG branches share that encoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from engine.model.hunyuan import HunyuanImage3
from engine.model.vit import vit_preprocess
from engine.runtime.images import fit_to_bucket, reference_bucket, to_tensor
from engine.runtime.sequence import CondImageLayout, Sequence
from engine.spec.buckets import Bucket


@dataclass
class EncodedImage:
    layout: CondImageLayout
    vae_tokens: torch.Tensor     # [h*w, H] patch_embed(latent, t=0), model dtype
    vit_tokens: torch.Tensor     # [vit_len, H] aligner(ViT), model dtype


@torch.no_grad()
def encode_references(model: HunyuanImage3, images: list[Image.Image], buckets: tuple[Bucket, ...],
                      generator: torch.Generator | None, stretch: bool = False) -> list[EncodedImage]:
    cfg, dev, dt = model.cfg, model.device, model.dtype
    factor = cfg.vae_downsample_factor[0]
    out = []
    zero = torch.zeros(1, device=dev)
    t_emb = model.time_embed(zero)
    for img in images:
        bucket = reference_bucket(buckets, img)
        pixels = to_tensor(fit_to_bucket(img, bucket, stretch)).unsqueeze(0).to(dev)
        with model.vae_autocast():
            latent = model.vae.encode_latent(pixels, generator)                  # [1, C, h, w]
        vae_tokens = model.patch_embed(latent.to(dt), t_emb)[0]
        vit = vit_preprocess(img, cfg.vit_processor)
        feats = model.vision_model(vit.pixel_values[None].to(dev), vit.pixel_attention_mask[None].to(dev),
                                   [vit.spatial_shapes])
        vit_tokens = model.vision_aligner(feats)[0].to(dt)
        layout = CondImageLayout((bucket.height // factor, bucket.width // factor), bucket.index,
                                 vit.spatial_shapes, vit.pixel_values.shape[0])
        out.append(EncodedImage(layout, vae_tokens, vit_tokens))
    return out


def embed_range(model: HunyuanImage3, seq: Sequence, ids: torch.Tensor, refs: list[EncodedImage],
                start: int, stop: int) -> torch.Tensor:
    """Embeddings [B, stop-start, H] of tokens [start, stop) of `seq` (ids [B, L]: cond / uncond rows):
    text from the embedding table, reference-image slots from their encodings, and each reference
    image's <timestep> slot from timestep_emb(0). The generated image's slots are not filled here."""
    x = model.transformer.embed(ids[:, start:stop])
    if refs:
        ts = model.timestep_emb(torch.zeros(1, device=x.device)).to(x.dtype)[0]
        for span, enc in zip(seq.cond_images, refs):
            for sl, tokens in ((span.vae, enc.vae_tokens), (span.vit, enc.vit_tokens)):
                lo, hi = max(sl.start, start), min(sl.stop, stop)
                if lo < hi:
                    x[:, lo - start:hi - start] = tokens[lo - sl.start:hi - sl.start]
            if start <= span.timestep < stop:
                x[:, span.timestep - start] = ts
    return x
