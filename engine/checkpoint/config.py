"""Model and generation configuration, read from the official `config.json` / `generation_config.json`.

Keys and defaults follow the official `HunyuanImage3Config`; keys absent from the released files
(`patch_size`, `img_proj_type`, `image_base_size`, ...) take the class defaults. Behaviour is keyed on
`cfg_distilled` / `use_meanflow` (Instruct vs Instruct-Distil), never on `model_version`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config file is missing, unreadable, or describes a model this engine cannot run."""


def _refuse_unsupported(d: dict[str, Any]) -> None:
    """ConfigError naming a config.json setting the engine does not implement."""
    if d.get("rope_type", "2d") != "2d":
        raise ConfigError(f"config.json: rope_type {d.get('rope_type')!r} is not supported (only '2d')")
    for flag in ("use_mla", "use_cla"):
        if d.get(flag):
            raise ConfigError(f"config.json: `{flag}` is not supported")
    # `moe_drop_tokens` is ignored: the engine never drops tokens (grouped-GEMM semantics)
    if int(d.get("moe_layer_num_skipped", 0)) != 0:
        raise ConfigError("config.json: dense (non-MoE) layers are not supported (moe_layer_num_skipped != 0)")
    cond_image_type = d.get("cond_image_type", "vae_vit")
    if cond_image_type != "vae_vit":
        raise ConfigError(f"config.json: cond_image_type {cond_image_type!r} is not supported (only 'vae_vit')")
    attn_type = d.get("cond_token_attn_type", "full")
    if attn_type not in ("joint_full", "full", "full_causal", "causal"):
        raise ConfigError(f"config.json: unknown cond_token_attn_type {attn_type!r}")
    if d.get("img_proj_type", "unet") != "unet":
        raise ConfigError(f"config.json: img_proj_type {d.get('img_proj_type')!r} is not supported (only 'unet')")
    for sub in ("vae", "vit", "vit_processor", "vit_aligner"):
        if not isinstance(d.get(sub), dict):
            raise ConfigError(f"config.json: the `{sub}` section is missing")


def _per_layer(value: Any, n_layers: int, name: str) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if len(value) != n_layers:
            raise ConfigError(f"config.json: `{name}` has {len(value)} entries for {n_layers} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layers


def read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path.name} not found in {path.parent}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class ModelConfig:
    # backbone
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # MoE (per layer)
    num_experts: tuple[int, ...]
    moe_topk: tuple[int, ...]
    moe_intermediate_size: tuple[int, ...]
    num_shared_expert: tuple[int, ...]
    norm_topk_prob: bool
    # image generation
    vae_downsample_factor: tuple[int, int]
    patch_size: int
    patch_embed_hidden_dim: int
    image_base_size: int
    cond_token_attn_type: str
    cond_image_type: str
    cfg_distilled: bool
    use_meanflow: bool
    model_version: str
    vae: dict[str, Any]
    vit: dict[str, Any]
    vit_processor: dict[str, Any]
    vit_aligner: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, compare=False)

    def shared_intermediate(self, layer: int) -> int:
        """The shared MLP is one expert-sized MLP per shared expert (official HunyuanMLP, is_shared_mlp)."""
        return self.moe_intermediate_size[layer] * self.num_shared_expert[layer]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        def need(key: str) -> Any:
            if key not in d:
                raise ConfigError(f"config.json: required key `{key}` is missing")
            return d[key]

        n_layers = int(need("num_hidden_layers"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        hidden = int(need("hidden_size"))
        head_dim = int(d.get("attention_head_dim") or d.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(f"config.json: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        if head_dim % 4:
            raise ConfigError(f"config.json: head_dim {head_dim} must be divisible by 4 for the 2D RoPE")
        _refuse_unsupported(d)
        cond_image_type, attn_type = d.get("cond_image_type", "vae_vit"), d.get("cond_token_attn_type", "full")
        down = d.get("vae_downsample_factor", [16, 16])
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=n_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            num_experts=_per_layer(need("num_experts"), n_layers, "num_experts"),
            moe_topk=_per_layer(need("moe_topk"), n_layers, "moe_topk"),
            moe_intermediate_size=_per_layer(
                d.get("moe_intermediate_size") or d.get("intermediate_size"), n_layers, "moe_intermediate_size"),
            num_shared_expert=_per_layer(d.get("num_shared_expert", 1) if d.get("use_mixed_mlp_moe") else 0,
                                         n_layers, "num_shared_expert"),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            vae_downsample_factor=(int(down[0]), int(down[1])),
            patch_size=int(d.get("patch_size", 1)),
            patch_embed_hidden_dim=int(d.get("patch_embed_hidden_dim", 1024)),
            image_base_size=int(d.get("image_base_size", 1024)),
            cond_token_attn_type=attn_type,
            cond_image_type=cond_image_type,
            cfg_distilled=bool(d.get("cfg_distilled", False)),
            use_meanflow=bool(d.get("use_meanflow", False)),
            model_version=str(d.get("model_version", "HunyuanImage-3.0-Instruct")),
            vae=d["vae"],
            vit=d["vit"],
            vit_processor=d["vit_processor"],
            vit_aligner=d["vit_aligner"],
            raw=d,
        )


@dataclass(frozen=True)
class GenerationConfig:
    do_sample: bool = True
    temperature: float = 0.6
    top_k: int = 1024
    top_p: float = 0.95
    max_new_tokens: int = 2048
    max_length: int = 22800
    diff_infer_steps: int = 50
    diff_guidance_scale: float = 5.0
    flow_shift: float = 3.0
    sequence_template: str = "instruct"
    use_system_prompt: str = "en_unified"
    bot_task: str = "think_recaption"
    drop_think: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any], distil: bool) -> "GenerationConfig":
        # Instruct falls back to 50 steps / g 5.0, Distil to 8 steps / g 2.5 where the file is silent.
        defaults = cls(diff_infer_steps=8, diff_guidance_scale=2.5) if distil else cls()
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__:
            if f in d and d[f] is not None:
                kw[f] = type(getattr(defaults, f))(d[f])
        out = cls(**{**defaults.__dict__, **kw})
        if out.sequence_template != "instruct":
            raise ConfigError(f"generation_config.json: sequence_template {out.sequence_template!r} is not supported "
                              "(this engine runs the Instruct and Instruct-Distil models: 'instruct')")
        return out


@dataclass(frozen=True)
class CheckpointConfig:
    """Everything read from a checkpoint folder's JSON files."""
    model: ModelConfig
    generation: GenerationConfig

    @classmethod
    def load(cls, folder: str | Path) -> "CheckpointConfig":
        folder = Path(folder)
        if not folder.is_dir():
            raise ConfigError(f"model folder {folder} does not exist")
        model = ModelConfig.from_dict(read_json(folder / "config.json"))
        gen_path = folder / "generation_config.json"
        gen_raw = read_json(gen_path) if gen_path.exists() else {}
        return cls(model=model, generation=GenerationConfig.from_dict(gen_raw, model.cfg_distilled))
