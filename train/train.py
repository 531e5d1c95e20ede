"""Train the embedded default model and write it as an official-layout checkpoint folder.

    python -m train.train --out DIR [--device cuda] [--minutes N] [--resume] ...

Two phases, run through the engine's own modules (engine.model.HunyuanImage3 and its parts):

1. VAE (`vae.*`): reconstruction (L1 + image-gradient L1), a small KL, and a latent alignment: 12 of
   the 16 latent channels follow the colours of the token's four quadrants, the other 4 stay free
   (`vae_losses` says why). Then the latent scaling factor (1 / std of the posterior means) goes into
   config.json's `vae.scaling_factor`, as the released model's 0.5627 does.
2. Transformer, image heads, ViT and aligner (the VAE frozen), on both objectives at once:
   - next-token loss on the CoT (`<think>` / `<recaption>` texts, their tags) and the ratio token;
   - flow-matching loss on the image tokens (rectified flow, x_t = (1-s) x0 + s e, target
     v = e - x0, t = 1000 s; tokens covering shapes weigh up to 1 + `--fg-weight`; half the samples
     at the exact shift-3 inference schedule points with r = the next schedule point, half
     continuous), Distil inputs `<guidance>` / `<timestep_r>`;
   - TI2I: 1-3 reference images as the official joint sections (VAE posterior sample through
     `patch_embed` at t=0 + ViT / aligner features), in the same sequence.
   Every training sequence is `engine.runtime.sequence.image_phase_sequence`, the exact sequence inference
   builds (the text part is causal, so its logits are the AR phase's); text positions are
   `text_phase_sequence`'s. Samples of a batch share their number of reference images.

Time budgets (`--vae-minutes`, `--tf-minutes`) drive the learning-rate schedules, so the run adapts
to the machine; `--minutes` bounds one call. State is the checkpoint folder itself (DIR/model, the
official layout, loadable by engine.model.loader.load) plus DIR/train_state.json: `--resume` reloads both
(Adam moments restart with a short warm-up), so what a call hands back is ~24 MB. Losses go to
stdout and DIR/log.jsonl (with the data-loader wait and the experts' usage entropy).

A probe (`--probe`, every `--probe-every` minutes and at the end of a call) draws held-out scenes from
their true CoT through this forward and logs the fraction the detector reads exactly.

On the device machine, `train/gpu_call.sh MINUTES [options]` is one call: it continues runs/run when
it was carried there, trains one data-parallel replica per GPU (train/replicas.py; torchrun) and packs
the run folder into $OUT. The shipped assets/model came from (2026-11-29; VAE 2.5 min, transformer
schedule 18 min on one H200, then stretched to 43 min and continued on two):

    bash train/gpu_call.sh 8.45 --tf-minutes 20    # 1 H200: VAE, then a crash in the probe (fixed): restarted from the VAE
    bash train/gpu_call.sh 9.25 --tf-minutes 18 --save-every 3                    # 1 H200: transformer 0 -> 507 s
    bash train/gpu_call.sh 9.6 --tf-minutes 18 --save-every 3 --probe-every 3     # 1 H200: 507 -> 1043 s
    bash train/gpu_call.sh 9.3 --tf-minutes 43 --save-every 3 --probe-every 3     # 2 H200: 1043 -> 1558 s
    bash train/gpu_call.sh 9.3 --tf-minutes 43 --save-every 3 --probe-every 3     # 2 H200: 1558 -> 2080 s
    bash train/gpu_call.sh 9.0 --tf-minutes 43 --save-every 3 --probe-every 3     # 2 H200: 2080 -> 2580 s (done)

Its state is in train/embedded_run (train_state.json, log.jsonl); to continue it, put it back together
(`mkdir -p runs/run && cp -r assets/model runs/run/ && cp train/embedded_run/* runs/run/`) and call
again with a larger `--tf-minutes` (the LR schedule then restarts part-way up its cosine). Resuming
reloads the checkpoint's bf16 weights as the fp32 masters and restarts Adam, so every call begins with
a short warm-up.

Evaluate with `python -m train.evaluate --model runs/run/model`. A toy check on CPU (a minute):

    python -m train.train --out /tmp/toy --batch-scale 0.03 --workers 0 --max-vae-steps 3 --max-tf-steps 3
    torchrun --standalone --nproc-per-node 2 -m train.train --out /tmp/toy2 --batch-scale 0.03 --workers 0 \
        --max-vae-steps 3 --max-tf-steps 3          # the same on two data-parallel replicas (gloo)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer as HFTokenizer
from torch.utils.data import DataLoader, Dataset

from engine.model.attention import AttnBatch, KVCache, attention_mask
from engine.checkpoint.config import ModelConfig
from engine.runtime.denoise import flow_sigmas
from engine.runtime.images import to_pil
from engine.model.layers import rope_angles
from engine.model.hunyuan import HunyuanImage3
from engine.model.weights import vit_head_shapes
from engine.parallel.layout import PhaseView
from engine.checkpoint import names
from engine.checkpoint.names import DOWN_PROJ, GATE_AND_UP_PROJ
from engine.runtime.sequence import CondImageLayout, image_phase_sequence, text_phase_sequence, user_turn
from engine.checkpoint.tokenizer import Tokenizer
from engine.model.vit import vit_preprocess

from .config import SCHEDULE_STEPS, model_config, write_folder
from .dataset import BUCKETS, FORMATS, make_sample, system_text
from .replicas import Replicas
from .tokenizer import build_tokenizer, padded_vocab

VIEW = PhaseView()
STEPS, SHIFT, GUIDANCE = SCHEDULE_STEPS, 3.0, 2.5   # the inference schedule the model is trained for
GROUP_WEIGHTS = {0: 0.45, 1: 0.33, 2: 0.13, 3: 0.09}
BATCH = {0: 128, 1: 64, 2: 40, 3: 32}       # sequences per batch by reference count (~45k tokens each)
VAE_BATCH = 64


# ----------------------------------------------------------------------------------------- data
def _uint8(img: Image.Image) -> torch.Tensor:
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3).permute(2, 0, 1)


class TrainSequence:
    """One sample as the trainer consumes it: ids, 2D positions, attention blocks, text targets,
    the generated image's span and the reference images' spans and inputs."""

    def __init__(self, tok: Tokenizer, cfg: ModelConfig, sample, ref_images=None):
        factor = cfg.vae_downsample_factor[0]
        refs = [sc.render() for sc in sample.refs] if ref_images is None else ref_images
        self.vit = [vit_preprocess(img, cfg.vit_processor) for img in refs]
        layouts = []
        for sc, v in zip(sample.refs, self.vit):
            b = sc.bucket
            layouts.append(CondImageLayout((b.height // factor, b.width // factor), b.index, v.spatial_shapes,
                                           v.pixel_values.shape[0]))
        system = system_text(sample.system)
        b = sample.bucket
        turn = user_turn(tok, system, sample.prompt, layouts, (), cfg.cond_token_attn_type)
        seq = image_phase_sequence(turn, sample.cot_text(), b.height // factor, b.width // factor, b.index, True)
        prefix = text_phase_sequence(turn, "auto", cfg.image_base_size)
        span = seq.gen_image
        # the AR prompt ends with the bot prefix (<think> / <recaption>) or with <img_size> (no CoT)
        first = len(prefix) + 1 if sample.bot_task != "image" else span.meta_start - 1
        self.ids, self.pos, self.blocks = seq.ids, seq.pos, seq.blocks
        self.targets = list(range(first, span.meta_start))          # predicted from position - 1
        self.span = span
        self.cond = seq.cond_images
        self.ref_images = [_uint8(im) for im in refs]
        self.target_image = None


def collate(seqs: list[TrainSequence], pad_id: int) -> dict:
    B, T = len(seqs), max(len(s.ids) for s in seqs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    pos = torch.arange(T).view(1, T, 1).repeat(B, 1, 2)
    blocks = torch.full((B, T), -1, dtype=torch.long)
    tgt_in, tgt_ids = [], []
    gen: dict[tuple[int, int], dict] = {}
    ref: dict[tuple[int, int], dict] = {}
    vit_pv, vit_mask, vit_shapes, vit_idx = [], [], [], []
    for b, s in enumerate(seqs):
        n = len(s.ids)
        ids[b, :n] = torch.tensor(s.ids)
        pos[b, :n] = torch.tensor(s.pos)
        blocks[b, :n] = torch.tensor(s.blocks)
        tgt_in += [b * T + p - 1 for p in s.targets]
        tgt_ids += [s.ids[p] for p in s.targets]
        sp = s.span
        g = gen.setdefault((sp.h, sp.w), {"tok": [], "meta": [], "img": []})
        g["tok"].append(b * T + torch.arange(sp.start, sp.stop))
        g["meta"].append(b * T + sp.meta_start)
        g["img"].append(s.target_image)
        for c, im, v in zip(s.cond, s.ref_images, s.vit):
            hw = (im.shape[1] // 16, im.shape[2] // 16)
            r = ref.setdefault(hw, {"tok": [], "ts": [], "img": []})
            r["tok"].append(b * T + torch.arange(c.vae.start, c.vae.stop))
            r["ts"].append(b * T + c.timestep)
            r["img"].append(im)
            vit_pv.append(v.pixel_values)
            vit_mask.append(v.pixel_attention_mask)
            vit_shapes.append(v.spatial_shapes)
            vit_idx.append(b * T + torch.arange(c.vit.start, c.vit.stop))
    out = {"ids": ids, "pos": pos, "blocks": blocks, "tgt_in": torch.tensor(tgt_in), "tgt_ids": torch.tensor(tgt_ids),
           "gen": {k: {"tok": torch.stack(v["tok"]), "meta": torch.tensor(v["meta"]), "img": torch.stack(v["img"])}
                   for k, v in gen.items()},
           "ref": {k: {"tok": torch.stack(v["tok"]), "ts": torch.tensor(v["ts"]), "img": torch.stack(v["img"])}
                   for k, v in ref.items()}}
    if vit_pv:
        out["vit"] = {"pv": torch.stack(vit_pv), "mask": torch.stack(vit_mask), "shapes": vit_shapes,
                      "idx": torch.stack(vit_idx)}
    return out


class SeqBatches(Dataset):
    """Batch `step` of the transformer phase: a reference-count group, then that group's samples."""

    def __init__(self, tok_path: str, cfg: dict, seed: int, scale: float, split: str = "train",
                 rank: int = 0, world: int = 1):
        self.tok_path, self.cfg_dict, self.seed, self.scale, self.split = tok_path, cfg, seed, scale, split
        self.rank, self.world = rank, world
        self._tok = self._cfg = None

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, step: int) -> dict:
        if self._tok is None:
            self._cfg = ModelConfig.from_dict(self.cfg_dict)
            self._tok = Tokenizer(self.tok_path, self._cfg.image_base_size, len(BUCKETS))
        rng = random.Random(f"{self.seed}:batch:{step}")
        group = rng.choices(list(GROUP_WEIGHTS), list(GROUP_WEIGHTS.values()))[0]
        fmt = rng.choice(list(FORMATS))          # one target shape per batch: one pass of each image head
        n = max(1, round(BATCH[group] * self.scale))
        seqs = []
        for j in range(n):
            # group and fmt are the batch index's on every replica; the samples are the replica's own
            key = ((self.seed << 40) + step * 256 + j) * self.world + self.rank
            s = make_sample(key, self.split, group=group, fmt=fmt)
            ts = TrainSequence(self._tok, self._cfg, s)
            ts.target_image = _uint8(s.target.render())
            seqs.append(ts)
        return collate(seqs, self._tok.special.pad)


