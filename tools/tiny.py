"""`python -m tools.tiny OUT_DIR [--distil] [--seed N] [--blocks] [--quant FORMAT]`: a complete
checkpoint folder in the official layout (config keys, generation config, sharded safetensors + index, tokenizer.json with
every official special token, system_prompt.py) with tiny dimensions and random weights.

Dimensions allow every parallel plan up to 8 ranks: 8 KV heads, expert and shared intermediate 32
(4 per rank at TP8), vocabulary padded to a multiple of 64.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import zlib
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.model.weights import checkpoint_shapes, vit_head_shapes
from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.tokenizer import OFFICIAL_SPECIAL_TOKENS

TINY_LAYERS = 2

# The official config keys (values of the released base config where they are not dimensions).
def tiny_config(vocab_size: int, distil: bool, image_base_size: int = 256, head_dim: int = 8,
                moe_intermediate: int = 32, num_experts: int = 8) -> dict:
    L = TINY_LAYERS
    return {
        "architectures": ["HunyuanImage3ForCausalMM"], "model_type": "hunyuan_image_3_moe",
        "model_version": "HunyuanImage-3.0-Instruct-Distil" if distil else "HunyuanImage-3.0-Instruct",
        "add_classification_head": False, "attention_bias": False, "attention_dropout": 0.0,
        "attention_head_dim": head_dim, "head_dim": head_dim, "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": L, "num_attention_heads": 16, "num_key_value_heads": 8,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "pad_id": None, "image_token_id": None,
        "im_start_id": None, "im_end_id": None, "cla_share_factor": 2, "class_num": 0, "dense_list": [64, 0],
        "eod_token_id": 3, "text_start_id": 6, "text_end_id": 7, "video_start_id": 9, "video_end_id": 10,
        "im_newline_id": 11, "mask_init_id": 12,
        "group_limited_greedy": False, "hidden_act": "silu", "initializer_range": 0.02, "kv_lora_rank": None,
        "max_position_embeddings": 4096, "mlp_bias": False, "moe_drop_tokens": False,
        "moe_intermediate_size": [moe_intermediate] * L, "moe_layer_num_skipped": 0, "moe_random_routing_dropped_token": False,
        "moe_topk": [2] * L, "n_group": False, "norm_topk_prob": True, "norm_type": "rms", "num_experts": num_experts,
        "num_media_embeds": 257, "num_shared_expert": [1] * L, "pool_type": "last",
        "position_embedding_xdrope": False, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": None,
        "qk_rope_head_dim": None, "rms_norm_eps": 1e-05,
        "rope_scaling": {"alpha": 1.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "type": "custom"},
        "rope_theta": 10000.0, "routed_scaling_factor": False, "skip_cls_token": False,
        "tie_word_embeddings": False, "topk_group": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0", "use_cache": True, "use_cla": False, "use_mixed_mlp_moe": True,
        "use_mla": False, "use_qk_norm": True, "use_rotary_pos_emb": True, "v_head_dim": None,
        "vit_type": "siglip2-so400m-patch16-naflex", "vocab_size": vocab_size, "rope_type": "2d",
        "vae_downsample_factor": [16, 16], "vit_downsample_factor": [16, 16],
        "cond_token_attn_type": "joint_full", "cond_image_type": "vae_vit", "vae_type": "hunyuan-image-vae-v1",
        "vae_dtype": "float32", "vae_autocast_dtype": "float16", "image_base_size": image_base_size,
        "patch_embed_hidden_dim": 32, "cfg_distilled": distil, "use_meanflow": distil,
        "vae": {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [32, 32, 32, 32, 32],
                "in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 1,
                "ffactor_spatial": 16, "ffactor_temporal": 1, "sample_size": 64, "sample_tsize": 1,
                "downsample_match_channel": True, "upsample_match_channel": True, "scaling_factor": 0.5627},
        "vit": {"_attn_implementation": "sdpa", "attention_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh",
                "hidden_size": 32, "intermediate_size": 64, "layer_norm_eps": 1e-6, "num_attention_heads": 2,
                "num_channels": 3, "num_hidden_layers": 2, "num_patches": 16, "patch_size": 16,
                "torch_dtype": "float32"},
        "vit_processor": {"do_convert_rgb": None, "do_normalize": True, "do_rescale": True, "do_resize": True,
                          "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Siglip2ImageProcessorFast",
                          "image_std": [0.5, 0.5, 0.5], "max_num_patches": 64, "patch_size": 16,
                          "processor_class": "Siglip2Processor", "resample": 2, "rescale_factor": 1 / 255},
        "vit_aligner": {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2,
                        "torch_dtype": "float32"},
    }


def generation_config(distil: bool) -> dict:
    return {"do_sample": True, "top_k": 1024, "top_p": 0.95, "temperature": 0.6, "max_length": 4096,
            "max_new_tokens": 256, "sequence_template": "instruct",
            "diff_infer_steps": 8 if distil else 50, "diff_guidance_scale": 2.5 if distil else 5.0,
            "flow_shift": 3.0, "use_system_prompt": "en_unified", "drop_think": False,
            "bot_task": "think_recaption", "eos_token_id": [None], "pad_token_id": None,
            "disable_compile": True}


SYSTEM_PROMPT_PY = '''"""Short system prompts for tiny test checkpoints (same variable names as the official file)."""

t2i_system_prompt_en_vanilla = """
You are an image generator. Draw what the user asks for.
"""

t2i_system_prompt_en_recaption = """
You rewrite the user's request as a precise description wrapped in <recaption> tags, then draw it.
"""

t2i_system_prompt_en_think_recaption = """
First think about the request inside <think> tags, then write a precise description inside <recaption> tags.
"""

unified_system_prompt_en = """
You are a multimodal assistant. You can think in <think> tags, describe images in <recaption> tags,
answer questions about images and draw or edit images.
"""
'''

_WORDS = ("red green blue yellow purple orange white black gray pink small large tiny big circle square "
          "triangle star ring cross heart on the left right top bottom center of a an image picture with "
          "background two three one four shapes and draw paint make turn into move remove add color "
          "the user wants so I will think recaption answer describe scene photo bright dark").split()


def _corpus(seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = [SYSTEM_PROMPT_PY, "User: Assistant: \n\n"]
    for _ in range(400):
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", "!", "?", ","]))
    return lines


def train_bpe(texts: Iterable[str], vocab: int) -> HFTokenizer:
    """Byte-level BPE trained on `texts`, then every official special token appended (so the engine
    resolves every name it needs). The tiny checkpoints and the embedded model both use it."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(OFFICIAL_SPECIAL_TOKENS))
    return tok


