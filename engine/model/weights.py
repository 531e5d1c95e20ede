"""The checkpoint plan of the model: every tensor the official checkpoint holds (name -> shape, derived
from the config alone), and the load that validates a folder against it and reads each rank's slices
straight into the resident buffers (each module reads its own packed slices: engine/model/packed.py).
Validation runs before any tensor is read, so a mismatched folder never half-loads."""
from __future__ import annotations

from typing import Callable

import torch

from engine.model.hunyuan import HunyuanImage3, image_side_modules
from engine.spec.checkpoint import Checkpoint
from engine.spec.config import ModelConfig

# Tensors the checkpoint holds that inference never uses: accepted and skipped.
SKIPPED_PREFIXES = ("vision_model.head.",)

Progress = Callable[[int, int, str], None]


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
        heads = image_side_modules(cfg, device="meta")
    for prefix, mod in heads.items():
        out |= {f"{prefix}.{k}": tuple(v.shape) for k, v in mod.state_dict().items()}
    return out


def vit_head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The unused SigLIP2 pooling head the official checkpoint carries (written by the tiny maker so its
    folders have the official layout; skipped at load)."""
    h, f = int(cfg.vit["hidden_size"]), int(cfg.vit["intermediate_size"])
    p = "vision_model.head."
    return {p + "probe": (1, 1, h), p + "attention.in_proj_weight": (3 * h, h), p + "attention.in_proj_bias": (3 * h,),
            p + "attention.out_proj.weight": (h, h), p + "attention.out_proj.bias": (h,),
            p + "layernorm.weight": (h,), p + "layernorm.bias": (h,),
            p + "mlp.fc1.weight": (f, h), p + "mlp.fc1.bias": (f,), p + "mlp.fc2.weight": (h, f), p + "mlp.fc2.bias": (h,)}


def load_weights(model: HunyuanImage3, ckpt: Checkpoint, progress: Progress | None = None) -> None:
    """Validate the checkpoint against the config, then read this rank's slices into the model."""
    expected = checkpoint_shapes(model.cfg)
    ckpt.validate(expected, skipped=[n for n in ckpt.tensors if n.startswith(SKIPPED_PREFIXES)])
    names, done = list(expected), 0
    tr = model.transformer
    with torch.no_grad():
        tr.load_ends(ckpt, model.layout)
        for i, layer in enumerate(tr.layers):
            prefix = f"model.layers.{i}."
            layer.load(ckpt, prefix, model.layout)
            done += sum(1 for n in names if n.startswith(prefix))
            if progress:
                progress(done, len(names), f"layer {i + 1}/{model.cfg.num_layers}")
        for prefix, mod in model.replicated_modules().items():
            for key, t in mod.state_dict().items():
                t.copy_(ckpt.read(f"{prefix}.{key}"))
                done += 1
            if progress:
                progress(done, len(names), prefix)