class VaeBatches(Dataset):
    """Batch `step` of the VAE phase: rendered scenes (targets and references) of one format."""

    def __init__(self, seed: int, batch: int, rank: int = 0, world: int = 1):
        self.seed, self.batch, self.rank, self.world = seed, batch, rank, world

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, step: int) -> torch.Tensor:
        rng = random.Random(f"{self.seed}:vae:{step}")
        fmt = rng.choice(list(FORMATS))
        imgs = []
        j = 0
        while len(imgs) < self.batch:
            s = make_sample(((self.seed << 40) + step * 256 + j) * self.world + self.rank, "train")
            j += 1
            for sc in (s.target, *s.refs):
                if len(imgs) < self.batch:
                    imgs.append(_uint8(replace(sc, fmt=fmt).render()))
        return torch.stack(imgs)


def _worker_init(_):
    torch.set_num_threads(1)


def loader(ds: Dataset, start: int, workers: int, pin: bool) -> DataLoader:
    kw = dict(num_workers=workers, pin_memory=pin, worker_init_fn=_worker_init)
    if workers:
        kw |= dict(prefetch_factor=4, persistent_workers=False)
    return DataLoader(ds, batch_size=None, sampler=range(start, len(ds)), **kw)


# ----------------------------------------------------------------------------------------- model
def init_weights(model: HunyuanImage3, seed: int) -> None:
    """The backbone parameters are created empty: GPT-style init (residual outputs scaled by depth);
    the image heads keep PyTorch's defaults except the velocity head's last conv (zero: v = 0 at start)."""
    g = torch.Generator().manual_seed(seed)
    tr, cfg = model.transformer, model.cfg
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.num_layers)

    def normal_(p: torch.Tensor, s: float) -> None:
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * s)

    normal_(tr.wte, std)
    normal_(tr.lm_head, std)
    for layer in tr.layers:
        normal_(layer.self_attn.qkv, std)
        normal_(layer.self_attn.o_proj, out_std)
        m = layer.mlp
        normal_(m.gate, std)
        normal_(m.w1, std)
        normal_(m.w2, out_std)
        if m.shared_w1 is not None:
            normal_(m.shared_w1, std)
            normal_(m.shared_w2, out_std)
    with torch.no_grad():
        last = model.final_layer.model[1][2]
        last.weight.zero_()
        last.bias.zero_()
        # start the VAE posterior narrow (logvar ~ -6) so the decoder learns to use the latent before
        # the sampling noise could teach it to ignore it (posterior collapse)
        z = int(cfg.vae["latent_channels"])
        model.vae.encoder.conv_out.bias[z:].fill_(-6.0)
        gn_bypass_init(model.vae.decoder)


