"""The embedded default model's configuration: HunyuanImage-3.0-Instruct-Distil's architecture at a
size that ships in the repository and runs on a laptop CPU.

Same structure as the released model: a MoE decoder (8 experts, top-2, one shared expert, fp32
router, GQA with the fused per-group QKV, q/k RMSNorm after the 2D RoPE), the UNet patch embedding
and final layer, five timestep embedders (Distil: `guidance_emb`, `timestep_r_emb`), a DC-AE style
3D-conv VAE with 16x spatial downsampling (ffactor_temporal 1: a still image is one frame, so CPU
decode stays cheap), a SigLIP2-style NaFlex ViT and its aligner.

Why Instruct-Distil (cfg_distilled + use_meanflow): one backbone forward per denoising step and
few steps (generation_config), against 2 forwards (CFG) x 50 steps for Instruct. The scene is fully
determined by the recaption (colour, shape, size and cell of every object), so the conditional
distribution is narrow and the model needs no CFG; the `<guidance>` / `<timestep_r>` tokens are fed
as inference feeds them (guidance mostly 2.5, r = the next schedule point).

Why the VAE's first width is 64 and the heads' inner width 96, not 32: every GroupNorm of the
official structure has 32 groups, and the decoder's output (and the velocity head's) passes through
one with no skip connection. With one channel per group that norm is an instance norm and erases the
absolute colours (measured: a [32]*5 VAE trained to a constant grey); with 2-3 channels per group
plus the start-up described in train.gn_bypass_init it learns them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig
from engine.model.weights import checkpoint_shapes, vit_head_shapes
from tools.tiny import _dtype_for, tiny_config, write_checkpoint

from .dataset import BASE_SIZE, SYSTEM_PROMPT_PY

HIDDEN = 256
LAYERS = 6
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32          # GQA: 2 query heads per KV head
EXPERTS, TOPK, EXPERT_INTER = 8, 2, 64         # + one shared expert of the same size
PATCH_INNER = 96                               # patch_embed_hidden_dim (UNet heads' inner width)
LATENT = 16
VAE_WIDTHS = [64, 32, 32, 32, 32]
VIT_HIDDEN, VIT_LAYERS, VIT_HEADS, VIT_INTER = 64, 2, 2, 128
VIT_GRID = 8                                   # learned 8x8 position grid; NaFlex max 64 patches
MAX_POSITIONS = 4096
MAX_NEW_TOKENS = 96                            # the CoT is ~30-50 tokens; a runaway one stays cheap
# The schedule the model is trained on (half its samples sit at these 16 shift-3 points with r = the
# next point; the released Distil uses 8). Ours is trained as a plain (instantaneous-velocity) flow
# model with Distil's inputs, so it can also take finer schedules, but 32 steps drew no better than 16
# on the final checkpoint (40 + 40 held-out, seed 0, 2026-11-29: T2I attribute accuracy 95.2% vs 94.7%,
# edits 92.5% vs 95.0%) at 1.35 s instead of 0.98 s per image on 2 CPU cores; so the generation config
# asks for the 16 it was trained on.
SCHEDULE_STEPS = 16
GENERATION_STEPS = 16


def model_config(vocab_size: int, scaling_factor: float = 1.0, token_ids: dict | None = None) -> dict:
    """config.json of the embedded model (the official key set, as tools.tiny writes it)."""
    L = LAYERS
    cfg = tiny_config(vocab_size, distil=True, image_base_size=BASE_SIZE)
    cfg |= {
        "model_version": "HunyuanImage-3.0-Instruct-Distil",
        "attention_head_dim": HEAD_DIM, "head_dim": HEAD_DIM, "hidden_size": HIDDEN,
        "intermediate_size": EXPERT_INTER, "num_hidden_layers": L, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "dense_list": [HIDDEN, 0],
        "max_position_embeddings": MAX_POSITIONS, "moe_intermediate_size": [EXPERT_INTER] * L,
        "moe_topk": [TOPK] * L, "num_experts": EXPERTS, "num_shared_expert": [1] * L,
        "patch_embed_hidden_dim": PATCH_INNER, "cfg_distilled": True, "use_meanflow": True,
        "vae": {"_class_name": "AutoencoderKLConv3D", "block_out_channels": list(VAE_WIDTHS),
                "in_channels": 3, "out_channels": 3, "latent_channels": LATENT, "layers_per_block": 1,
                "ffactor_spatial": 16, "ffactor_temporal": 1, "sample_size": BASE_SIZE, "sample_tsize": 1,
                "downsample_match_channel": True, "upsample_match_channel": True,
                "scaling_factor": float(scaling_factor)},
        "vit": {"_attn_implementation": "sdpa", "attention_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": VIT_HIDDEN, "intermediate_size": VIT_INTER, "layer_norm_eps": 1e-6,
                "num_attention_heads": VIT_HEADS, "num_channels": 3, "num_hidden_layers": VIT_LAYERS,
                "num_patches": VIT_GRID * VIT_GRID, "patch_size": 16, "torch_dtype": "float32"},
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": VIT_HIDDEN, "n_embed": HIDDEN, "depth": 2,
                        "torch_dtype": "float32"},
    }
    cfg["vit_processor"] = dict(cfg["vit_processor"], max_num_patches=VIT_GRID * VIT_GRID)
    if token_ids:
        cfg |= token_ids
    return cfg


def generation_config(eos: int, pad: int) -> dict:
    return {"do_sample": True, "top_k": 1024, "top_p": 0.95, "temperature": 0.6, "max_length": MAX_POSITIONS,
            "max_new_tokens": MAX_NEW_TOKENS, "sequence_template": "instruct",
            "diff_infer_steps": GENERATION_STEPS,
            "diff_guidance_scale": 2.5, "flow_shift": 3.0, "use_system_prompt": "en_unified",
            "drop_think": False, "bot_task": "think_recaption", "eos_token_id": [eos], "pad_token_id": pad,
            "disable_compile": True}


def all_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    mc = ModelConfig.from_dict(cfg)
    return checkpoint_shapes(mc) | vit_head_shapes(mc)


def size_report(cfg: dict) -> dict:
    """Parameter counts and checkpoint bytes, by component (dtypes as the official checkpoint)."""
    groups: dict[str, list[int]] = {}
    for name, shape in all_shapes(cfg).items():
        n = 1
        for d in shape:
            n *= d
        key = name.split(".")[0] if not name.startswith(names.LAYERS) else names.LAYERS.rstrip(".")
        if name in (names.WTE, names.weight(names.LM_HEAD)):
            key = "embeddings"
        nbytes = n * (4 if _dtype_for(name) == __import__("torch").float32 else 2)
        g = groups.setdefault(key, [0, 0])
        g[0] += n
        g[1] += nbytes
    total = [sum(v[0] for v in groups.values()), sum(v[1] for v in groups.values())]
    return {"by_component": groups, "params": total[0], "bytes": total[1]}


SPECIAL_IDS = (("bos_token_id", "<|startoftext|>"), ("eos_token_id", "<|endoftext|>"), ("pad_token_id", "<pad>"),
               ("pad_id", "<pad>"), ("image_token_id", "<img>"), ("im_start_id", "<boi>"), ("im_end_id", "<eoi>"))


def token_ids(tok: HFTokenizer) -> dict:
    return {k: tok.token_to_id(t) for k, t in SPECIAL_IDS}


def write_folder(out: str | Path, tok: HFTokenizer, cfg: dict, tensors: dict[str, torch.Tensor],
                 shards: int = 3) -> Path:
    """A complete checkpoint folder in the official layout: config.json, generation_config.json,
    tokenizer.json + tokenizer_config.json, system_prompt.py, sharded safetensors + index. Each tensor
    is stored in its official dtype (fp32 router / VAE / ViT / aligner, bf16 elsewhere)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = token_ids(tok)
    cfg = dict(cfg) | ids
    missing = set(all_shapes(cfg)) - set(tensors)
    if missing:
        raise ValueError(f"write_folder: {len(missing)} tensors missing, e.g. {sorted(missing)[:3]}")
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps(generation_config(ids["eos_token_id"],
                                                                              ids["pad_token_id"]), indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
         "pad_token": "<pad>", "model_max_length": 1048576}, indent=1))
    (out / "system_prompt.py").write_text(SYSTEM_PROMPT_PY)
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    write_checkpoint(out, {n: t.detach().to("cpu", _dtype_for(n)) for n, t in sorted(tensors.items())}, shards)
    return out

