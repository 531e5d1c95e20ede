"""The whole HunyuanImage-3.0 model as one rank keeps it resident: the backbone (tensor-parallel,
packed micro-major) and the replicated image-side modules, which keep the official parameter names so
that their checkpoint names are their `state_dict` keys under a prefix (engine/checkpoint/names.py); each one is
the model's attribute of that name (`model.vae`, `model.patch_embed`, ...)."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from engine.model.attention import AttnBatch, KVCache, attention_mask, sdpa_mask
from engine.model.image_heads import TimestepEmbedder, UNetDown, UNetUp
from engine.model.layers import rope_angles
from engine.model.lora import LoraRows, LoraTables
from engine.model.transformer import Resident, Transformer
from engine.model.vae import AutoencoderKLConv3D
from engine.model.vit import Siglip2VisionModel, VisionAligner
from engine.parallel.layout import PhaseView, ShardLayout
from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig


class HunyuanImage3(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout = ShardLayout(), dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", resident: Resident | None = None):
        """`resident`: the backbone packs that stay quantized, by name (engine/model/weights.py
        `resident_packs`); every other weight is allocated in `dtype`."""
        super().__init__()
        if cfg.patch_size != 1:
            raise ValueError(f"patch_size {cfg.patch_size} is not supported (the released models use 1)")
        self.cfg, self.layout, self.dtype = cfg, layout, dtype
        self.transformer = Transformer(cfg, layout, dtype=dtype, device=device, resident=resident)
        self.guidance_emb: TimestepEmbedder | None = None
        self.timestep_r_emb: TimestepEmbedder | None = None
        with torch.device(device):      # build (and default-initialise) the replicated modules in place
            mods = image_side_modules(cfg, dtype, device)
        self.image_modules = list(mods)
        self.lora: LoraTables | None = None     # the loaded LoRA adapters' tables (`enable_lora`), if any
        self.merged_lora: str | None = None     # the adapter folded into the weights (engine/model/lora_merge.py)
        self.merged_strength = 1.0              # ... at this strength (lora_scale)
        for name, mod in mods.items():
            setattr(self, name, mod)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.device

    def enable_lora(self, capacity: int, max_rank: int, mlp: bool = False) -> LoraTables:
        """Allocate the LoRA tables for up to `capacity` adapters of rank <= `max_rank`, of the MLPs too with
        `mlp` (once, before the runtime is made: it binds its forwards to them)."""
        if self.merged_lora is not None:
            raise ValueError(f"the LoRA adapter {self.merged_lora!r} is merged into the weights: no adapter tables")
        if self.lora is None:
            self.lora = LoraTables(self.cfg, self.layout, capacity, max_rank, self.dtype, self.device, mlp)
        return self.lora

    def attn_batch(self, index: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor, kv_len: int,
                   view: PhaseView, masked: bool = True, gathered: torch.Tensor | None = None,
                   masked_rows: int | None = None, lora: LoraRows | None = None) -> AttnBatch:
        """The attention inputs of the tokens at sequence indices `index` [T], the same for every batch row:
        pos [>=kv_len, 2] and blocks [>=kv_len] describe the whole sequence, keys [0, kv_len) of the cache
        are attended to. `masked=False` when every query may see every key (a decode step). Under sequence
        parallelism `gathered` [S]: the indices of every rank's tokens. `masked_rows`: only that many
        leading query rows need the mask; `lora`: the rows' adapters (see AttnBatch)."""
        cos, sin = rope_angles(pos.index_select(0, index), self.cfg.head_dim, self.cfg.rope_theta)
        rows = gathered if gathered is not None and view.sp_kind == "ulysses" else index
        if masked_rows is not None:
            rows = rows[:masked_rows]
        mask = sdpa_mask(attention_mask(rows, blocks, kv_len), self.dtype) if masked else None
        return AttnBatch(index, cos, sin, kv_len, mask, gathered, masked_rows, lora=lora)

    def row_batch(self, index: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor, kv_len: int,
                  kv_len_dev: torch.Tensor, lora: LoraRows | None = None) -> AttnBatch:
        """The attention inputs of a batched decode step, each batch row its own sequence: row b's tokens
        sit at sequence indices index[b] ([B, T]) of its cache row, with the positions of position table
        rows[b] (pos [R, >=kv_len, 2]: tables differ per request, reference images having 2D positions)
        and keys [0, kv_len_dev[b]) valid ([B]) under the static bound kv_len. No mask: a row's queries
        see its valid keys (the last T causal among themselves). Gathered on the device (graph-safe)."""
        B, T = index.shape
        D = self.cfg.head_dim
        cos, sin = rope_angles(pos[rows[:, None], index].view(B * T, 2), D, self.cfg.rope_theta)
        return AttnBatch(index, cos.view(B, T, D), sin.view(B, T, D), kv_len, None, kv_len_dev=kv_len_dev, lora=lora)

    def backbone(self, x: torch.Tensor, batch: AttnBatch, cache: KVCache, view: PhaseView,
                 layers: range | None = None) -> torch.Tensor:
        """The one way into the layers: embeddings x [B, T, H] of the tokens `batch` describes (built by
        `attn_batch` or `row_batch`), their K/V written into `cache`, under the phase `view` -> the hidden
        states [B, T, H] (no final norm). Under sequence parallelism x holds this rank's tokens. `layers`:
        only these layers (x is then the residual stream entering the first; default all)."""
        return self.transformer(x, batch, cache, view, layers)

    def vae_autocast(self) -> contextlib.AbstractContextManager:
        """The VAE's precision: fp16 autocast on CUDA (config `vae_autocast_dtype`, as the official
        pipeline), plain fp32 on the CPU."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        name = str(self.cfg.raw.get("vae_autocast_dtype", "float16"))
        return torch.autocast("cuda", dtype={"bfloat16": torch.bfloat16}.get(name, torch.float16))

    def decode_image(self, z: torch.Tensor) -> torch.Tensor:
        """Scaled latent [B, C, h, w] -> image [B, 3, H, W] fp32 in about [-1, 1]."""
        with self.vae_autocast():
            return self.vae.decode_latent(z.float()).float()

    def replicated_modules(self) -> dict[str, nn.Module]:
        """Checkpoint prefix -> module whose state_dict keys are the checkpoint names under that prefix."""
        return {name: getattr(self, name) for name in self.image_modules}


def image_side_modules(cfg: ModelConfig, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> dict[str, nn.Module]:
    """Replicated modules by checkpoint prefix. The embedders and UNet heads take the model dtype. The
    VAE keeps fp32 weights (vae_dtype; on CUDA it runs under fp16 autocast, `HunyuanImage3.vae_autocast`,
    as the official pipeline does); the ViT and aligner run in the model dtype on CUDA (bf16, as the
    official pipeline runs them) and in fp32 on the CPU."""
    H, latent = cfg.hidden_size, int(cfg.vae["latent_channels"])
    kw = dict(dtype=dtype, device=device)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    vit = dict(device=device, dtype=dtype if on_gpu and dtype is not None else torch.float32)
    embedders = list(names.TIMESTEP_EMBEDDERS)
    embedders += [names.GUIDANCE_EMB] if cfg.cfg_distilled else []
    embedders += [names.TIMESTEP_R_EMB] if cfg.use_meanflow else []
    mods: dict[str, nn.Module] = {n: TimestepEmbedder(H, **kw) for n in embedders}
    mods |= {names.PATCH_EMBED: UNetDown(latent, cfg.patch_embed_hidden_dim, H, **kw),
             names.FINAL_LAYER: UNetUp(H, cfg.patch_embed_hidden_dim, latent, **kw),
             names.VAE: AutoencoderKLConv3D(cfg.vae).to(device),
             names.VISION_MODEL: Siglip2VisionModel(cfg.vit).to(**vit),
             names.VISION_ALIGNER: VisionAligner(cfg.vit_aligner).to(**vit)}
    if on_gpu:      # the heads' 3x3 convolutions at 64x64 x 4096 channels: channels-last is cuDNN's fast layout
        for name in (names.PATCH_EMBED, names.FINAL_LAYER):
            mods[name] = mods[name].to(memory_format=torch.channels_last)
    return mods
