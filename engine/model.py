"""The whole HunyuanImage-3.0 model as one rank keeps it resident, and its checkpoint plan.

`checkpoint_shapes(cfg)` is the list of every tensor the official checkpoint holds (name -> shape),
derived from the config alone; `load_weights` reads each rank's slices straight into the resident
(packed, micro-major) buffers. The replicated image-side modules keep the official parameter names,
so their checkpoint names are their `state_dict` keys under a prefix.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .attention import AttnBatch, KVCache, attention_mask
from .checkpoint import Checkpoint
from .config import ModelConfig
from .image_heads import TimestepEmbedder, UNetDown, UNetUp
from .layers import rope_angles
from .parallel import PhaseView, ShardLayout
from .transformer import Transformer
from .vae import AutoencoderKLConv3D
from .vit import Siglip2VisionModel, VisionAligner

# Tensors the checkpoint holds that inference never uses: accepted and skipped.
SKIPPED_PREFIXES = ("vision_model.head.",)


class HunyuanImage3(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout = ShardLayout(), dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        if cfg.patch_size != 1:
            raise ValueError(f"patch_size {cfg.patch_size} is not supported (the released models use 1)")
        self.cfg, self.layout, self.dtype = cfg, layout, dtype
        self.transformer = Transformer(cfg, layout, dtype=dtype, device=device)
        self.guidance_emb: TimestepEmbedder | None = None
        self.timestep_r_emb: TimestepEmbedder | None = None
        with torch.device(device):      # build (and default-initialise) the replicated modules in place
            mods = _image_side_modules(cfg, dtype, device)
        self.image_modules = list(mods)
        for name, mod in mods.items():
            setattr(self, name, mod)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.transformer.wte.device

    def attn_batch(self, index: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor, kv_len: int,
                   view: PhaseView, masked: bool = True, gathered: torch.Tensor | None = None) -> AttnBatch:
        """RoPE tables and mask for the tokens at sequence indices `index` [T] (see `backbone`)."""
        cos, sin = rope_angles(pos.index_select(0, index), self.cfg.head_dim, self.cfg.rope_theta)
        rows = gathered if gathered is not None and view.sp_kind == "ulysses" else index
        mask = attention_mask(rows, blocks, kv_len) if masked else None
        return AttnBatch(index, cos, sin, kv_len, mask, gathered)

    def backbone(self, x: torch.Tensor, index: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor,
                 cache: KVCache, kv_len: int, view: PhaseView, masked: bool = True,
                 gathered: torch.Tensor | None = None, batch: AttnBatch | None = None) -> torch.Tensor:
        """Run the layers on embeddings x [B, T, H] of the tokens at sequence indices `index` [T].

        pos [>=kv_len, 2] and blocks [>=kv_len] describe the whole sequence; keys [0, kv_len) of the cache
        are attended to. `masked=False` when every query may see every key (a decode step). Under sequence
        parallelism x holds this rank's tokens and `gathered` [S] the indices of every rank's tokens.
        A `batch` prepared once by `attn_batch` (the same tokens at every denoise step) skips rebuilding it.
        """
        batch = batch or self.attn_batch(index, pos, blocks, kv_len, view, masked, gathered)
        return self.transformer(x, batch, cache, view)

    def replicated_modules(self) -> dict[str, nn.Module]:
        """Checkpoint prefix -> module whose state_dict keys are the checkpoint names under that prefix."""
        return {name: getattr(self, name) for name in self.image_modules}


def _backbone_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H, D = cfg.hidden_size, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {"model.wte.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        I, Is = cfg.moe_intermediate_size[i], cfg.shared_intermediate(i)
        out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.qkv_proj.weight": ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H),
                p + "self_attn.o_proj.weight": (H, cfg.num_heads * D),
                p + "self_attn.query_layernorm.weight": (D,), p + "self_attn.key_layernorm.weight": (D,),
                p + "mlp.gate.wg.weight": (cfg.num_experts[i], H)}
        if Is:
            out |= {p + "mlp.shared_mlp.gate_and_up_proj.weight": (2 * Is, H),
                    p + "mlp.shared_mlp.down_proj.weight": (H, Is)}
        for e in range(cfg.num_experts[i]):
            out |= {p + f"mlp.experts.{e}.gate_and_up_proj.weight": (2 * I, H),
                    p + f"mlp.experts.{e}.down_proj.weight": (H, I)}
    out |= {"model.ln_f.weight": (H,), "lm_head.weight": (cfg.vocab_size, H)}
    return out


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor inference loads: name -> shape, as in the official checkpoint."""
    out = _backbone_shapes(cfg)
    with torch.device("meta"):
        heads = _image_side_modules(cfg, device="meta")
    for prefix, mod in heads.items():
        out |= {f"{prefix}.{k}": tuple(v.shape) for k, v in mod.state_dict().items()}
    return out