def build_tokenizer(seed: int = 0, vocab: int = 512) -> HFTokenizer:
    """The tiny checkpoints' tokenizer: BPE on a small generated corpus."""
    return train_bpe(_corpus(seed), vocab)


def _init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        # every 1-D `weight` is a norm scale: 1 plus a little noise (so a misplaced weight is caught)
        return (1.0 if leaf == "weight" else 0.0) + 0.02 * torch.randn(shape, generator=g)
    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    return torch.randn(shape, generator=g) * fan_in ** -0.5


FP32_PREFIXES = tuple(m + "." for m in (names.VAE, names.VISION_MODEL, names.VISION_ALIGNER))


def _dtype_for(name: str) -> torch.dtype:
    # As the official checkpoint: an fp32 router, fp32 VAE / ViT / aligner, bf16 elsewhere.
    if name.endswith(names.ROUTER) or name.startswith(FP32_PREFIXES):
        return torch.float32
    return torch.bfloat16


def write_checkpoint(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 3) -> None:
    listed = list(tensors)
    per = -(-len(listed) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        chunk = listed[k * per:(k + 1) * per]
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in chunk}, str(folder / file), metadata={"format": "pt"})
        for n in chunk:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# Dimensions whose every tensor-parallel split, up to 8 micros, cuts whole 32-element blocks along K
# (o_proj K = 16 heads x 16 = 256, expert and shared intermediate 256: 32 columns per micro at TP8), so a
# block-quantized copy (MX: 32, NVFP4: 16) loads on every plan. The default tiny dimensions only load
# quantized at tp1: its down_proj K of 32 splits into 16 columns at TP2, half a block.
BLOCK_DIMS = {"head_dim": 16, "moe_intermediate": 256, "num_experts": 4}


def make_tiny(out: str | Path, distil: bool = False, seed: int = 0, blocks: bool = False,
              quant: str | None = None) -> Path:
    """Write the folder; `blocks`: the BLOCK_DIMS variant; `quant`: then quantize its backbone linears as a
    real tool would (tools/tiny_quant.py, QUANT_FORMATS)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(seed)
    tok.save(str(out / "tokenizer.json"))
    vocab = -(-tok.get_vocab_size() // 64) * 64
    cfg = tiny_config(vocab, distil, **(BLOCK_DIMS if blocks else {}))
    ids = {k: tok.token_to_id(t) for k, t in (("bos_token_id", "<|startoftext|>"), ("eos_token_id", "<|endoftext|>"),
                                              ("pad_token_id", "<pad>"), ("pad_id", "<pad>"),
                                              ("image_token_id", "<img>"), ("im_start_id", "<boi>"),
                                              ("im_end_id", "<eoi>"))}
    cfg |= ids
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = generation_config(distil)
    gen |= {"eos_token_id": [ids["eos_token_id"]], "pad_token_id": ids["pad_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
         "pad_token": "<pad>", "model_max_length": 1048576}, indent=1))
    (out / "system_prompt.py").write_text(SYSTEM_PROMPT_PY)
    shapes = checkpoint_shapes(ModelConfig.from_dict(cfg)) | vit_head_shapes(ModelConfig.from_dict(cfg))
    tensors = {n: _init(n, s, seed).to(_dtype_for(n)) for n, s in sorted(shapes.items())}
    write_checkpoint(out, tensors)
    if quant:
        from tools.tiny_quant import quantize_folder
        quantize_folder(out, quant)
    return out


def main(argv: list[str] | None = None) -> int:
    from tools.tiny_quant import QUANT_FORMATS
    ap = argparse.ArgumentParser(prog="python -m tools.tiny",
                                 description="Write a tiny random checkpoint in the official layout.")
    ap.add_argument("out")
    ap.add_argument("--distil", action="store_true", help="an Instruct-Distil checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", action="store_true",
                    help="dimensions whose every plan split keeps whole 32-element blocks (for --quant on gloo plans)")
    ap.add_argument("--quant", metavar="FORMAT",
                    help="quantize the backbone linears as a real tool lays them out: mxfp8, mxfp4 (auto-round); "
                         "mxfp8-ct, mxfp4-ct, nvfp4-ct (compressed-tensors); fp8-modelopt, fp8-channel-modelopt, "
                         "nvfp4-modelopt (ModelOpt)")
    args = ap.parse_args(argv)
    if args.quant and args.quant not in QUANT_FORMATS:
        print(f"error: unknown --quant {args.quant!r}; choose one of {', '.join(QUANT_FORMATS)}", file=sys.stderr)
        return 2
    print(f"wrote {make_tiny(args.out, distil=args.distil, seed=args.seed, blocks=args.blocks, quant=args.quant)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