def gn_bypass_init(decoder, c: float = 4.0) -> None:
    """The decoder's output is conv_out(silu(GroupNorm32(h))) with no skip: at our width (64 channels,
    2 per group) the norm removes each image's per-group mean and scale, i.e. the absolute colours.
    Start it as a near-identity instead: the last ResNet block adds +c / -c to the two channels of each
    group (so the group's std is ~c whatever the image) and the norm's affine maps them back
    (weight c, bias -offset); a channel the network keeps constant then serves as the reference that
    restores the mean. Measured: without this the VAE learns background colours but not shape colours."""
    block = decoder.up[-1].block[-1]
    C = block.conv2.out_channels
    groups = decoder.norm_out.num_groups
    per = C // groups
    offs = torch.tensor([c if (i % per) < per / 2 else -c for i in range(C)], device=block.conv2.bias.device)
    with torch.no_grad():
        block.conv2.bias.add_(offs)
        decoder.norm_out.weight.fill_(c)
        decoder.norm_out.bias.copy_(-offs)


def export_tensors(model: HunyuanImage3) -> dict[str, torch.Tensor]:
    """Resident parameters -> official checkpoint names and shapes (the inverse of
    engine.model.load_weights for the one-shard, one-micro layout the trainer uses)."""
    cfg, tr = model.cfg, model.transformer
    assert model.layout.logical_size == 1
    w = names.weight
    out = {names.WTE: tr.wte, names.LN_F: tr.ln_f.weight, w(names.LM_HEAD): tr.lm_head[0]}
    for i, layer in enumerate(tr.layers):
        n, att, m = names.layer(i), layer.self_attn, layer.mlp
        out |= {n.input_layernorm: layer.input_layernorm.weight,
                n.post_attention_layernorm: layer.post_attention_layernorm.weight,
                w(n.qkv_proj): att.qkv[0], w(n.o_proj): att.o_proj,
                n.query_layernorm: att.q_norm.weight, n.key_layernorm: att.k_norm.weight, n.router: m.gate}
        if m.shared_w1 is not None:
            out |= {w(n.shared(GATE_AND_UP_PROJ)): m.shared_w1[0], w(n.shared(DOWN_PROJ)): m.shared_w2}
        for e in range(cfg.num_experts[i]):
            out |= {w(n.expert(e, GATE_AND_UP_PROJ)): m.w1[0, e], w(n.expert(e, DOWN_PROJ)): m.w2[e]}
    for prefix, mod in model.replicated_modules().items():
        out |= {f"{prefix}.{k}": v for k, v in mod.state_dict().items()}
    # the unused SigLIP2 pooling head the official checkpoint carries (skipped at load): zeros
    out |= {n: torch.zeros(s) for n, s in vit_head_shapes(cfg).items()}
    return {k: v.detach() for k, v in out.items()}


class RouterAux:
    """Switch-style load-balancing loss of every MoE layer, from forward hooks (the engine's MoE is
    used as it is; the router logits are recomputed from the layer input, a [N, H] x [H, E] matmul)."""

    def __init__(self, model: HunyuanImage3):
        self.terms: list[torch.Tensor] = []
        self.usage: list[torch.Tensor] = []
        self.active = True
        self.handles = [layer.mlp.register_forward_hook(self._hook) for layer in model.transformer.layers]

    def _hook(self, mod, inputs, output):
        if not self.active:                  # off during probes: their forwards are no training step
            return
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        probs = F.linear(x.float(), mod.gate).softmax(-1)
        idx = probs.topk(mod.topk, dim=-1).indices
        frac = torch.zeros(mod.experts, device=x.device).scatter_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), device=x.device)) / idx.numel()
        self.terms.append(mod.experts * (frac * probs.mean(0)).sum())
        self.usage.append(frac.detach())

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        loss = torch.stack(self.terms).mean()
        usage = torch.stack(self.usage)
        self.terms, self.usage = [], []
        return loss, usage