def _image_side_modules(cfg: ModelConfig, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> dict[str, nn.Module]:
    """Replicated modules by checkpoint prefix. The VAE, ViT and aligner stay fp32, as their sub-configs
    ask (vae_dtype / torch_dtype float32); the embedders and UNet heads take the model dtype."""
    H, latent = cfg.hidden_size, int(cfg.vae["latent_channels"])
    kw = dict(dtype=dtype, device=device)
    names = ["timestep_emb", "time_embed", "time_embed_2"]
    names += ["guidance_emb"] if cfg.cfg_distilled else []
    names += ["timestep_r_emb"] if cfg.use_meanflow else []
    mods: dict[str, nn.Module] = {n: TimestepEmbedder(H, **kw) for n in names}
    mods |= {"patch_embed": UNetDown(latent, cfg.patch_embed_hidden_dim, H, **kw),
             "final_layer": UNetUp(H, cfg.patch_embed_hidden_dim, latent, **kw),
             "vae": AutoencoderKLConv3D(cfg.vae).to(device),
             "vision_model": Siglip2VisionModel(cfg.vit).to(device),
             "vision_aligner": VisionAligner(cfg.vit_aligner).to(device)}
    return mods


def vit_head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The unused SigLIP2 pooling head the official checkpoint carries (written by the tiny maker so its
    folders have the official layout; skipped at load)."""
    h, f = int(cfg.vit["hidden_size"]), int(cfg.vit["intermediate_size"])
    p = "vision_model.head."
    return {p + "probe": (1, 1, h), p + "attention.in_proj_weight": (3 * h, h), p + "attention.in_proj_bias": (3 * h,),
            p + "attention.out_proj.weight": (h, h), p + "attention.out_proj.bias": (h,),
            p + "layernorm.weight": (h,), p + "layernorm.bias": (h,),
            p + "mlp.fc1.weight": (f, h), p + "mlp.fc1.bias": (f,), p + "mlp.fc2.weight": (h, f), p + "mlp.fc2.bias": (h,)}


Progress = Callable[[int, int, str], None]


def load_weights(model: HunyuanImage3, ckpt: Checkpoint, progress: Progress | None = None) -> None:
    """Validate the checkpoint against the config, then read this rank's slices into the model.

    Validation runs before any tensor is read, so a mismatched folder never half-loads.
    """
    cfg, lay = model.cfg, model.layout
    expected = checkpoint_shapes(cfg)
    ckpt.validate(expected, skipped=[n for n in ckpt.tensors if n.startswith(SKIPPED_PREFIXES)])
    M, s = lay.micros, lay.storage_rank
    block = lambda n: n // lay.logical_size * M            # rows/cols of one storage shard
    start = lambda n: s * block(n)
    names = list(expected)
    done = 0

    def put(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src.view(dst.shape) if src.numel() == dst.numel() else src)

    def rows(name: str, n: int) -> torch.Tensor:
        return ckpt.read(name, (slice(start(n), start(n) + block(n)),))

    def cols(name: str, n: int) -> torch.Tensor:
        return ckpt.read(name, (slice(None), slice(start(n), start(n) + block(n))))

    def gate_up(name: str, inter: int, dst: torch.Tensor) -> None:
        # checkpoint rows = [x1 (inter) ; x2 (inter)]; each micro keeps [x1 block ; x2 block] of its slice
        r0, nb = start(inter), block(inter)
        half = dst.shape[-2] // 2
        x1 = ckpt.read(name, (slice(r0, r0 + nb),)).view(M, half, -1)
        x2 = ckpt.read(name, (slice(inter + r0, inter + r0 + nb),)).view(M, half, -1)
        dst[..., :half, :].copy_(x1)
        dst[..., half:, :].copy_(x2)

    tr = model.transformer
    with torch.no_grad():
        put(tr.wte, ckpt.read("model.wte.weight"))
        put(tr.ln_f.weight, ckpt.read("model.ln_f.weight"))
        put(tr.lm_head, rows("lm_head.weight", cfg.vocab_size))
        for i, layer in enumerate(tr.layers):
            p = f"model.layers.{i}."
            att, moe = layer.self_attn, layer.mlp
            put(layer.input_layernorm.weight, ckpt.read(p + "input_layernorm.weight"))
            put(layer.post_attention_layernorm.weight, ckpt.read(p + "post_attention_layernorm.weight"))
            put(att.qkv, rows(p + "self_attn.qkv_proj.weight", expected[p + "self_attn.qkv_proj.weight"][0]))
            put(att.o_proj, cols(p + "self_attn.o_proj.weight", cfg.num_heads * cfg.head_dim))
            put(att.q_norm.weight, ckpt.read(p + "self_attn.query_layernorm.weight"))
            put(att.k_norm.weight, ckpt.read(p + "self_attn.key_layernorm.weight"))
            put(moe.gate, ckpt.read(p + "mlp.gate.wg.weight"))
            if moe.shared_w1 is not None:
                Is = cfg.shared_intermediate(i)
                gate_up(p + "mlp.shared_mlp.gate_and_up_proj.weight", Is, moe.shared_w1)
                put(moe.shared_w2, cols(p + "mlp.shared_mlp.down_proj.weight", Is))
            I = cfg.moe_intermediate_size[i]
            for e in range(cfg.num_experts[i]):
                gate_up(p + f"mlp.experts.{e}.gate_and_up_proj.weight", I, moe.w1[:, e])
                down = cols(p + f"mlp.experts.{e}.down_proj.weight", I)      # [H, M * I_micro]
                moe.w2[:, e].copy_(down.view(down.shape[0], M, -1).transpose(0, 1))
            done += sum(1 for n in names if n.startswith(p))
            if progress:
                progress(done, len(names), f"layer {i + 1}/{cfg.num_layers}")
        for prefix, mod in model.replicated_modules().items():
            for key, t in mod.state_dict().items():
                t.copy_(ckpt.read(f"{prefix}.{key}"))
                done += 1
            if progress:
                progress(done, len(names), prefix)
