"""Reference images as the model sees them, and the embedding of sequence ranges.

A reference image is encoded once per request: VAE posterior sample through `patch_embed` at t=0, and
SigLIP2 + aligner features. Both phases (AR and denoise) and both CFG branches share that encoding.

Where the VAE sample's noise comes from (`encode_sequence_images`):
- this turn's own references: drawn from the request's generator, in image order, before the initial
  noise (a single request gives what the official code gives);
- the images of a conversation's earlier turns (history.py: their references and the images the model
  made) come from the engine's `EncodingCache`, keyed by the image's content (its decoded pixels and the
  stretch option, which fix its bucket): every turn's own references are recorded there once encoded, so
  the next turn's history shows the very encoding the earlier turn saw, and its K/V prefix
  (prefix_cache.py) can match. A history image not in the cache (a made image, a client's own history,
  or one evicted) is encoded with noise seeded from its content digest, so it does not depend on the
  request, and is recorded. The cache is bounded in bytes, least recently used evicted first; an
  eviction can change what a later turn sees (another sample of the same posterior), never its layout.
Each encoding carries an `identity` naming the content and the noise it was drawn with, which every rank
computes alike from host data: the K/V prefix cache keys image tokens by it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.model.hunyuan import HunyuanImage3
from engine.model.vit import vit_patches
from engine.runtime.images import ModelImage, to_tensor
from engine.runtime.lru import ByteLRU
from engine.runtime.sequence import CondImageLayout, Sequence


@dataclass
class EncodedImage:
    layout: CondImageLayout
    vae_tokens: torch.Tensor     # [h*w, H] patch_embed(latent, t=0), model dtype
    vit_tokens: torch.Tensor     # [vit_len, H] aligner(ViT), model dtype
    identity: str = ""           # the content and the VAE noise it was encoded with (module docstring)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.vae_tokens, self.vit_tokens))


class EncodingCache:
    """Encodings of images by content digest, bounded in bytes, least recently used evicted first
    (max_bytes 0: nothing kept)."""

    def __init__(self, max_bytes: int):
        self.lru: ByteLRU[EncodedImage] = ByteLRU(max_bytes)
        self.hits = self.misses = 0

    def get(self, digest: str) -> EncodedImage | None:
        enc = self.lru.get(digest)
        self.hits, self.misses = self.hits + (enc is not None), self.misses + (enc is None)
        return enc

    def record(self, digest: str, enc: EncodedImage) -> None:
        self.lru.put(digest, enc, enc.nbytes)


@torch.no_grad()
def _encode(model: HunyuanImage3, img: ModelImage, generator: torch.Generator | None,
            identity: str = "") -> EncodedImage:
    dev, dt = model.device, model.dtype
    t_emb = model.time_embed(torch.zeros(1, device=dev))
    pixels = to_tensor(img.vae).unsqueeze(0).to(dev)
    with model.vae_autocast():
        latent = model.vae.encode_latent(pixels, generator)                  # [1, C, h, w]
    vae_tokens = model.patch_embed(latent.to(dt), t_emb)[0]
    vit = vit_patches(img.vit, model.cfg.vit_processor)
    feats = model.vision_model(vit.pixel_values[None].to(dev), vit.pixel_attention_mask[None].to(dev),
                               [vit.spatial_shapes])
    vit_tokens = model.vision_aligner(feats)[0].to(dt)
    return EncodedImage(img.layout, vae_tokens, vit_tokens, identity)


def encode_references(model: HunyuanImage3, images: list[ModelImage],
                      generator: torch.Generator | None) -> list[EncodedImage]:
    """A request's own references, their VAE noise drawn from `generator` in image order."""
    return [_encode(model, img, generator) for img in images]


def encode_sequence_images(model: HunyuanImage3, history: list[ModelImage], images: list[ModelImage],
                           generator: torch.Generator, cache: EncodingCache) -> list[EncodedImage]:
    """Every image of a turn's sequence in its order: the earlier turns' (`history`, from the cache or
    content-seeded), then this turn's own references (`images`, from `generator`, recorded in the
    cache). See the module docstring."""
    own, drawn = [], [f"seed {generator.initial_seed()}"]
    for img in images:
        drawn.append(img.digest)       # the k-th draw of the stream depends on the images drawn before it
        enc = _encode(model, img, generator, "drawn " + hashlib.sha256(" ".join(drawn).encode()).hexdigest()[:32])
        cache.record(img.digest, enc)
        own.append(enc)
    past = []
    for img in history:
        enc = cache.get(img.digest)
        if enc is None:
            gen = torch.Generator(model.device).manual_seed(int(img.digest[:15], 16))
            enc = _encode(model, img, gen, "content " + img.digest)
            cache.record(img.digest, enc)
        past.append(enc)
    return past + own


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