def sample_times(n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sigma, r (the sigma of the next step) and the Distil guidance (bf16(1000 g)) for n images."""
    sig = flow_sigmas(STEPS, SHIFT).to(dev)
    i = torch.randint(0, STEPS, (n,), device=dev)
    u = torch.rand(n, device=dev)
    shift = lambda s: SHIFT * s / (1 + (SHIFT - 1) * s)
    disc = torch.rand(n, device=dev) < 0.5
    sigma = torch.where(disc, sig[i], shift(u))
    r = torch.where(disc, sig[i + 1], shift((u - 1.0 / STEPS).clamp_min(0)))
    g = torch.where(torch.rand(n, device=dev) < 0.8, torch.full((n,), GUIDANCE, device=dev),
                    1.0 + 5.0 * torch.rand(n, device=dev))
    return sigma, r, (1000.0 * g).to(torch.bfloat16).float()


def _pixels(img_u8: torch.Tensor, dev: torch.device) -> torch.Tensor:
    return img_u8.to(dev, non_blocking=True).float() / 127.5 - 1.0


def sequence_hidden(model: HunyuanImage3, batch: dict, dev: torch.device,
                    gen_inputs: dict[tuple[int, int], tuple]) -> torch.Tensor:
    """Last-layer hidden states [B*T, H] of a collated batch, the generated images' tokens fed as
    gen_inputs[(h, w)] = (x_t [n, C, h, w], t [n] (sigma * 1000), r [n] (sigma units), guidance [n])."""
    cfg = model.cfg
    H, D = cfg.hidden_size, cfg.head_dim
    ids = batch["ids"].to(dev, non_blocking=True)
    B, T = ids.shape
    x = model.transformer.embed(ids).reshape(B * T, H)
    idx, vals = [], []
    zero = torch.zeros(1, device=dev)
    if batch["ref"]:
        temb0 = model.time_embed(zero)
        for (h, w), r in batch["ref"].items():
            with torch.no_grad():
                lat = model.vae.encode_latent(_pixels(r["img"], dev), None)
            tokens = model.patch_embed(lat, temb0.expand(lat.shape[0], -1))
            idx.append(r["tok"].to(dev, non_blocking=True).reshape(-1))
            vals.append(tokens.reshape(-1, H))
            idx.append(r["ts"].to(dev, non_blocking=True))
            vals.append(model.timestep_emb(zero).expand(lat.shape[0], -1))
        v = batch["vit"]
        feats = model.vision_model(v["pv"].to(dev, non_blocking=True), v["mask"].to(dev, non_blocking=True),
                                   v["shapes"])
        idx.append(v["idx"].to(dev, non_blocking=True).reshape(-1))
        vals.append(model.vision_aligner(feats).reshape(-1, H))
    for hw, g in batch["gen"].items():
        xt, t, r, guid = gen_inputs[hw]
        idx.append(g["tok"].to(dev, non_blocking=True).reshape(-1))
        vals.append(model.patch_embed(xt, model.time_embed(t)).reshape(-1, H))
        meta = g["meta"].to(dev, non_blocking=True)
        idx += [meta, meta + 1, meta + 2]
        vals += [model.timestep_emb(t), model.guidance_emb(guid), model.timestep_r_emb(r * 1000.0)]
    x = x.index_put((torch.cat(idx),), torch.cat([v.to(x.dtype) for v in vals]))
    pos = batch["pos"].to(dev, non_blocking=True)
    cos, sin = rope_angles(pos.reshape(-1, 2), D, cfg.rope_theta)
    blocks = batch["blocks"].to(dev, non_blocking=True)
    index = torch.arange(T, device=dev)
    mask = attention_mask(index, blocks, T)[:, None]            # [B, 1, T, T]
    attn = AttnBatch(index, cos.view(B, 1, T, D), sin.view(B, 1, T, D), T, mask)
    lay0 = model.transformer.layers[0].self_attn
    cache = KVCache.allocate(cfg.num_layers, B, lay0.kv_per_micro, T, D, x.dtype, dev)
    return model.transformer(x.view(B, T, H), attn, cache, VIEW).reshape(B * T, H)


def gen_velocity(model: HunyuanImage3, hid: torch.Tensor, g: dict, h: int, w: int, t: torch.Tensor,
                 dev: torch.device) -> torch.Tensor:
    """The velocity head on one image shape's tokens -> [n, C, h, w] fp32."""
    n = g["tok"].shape[0]
    hs = hid[g["tok"].to(dev, non_blocking=True).reshape(-1)].view(n, h * w, -1)
    return model.final_layer(hs, model.time_embed_2(t), h, w).float()


def foreground_mask(x: torch.Tensor) -> torch.Tensor:
    """[B, 1, H, W] 1 where a pixel is not the background (read at the corner pixel, always background)."""
    return ((x - x[:, :, :1, :1]).abs().sum(1, keepdim=True) > 0.1).float()


def foreground_weights(img_u8: torch.Tensor, dev: torch.device, factor: int, fg_weight: float) -> torch.Tensor:
    """[n, 1, h, w] per-token loss weights: 1 + fg_weight x the token's fraction of shape pixels
    (anything not the background, read at the corner pixel), normalised to mean 1 per image."""
    w = 1.0 + fg_weight * F.avg_pool2d(foreground_mask(_pixels(img_u8, dev)), factor)
    return w / w.mean(dim=(1, 2, 3), keepdim=True)


def transformer_losses(model: HunyuanImage3, batch: dict, dev: torch.device, aux: RouterAux | None = None,
                       fg_weight: float = 0.0) -> dict:
    """The joint loss of one batch: CE on CoT + ratio tokens, flow matching on the image tokens
    (each token's squared error weighted by `foreground_weights`)."""
    gen_inputs, targets = {}, {}
    for hw, g in batch["gen"].items():
        with torch.no_grad():
            mean, _ = model.vae.encode_moments(_pixels(g["img"], dev))
            x0 = mean.squeeze(2) * model.vae.scaling_factor
        n = x0.shape[0]
        sigma, r, guid = sample_times(n, dev)
        noise = torch.randn_like(x0)
        s4 = sigma.view(n, 1, 1, 1)
        gen_inputs[hw] = ((1 - s4) * x0 + s4 * noise, sigma * 1000.0, r, guid)
        targets[hw] = noise - x0
    hid = sequence_hidden(model, batch, dev, gen_inputs)
    logits = model.transformer.logits(hid[batch["tgt_in"].to(dev, non_blocking=True)], VIEW)
    ce = F.cross_entropy(logits, batch["tgt_ids"].to(dev, non_blocking=True))
    se, count = 0.0, 0
    factor = model.vae.ffactor_spatial
    for (h, w), g in batch["gen"].items():
        v = gen_velocity(model, hid, g, h, w, gen_inputs[(h, w)][1], dev)
        wt = foreground_weights(g["img"], dev, factor, fg_weight)
        se = se + (((v - targets[(h, w)]) ** 2).mean(dim=1, keepdim=True) * wt).mean(dim=(1, 2, 3)).sum()
        count += v.shape[0]
    out = {"ce": ce, "fm": se / count}
    if aux is not None:
        out["aux"], out["usage"] = aux.pop()
    return out


ALIGNED = 12     # latent channels held to the token's 2 x 2 quadrant colours (3 x 4); the rest are free


def latent_targets(x: torch.Tensor, factor: int) -> torch.Tensor:
    """[B, 12, h, w]: the RGB means of each token's four quadrants (pixels in [-1, 1])."""
    return F.pixel_unshuffle(F.avg_pool2d(x, factor // 2), 2)


def vae_losses(vae, img_u8: torch.Tensor, dev: torch.device, kl_weight: float, align_weight: float) -> dict:
    """Reconstruction (foreground-weighted L1 + image-gradient L1), a small KL, and the latent
    alignment: the first ALIGNED channels of the posterior mean follow `latent_targets` and the free
    channels keep a mean square <= 1. Why: left alone, the encoder's GroupNorms (statistics over the
    whole image) made every token's latent depend on every object, and a colour change moved the latent
    by less than 1/10 of the noise's scale, so the flow model could not see colours (it drew grey
    blobs). Held to local colours, a token's latent is about its own patch and colours are far apart."""
    x = _pixels(img_u8, dev)
    mean, logvar = vae.encode_moments(x)
    z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
    rec = vae.decoder(z)[:, :, -1].float()
    wfg = 1.0 + 9.0 * foreground_mask(x)       # shapes cover a few % of the pixels: weight them 10x
    l1 = ((rec - x).abs() * wfg).mean() / wfg.mean()
    grad = ((rec[..., 1:, :] - rec[..., :-1, :]) - (x[..., 1:, :] - x[..., :-1, :])).abs().mean() + \
           ((rec[..., 1:] - rec[..., :-1]) - (x[..., 1:] - x[..., :-1])).abs().mean()
    kl = 0.5 * (mean.float() ** 2 + logvar.float().exp() - 1 - logvar.float()).mean()
    m = mean.squeeze(2).float()
    align = (m[:, :ALIGNED] - latent_targets(x, vae.ffactor_spatial)).pow(2).mean()
    free = F.relu(m[:, ALIGNED:].pow(2).mean() - 1.0)
    loss = l1 + grad + kl_weight * kl + align_weight * (align + free)
    return {"l1": l1, "grad": grad, "kl": kl, "align": align, "loss": loss}


@torch.no_grad()
def latent_report(vae, dev: torch.device) -> str:
    """How far the latent (scaled) moves when one object changes colour or shape, inside the object's
    tokens vs outside: a usable latent moves a lot inside (noise is ~1 per channel) and little outside."""
    from .dataset import Obj, Scene
    def lat(obj):
        img = _uint8(Scene("square", "white", (obj,)).render())[None]
        with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
            m, _ = vae.encode_moments(_pixels(img, dev))
        return m.squeeze(2)[0].float() * vae.scaling_factor
    base = lat(Obj("circle", "red", "large", (1, 1)))
    inside = torch.zeros(base.shape[1:], dtype=torch.bool, device=base.device)
    h, w = base.shape[1:]
    inside[h // 3:2 * h // 3 + 1, w // 3:2 * w // 3 + 1] = True
    out = []
    for name, obj in (("red->blue", Obj("circle", "blue", "large", (1, 1))),
                      ("red->yellow", Obj("circle", "yellow", "large", (1, 1))),
                      ("circle->star", Obj("star", "red", "large", (1, 1))),
                      ("circle->square", Obj("square", "red", "large", (1, 1)))):
        d = (lat(obj) - base).pow(2).mean(0)
        inside_rms, outside_rms = float(d[inside].max().sqrt()), float(d[~inside].max().sqrt())
        out.append(f"{name} rms inside {inside_rms:.2f} outside {outside_rms:.3f}")
    return "; ".join(out)


def scene_key(det) -> tuple[str, list[tuple]]:
    """What must match for a scene to count as drawn right: background, every object's colour, shape, cell."""
    return det.background, sorted((o.color, o.shape, o.cell) for o in det.objects)


@torch.no_grad()
def vae_check(vae, dev: torch.device, n: int = 24) -> float:
    """Fraction of held-out renders whose reconstruction (posterior mean) the detector reads exactly
    as the render (every object's colour, shape and cell, and the background)."""
    from .detect import detect
    ok = 0
    for i in range(n):
        s = make_sample(i, "test", group=i % 4)
        img = _uint8(s.target.render())[None]
        mean, _ = vae.encode_moments(_pixels(img, dev))
        rec = vae.decoder(mean)[:, :, -1].float()[0]
        pil = to_pil(rec)
        ok += scene_key(detect(pil)) == scene_key(detect(s.target.render()))
    return ok / n


@torch.no_grad()
def probe(model: HunyuanImage3, tok: Tokenizer, dev: torch.device, n: int = 32, seed: int = 0) -> dict:
    """Images drawn from the ground-truth CoT through the training forward (the Euler schedule of
    inference), read by the detector: the fraction of held-out scenes drawn exactly (every object's
    colour, shape and cell, and the background) and of objects drawn right, for T2I and for edits.
    It separates the image side's progress from the reasoning's during a run."""
    from .detect import detect
    model.eval()
    out = {}
    sig = flow_sigmas(STEPS, SHIFT).to(dev)
    guid = torch.tensor([1000.0 * GUIDANCE], device=dev).to(torch.bfloat16).float()
    C = int(model.cfg.vae["latent_channels"])
    for name, group in (("t2i", 0), ("edit", 1)):
        samples = [make_sample(i, "test", group=group) for i in range(n)]
        seqs = []
        for s in samples:
            ts = TrainSequence(tok, model.cfg, s)
            ts.target_image = _uint8(s.target.render())
            seqs.append(ts)
        batch = collate(seqs, tok.special.pad)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        xs = {hw: torch.randn(g["tok"].shape[0], C, *hw, generator=gen).to(dev) for hw, g in batch["gen"].items()}
        for k in range(STEPS):
            inputs = {hw: (x, sig[k].expand(len(x)) * 1000.0, sig[k + 1].expand(len(x)), guid.expand(len(x)))
                      for hw, x in xs.items()}
            with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
                hid = sequence_hidden(model, batch, dev, inputs)
                for (h, w), g in batch["gen"].items():
                    v = gen_velocity(model, hid, g, h, w, inputs[(h, w)][1], dev)
                    xs[(h, w)] = xs[(h, w)] + (sig[k + 1] - sig[k]) * v
        # back to sample order: collate groups the batch's rows by image shape, in order of appearance
        order = {}
        for b, ts in enumerate(seqs):
            order.setdefault((ts.span.h, ts.span.w), []).append(b)
        exact, objs, total = 0, 0, 0
        for hw, rows in order.items():
            with torch.autocast("cuda", torch.bfloat16, enabled=dev.type == "cuda"):
                imgs = model.vae.decode_latent(xs[hw]).float()
            for img, b in zip(imgs, rows):
                pil = to_pil(img)
                got, want = scene_key(detect(pil)), scene_key(detect(samples[b].target.render()))
                exact += got == want
                objs += sum(1 for o in want[1] if o in got[1])
                total += len(want[1])
        out[f"{name}_exact"] = exact / n
        out[f"{name}_objects"] = objs / max(1, total)
    model.train()
    return out


# ----------------------------------------------------------------------------------------- run
class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.folder = self.out / "model"
        self.rep = Replicas(args.device)
        self.dev = self.rep.device
        self.amp = self.dev.type == "cuda"
        self.t_call = time.perf_counter()
        self.state_path = self.out / "train_state.json"
        self.log_path = self.out / "log.jsonl"
        if self.amp:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(args.seed)
        if args.resume and self.state_path.exists():
            from engine.model.loader import load
            self.state = json.loads(self.state_path.read_text())
            self.tok = HFTokenizer.from_file(str(self.folder / "tokenizer.json"))
            self.cfg = json.loads((self.folder / "config.json").read_text())
            self.model = load(self.folder, self.dev, torch.float32).model
            self.log(f"resumed from {self.folder}: {self.state}")
        else:
            self.state = {"phase": "vae", "vae_s": 0.0, "tf_s": 0.0, "vae_step": 0, "tf_step": 0, "seed": args.seed,
                          "scaling_factor": 1.0}
            self.tok = build_tokenizer()
            self.cfg = model_config(padded_vocab(self.tok))
            if self.rep.main:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.tok.save(str(self.folder / "tokenizer.json"))
            self.model = HunyuanImage3(ModelConfig.from_dict(self.cfg), dtype=torch.float32, device=self.dev)
            init_weights(self.model, args.seed)
        self.rep.same_weights(self.model)
        self.rep.barrier()           # replica 0 has written tokenizer.json, which every replica's loader reads
        self.last_save = time.perf_counter()

    # -- bookkeeping
    def log(self, msg: str, **metrics) -> None:
        if not self.rep.main:
            return
        line = f"[{time.perf_counter() - self.t_call:7.1f}s] {msg}"
        print(line, flush=True)
        if metrics:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def call_left(self) -> float:
        return self.args.minutes * 60 - (time.perf_counter() - self.t_call)

    def save(self) -> None:
        """Replica 0 writes the checkpoint; every replica calls it at the same step."""
        if not self.rep.main:
            self.rep.barrier()
            return
        t0 = time.perf_counter()
        cfg = dict(self.cfg)
        cfg["vae"] = dict(cfg["vae"], scaling_factor=float(self.state["scaling_factor"]))
        self.model.vae.scaling_factor = float(self.state["scaling_factor"])
        write_folder(self.folder, self.tok, cfg, export_tensors(self.model))
        self.state_path.write_text(json.dumps(self.state, indent=1))
        self.last_save = time.perf_counter()
        size = sum(p.stat().st_size for p in self.folder.iterdir())
        self.log(f"saved {self.folder} ({size / 2 ** 20:.2f} MiB) in {time.perf_counter() - t0:.1f}s")
        self.rep.barrier()

    def save_due(self) -> bool:
        return time.perf_counter() - self.last_save > self.args.save_every * 60

    def run_probe(self) -> None:
        if self.args.probe <= 0:
            return
        if not self.rep.main:
            self.rep.barrier()
            return
        t0 = time.perf_counter()
        tok = Tokenizer(str(self.folder / "tokenizer.json"), self.model.cfg.image_base_size, len(BUCKETS))
        r = probe(self.model, tok, self.dev, self.args.probe)
        st = self.state
        self.log(f"probe at tf step {st['tf_step']}: images from the true CoT, held-out scenes exact "
                 f"T2I {r['t2i_exact']:.0%} (objects {r['t2i_objects']:.0%}), edits {r['edit_exact']:.0%} "
                 f"(objects {r['edit_objects']:.0%}) [{time.perf_counter() - t0:.1f}s]",
                 phase="probe", step=st["tf_step"], t=st["tf_s"], **r)
        self.rep.barrier()

    @staticmethod
    def lr_at(peak: float, frac: float, warm: float) -> float:
        return peak * min(1.0, warm) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    # -- phase 1
    def train_vae(self) -> bool:
        a, st, vae = self.args, self.state, self.model.vae
        budget = a.vae_minutes * 60
        vae.train().requires_grad_(True)
        opt = torch.optim.AdamW(vae.parameters(), lr=a.vae_lr, betas=(0.9, 0.99), weight_decay=0.0)
        data = loader(VaeBatches(st["seed"], max(1, round(VAE_BATCH * a.batch_scale)), self.rep.rank, self.rep.world),
                      st["vae_step"], a.workers, self.amp)
        t_last, steps_here, acc, n_acc = time.perf_counter(), 0, None, 0
        self.log(f"VAE phase: budget {budget:.0f}s, done {st['vae_s']:.0f}s / step {st['vae_step']}")
        for k, img in enumerate(data):
            if k == 0:
                t_last = time.perf_counter()       # worker start-up is not training time
            # replica 0's clock decides (and drives the LR), so every replica takes the same steps
            stop, save, st["vae_s"] = self.rep.agree(
                st["vae_s"] >= budget or st["vae_step"] >= a.max_vae_steps or self.call_left() < a.reserve,
                self.save_due(), st["vae_s"])
            if stop:
                break
            if save:
                self.save()
                t_last = time.perf_counter()
            lr = self.lr_at(a.vae_lr, st["vae_s"] / budget, (steps_here + 1) / 50)
            for gr in opt.param_groups:
                gr["lr"] = lr
            with torch.autocast("cuda", torch.bfloat16, enabled=self.amp):
                L = vae_losses(vae, img, self.dev, a.kl_weight, a.align_weight)
            opt.zero_grad(set_to_none=True)
            L["loss"].backward()
            self.rep.average_grads(list(vae.parameters()))
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            d = torch.stack([L["l1"], L["grad"], L["kl"], L["align"]]).detach()
            acc, n_acc = (d if acc is None else acc + d), n_acc + 1
            steps_here += 1
            st["vae_step"] += 1
            now = time.perf_counter()
            st["vae_s"] += now - t_last
            t_last = now
            if st["vae_step"] % a.log_every == 0:
                m = (acc / n_acc).tolist()          # after a resume the first window is shorter
                acc, n_acc = None, 0
                self.log(f"vae step {st['vae_step']} t={st['vae_s']:.0f}s lr={lr:.2e} l1={m[0]:.4f} "
                         f"grad={m[1]:.4f} kl={m[2]:.3f} align={m[3]:.4f}", phase="vae", step=st["vae_step"],
                         t=st["vae_s"], l1=m[0], grad=m[1], kl=m[2], align=m[3])
        vae.eval().requires_grad_(False)
        done = st["vae_s"] >= budget or st["vae_step"] >= a.max_vae_steps
        if done:
            st["scaling_factor"] = self.rep.agree(self.latent_scale())[0]
            st["phase"] = "tf"
            vae.scaling_factor = float(st["scaling_factor"])
            # the VAE's held-out checks are its probe (--probe 0: none; they take ~25 s on a CPU)
            checks = "" if not a.probe else (
                f"; reconstructions whose detected objects (colour, shape, cell) match the input: "
                f"{vae_check(vae, self.dev):.0%}; latent moves: {latent_report(vae, self.dev)}")
            self.log(f"VAE done: scaling_factor {st['scaling_factor']:.4f}{checks}")
        return done

    @torch.no_grad()
    def latent_scale(self) -> float:
        vae = self.model.vae
        ds = VaeBatches(self.state["seed"] + 1, 16)
        means = []
        for i in range(max(1, round(8 * self.args.batch_scale))):
            with torch.autocast("cuda", torch.bfloat16, enabled=self.amp):
                m, _ = vae.encode_moments(_pixels(ds[i], self.dev))
            means.append(m.float().flatten())
        return float(1.0 / torch.cat(means).std().clamp_min(1e-4))

    # -- phase 2
    def train_transformer(self) -> bool:
        a, st, model = self.args, self.state, self.model
        budget = a.tf_minutes * 60
        model.vae.scaling_factor = float(st["scaling_factor"])
        model.vae.eval().requires_grad_(False)
        params = [p for n, p in model.named_parameters() if not n.startswith("vae.")]
        for p in params:
            p.requires_grad_(True)
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.98),
                                fused=self.amp)
        aux = RouterAux(model)
        data = loader(SeqBatches(str(self.folder / "tokenizer.json"), self.cfg, st["seed"], a.batch_scale,
                                 rank=self.rep.rank, world=self.rep.world),
                      st["tf_step"], a.workers, self.amp)
        model.train()
        t_last, steps_here, acc, usage, ntok, n_acc = time.perf_counter(), 0, None, None, 0, 0
        t_log = t_last
        self.log(f"transformer phase: budget {budget:.0f}s, done {st['tf_s']:.0f}s / step {st['tf_step']}, "
                 f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters")
        t_wait, t_fetch = 0.0, time.perf_counter()
        t_probe = t_fetch
        for k, batch in enumerate(data):
            t_wait += time.perf_counter() - t_fetch
            if k == 0:
                t_last = t_log = time.perf_counter()
                t_wait = 0.0
            # replica 0's clock decides (and drives the LR), so every replica takes the same steps
            stop, save, probe_now, st["tf_s"] = self.rep.agree(
                st["tf_s"] >= budget or st["tf_step"] >= a.max_tf_steps or self.call_left() < a.reserve,
                self.save_due(), time.perf_counter() - t_probe > a.probe_every * 60, st["tf_s"])
            if stop:
                break
            if save:
                self.save()
            if probe_now:
                aux.active = False
                self.run_probe()
                aux.active = True
                t_probe = time.perf_counter()
            if save or probe_now:
                t_last = t_log = time.perf_counter()      # neither is training time nor counts in tok/s
                ntok, t_wait = 0, 0.0
            lr = self.lr_at(a.lr, st["tf_s"] / budget, (steps_here + 1) / a.warmup)
            for gr in opt.param_groups:
                gr["lr"] = lr
            with torch.autocast("cuda", torch.bfloat16, enabled=self.amp):
                L = transformer_losses(model, batch, self.dev, aux, a.fg_weight)
                loss = L["ce"] + a.fm_weight * L["fm"] + a.aux_weight * L["aux"]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            self.rep.average_grads(params)
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            d = torch.stack([L["ce"].detach(), L["fm"].detach(), L["aux"].detach(), gn.detach().float()])
            acc, n_acc = (d if acc is None else acc + d), n_acc + 1
            usage = L["usage"] if usage is None else usage + L["usage"]
            ntok += batch["ids"].numel() * self.rep.world     # replicas' batches are padded alike, not equal
            steps_here += 1
            st["tf_step"] += 1
            now = time.perf_counter()
            st["tf_s"] += now - t_last
            if st["tf_step"] % a.log_every == 0:
                m = (acc / n_acc).tolist()          # after a resume the first window is shorter
                u = usage / n_acc
                ent = float(-(u.clamp_min(1e-9) * u.clamp_min(1e-9).log()).sum(-1).mean() / math.log(u.shape[-1]))
                self.log(f"tf step {st['tf_step']} t={st['tf_s']:.0f}s lr={lr:.2e} ce={m[0]:.4f} fm={m[1]:.4f} "
                         f"aux={m[2]:.3f} gnorm={m[3]:.2f} expert-entropy={ent:.2f} "
                         f"tok/s={ntok / (now - t_log):.0f} data-wait={t_wait / (now - t_log):.0%}",
                         phase="tf", step=st["tf_step"], t=st["tf_s"], ce=m[0], fm=m[1], aux=m[2], gnorm=m[3],
                         expert_entropy=ent)
                acc, usage, ntok, t_log, t_wait, n_acc = None, None, 0, now, 0.0, 0
            t_last = now
            t_fetch = time.perf_counter()
        if steps_here:
            aux.active = False
            self.run_probe()
        for h in aux.handles:
            h.remove()
        model.eval()
        for p in params:
            p.requires_grad_(False)
        return st["tf_s"] >= budget or st["tf_step"] >= a.max_tf_steps

    def run(self) -> int:
        st = self.state
        finished = False
        if st["phase"] == "vae":
            if self.train_vae():
                self.save()
        if st["phase"] == "done" and st["tf_s"] < self.args.tf_minutes * 60 and st["tf_step"] < self.args.max_tf_steps:
            st["phase"] = "tf"                   # resumed with a larger transformer budget
        if st["phase"] == "tf":
            finished = self.train_transformer()
            if finished:
                st["phase"] = "done"
        self.save()
        self.log(f"{'training complete' if st['phase'] == 'done' else 'stopped (resume with --resume)'}: "
                 f"vae {st['vae_step']} steps / {st['vae_s']:.0f}s, transformer {st['tf_step']} steps / "
                 f"{st['tf_s']:.0f}s; checkpoint {self.folder}")
        self.rep.close()
        if self.args.preview and st["phase"] == "done" and self.rep.main:
            preview(self.folder, self.out / "preview.png", self.args.preview, self.args.device)
        return 0


def preview(folder: Path, out: Path, n: int, device: str) -> None:
    """A strip of generated test-split images (T2I then TI2I) through the inference pipeline."""
    from engine.runtime.events import Image as ImageEv
    from engine.model.loader import load
    from engine.runtime.engine import Engine
    from engine.runtime.options import EngineOptions
    from engine.runtime.request import Request
    lm = load(folder, device)
    pipe = Engine(lm, options=EngineOptions(preview_every=0))
    tiles = []
    for i in range(n):
        s = make_sample(i, "test", group=i % 4)
        req = Request(prompt=s.prompt, images=[sc.render() for sc in s.refs], seed=i)
        for ev in pipe.run(req):
            if isinstance(ev, ImageEv):
                import io
                tiles.append(Image.open(io.BytesIO(ev.png)).convert("RGB").resize((128, 128)))
                print(f"preview {i}: {s.prompt!r}", flush=True)
    if tiles:
        strip = Image.new("RGB", (128 * len(tiles), 128))
        for k, t in enumerate(tiles):
            strip.paste(t, (128 * k, 0))
        strip.save(out)


def main_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m train.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run folder: model/ (checkpoint), train_state.json, log.jsonl")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--minutes", type=float, default=1e9, help="wall-clock budget of this call (saves before it)")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out")
    ap.add_argument("--vae-minutes", type=float, default=2.5, help="VAE phase training time (LR schedule)")
    ap.add_argument("--tf-minutes", type=float, default=18.0, help="transformer phase training time (LR schedule)")
    ap.add_argument("--max-vae-steps", type=int, default=1 << 40)
    ap.add_argument("--max-tf-steps", type=int, default=1 << 40)
    ap.add_argument("--batch-scale", type=float, default=1.0, help="scales every batch size")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--vae-lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=150, help="LR warm-up steps (also after a resume)")
    ap.add_argument("--fm-weight", type=float, default=3.0)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--kl-weight", type=float, default=1e-4)
    ap.add_argument("--align-weight", type=float, default=1.0, help="VAE latent alignment (see vae_losses)")
    ap.add_argument("--fg-weight", type=float, default=4.0,
                    help="flow loss weight of shape pixels (see foreground_weights)")
    per_replica = (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))
    ap.add_argument("--workers", type=int, default=min(14, max(0, per_replica - 2)),
                    help="data-loader processes per replica")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--save-every", type=float, default=4.0, help="minutes between checkpoint writes")
    ap.add_argument("--reserve", type=float, default=20.0, help="seconds kept for the final save")
    ap.add_argument("--preview", type=int, default=0, help="when done, generate N test images to preview.png")
    ap.add_argument("--probe", type=int, default=32, help="held-out scenes per probe (0: no probe)")
    ap.add_argument("--probe-every", type=float, default=2.0, help="minutes between probes")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return Run(main_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
