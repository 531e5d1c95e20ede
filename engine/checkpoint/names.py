"""The official checkpoint's tensor names, defined once: the backbone's ends, a decoder layer's tensors and
linears, the image-side module prefixes, and which resident pack each backbone linear is read into (the
role of nano-vllm's `packed_modules_mapping`). Every other module asks here instead of spelling a name.

A *layer* is a linear's name without its tensor suffix (`model.layers.0.self_attn.qkv_proj`, as in
engine/checkpoint/quant.py): stored in high precision its tensor is `{layer}.weight`, quantized it is a tensor set
(`.weight_packed`, `.weight_scale`, ...: engine/checkpoint/qtensors.py). A *pack* is one resident parameter of a
decoder layer (engine/model/packed.py), named after what it holds: qkv, o_proj and each shared-MLP linear
are their own pack; all experts of a layer share one pack per linear (`model.layers.0.mlp.experts.down_proj`).
"""
from __future__ import annotations

from dataclasses import dataclass

# The backbone's ends: the embedding table, the final norm and the LM head (a layer, split by vocabulary rows)
WTE = "model.wte.weight"
LN_F = "model.ln_f.weight"
LM_HEAD = "lm_head"
LAYERS = "model.layers."             # every decoder layer's names start so

# One decoder layer's names, relative to its prefix `model.layers.{i}.` (the official HunyuanDecoderLayer)
INPUT_LAYERNORM = "input_layernorm.weight"
POST_ATTENTION_LAYERNORM = "post_attention_layernorm.weight"
QKV_PROJ = "self_attn.qkv_proj"
O_PROJ = "self_attn.o_proj"
QUERY_LAYERNORM = "self_attn.query_layernorm.weight"
KEY_LAYERNORM = "self_attn.key_layernorm.weight"
ROUTER = "mlp.gate.wg.weight"        # fp32, never quantized
SHARED_MLP = "mlp.shared_mlp."
EXPERTS = "mlp.experts."
GATE_AND_UP_PROJ, DOWN_PROJ = "gate_and_up_proj", "down_proj"       # an MLP's two linears (expert or shared)
MLP_LINEARS = (GATE_AND_UP_PROJ, DOWN_PROJ)

# Image-side modules: each one's state_dict keys are the checkpoint names under its prefix
TIMESTEP_EMBEDDERS = ("timestep_emb", "time_embed", "time_embed_2")
GUIDANCE_EMB = "guidance_emb"        # Instruct-Distil (cfg_distilled)
TIMESTEP_R_EMB = "timestep_r_emb"    # meanflow
PATCH_EMBED, FINAL_LAYER = "patch_embed", "final_layer"
VAE, VISION_MODEL, VISION_ALIGNER = "vae", "vision_model", "vision_aligner"
VISION_HEAD = "vision_model.head."   # SigLIP2's pooling head: in the checkpoint, never used at inference

# Tensors the checkpoint holds that inference never uses: accepted and skipped.
SKIPPED_PREFIXES = (VISION_HEAD,)


def weight(layer: str) -> str:
    """A linear's tensor when it is stored in high precision."""
    return layer + ".weight"


@dataclass(frozen=True)
class LayerNames:
    """The checkpoint names of one decoder layer (`layer(i)`): tensors with their suffix, linears as layers."""
    prefix: str
    input_layernorm: str
    post_attention_layernorm: str
    qkv_proj: str
    o_proj: str
    query_layernorm: str
    key_layernorm: str
    router: str

    def shared(self, linear: str) -> str:
        """The shared MLP's `gate_and_up_proj` or `down_proj` (a layer)."""
        return self.prefix + SHARED_MLP + linear

    def expert(self, e: int, linear: str) -> str:
        """Expert e's `gate_and_up_proj` or `down_proj` (a layer)."""
        return f"{self.prefix}{EXPERTS}{e}.{linear}"

    def experts_pack(self, linear: str) -> str:
        """The pack that holds `linear` of every expert of this layer."""
        return self.prefix + EXPERTS + linear

    def packs(self, experts: int, shared: bool) -> dict[str, tuple[str, ...]]:
        """Resident pack -> the layers read into it, in pack order (expert e at index e)."""
        out = {self.qkv_proj: (self.qkv_proj,), self.o_proj: (self.o_proj,)}
        out |= {self.experts_pack(x): tuple(self.expert(e, x) for e in range(experts)) for x in MLP_LINEARS}
        if shared:
            out |= {self.shared(x): (self.shared(x),) for x in MLP_LINEARS}
        return out


def layer(i: int) -> LayerNames:
    p = f"{LAYERS}{i}."
    return LayerNames(p, p + INPUT_LAYERNORM, p + POST_ATTENTION_LAYERNORM, p + QKV_PROJ, p + O_PROJ,
                      p + QUERY_LAYERNORM, p + KEY_LAYERNORM, p + ROUTER)


def pack_of(layer: str) -> str | None:
    """The resident pack a backbone linear is read into (`model.layers.3.mlp.experts.7.down_proj` ->
    `model.layers.3.mlp.experts.down_proj`; qkv, o_proj and the shared MLP's linears are their own pack);
    None for any other layer (kept replicated: router, embeddings, LM head, norms, image side)."""
    if not layer.startswith(LAYERS):
        return None
    i, _, rest = layer[len(LAYERS):].partition(".")
    if not i.isdigit():
        return None
    if rest in (QKV_PROJ, O_PROJ) or rest in {SHARED_MLP + x for x in MLP_LINEARS}:
        return layer
    e, _, linear = rest.removeprefix(EXPERTS).partition(".")
    if rest.startswith(EXPERTS) and e.isdigit() and linear in MLP_LINEARS:
        return f"{LAYERS}{i}.{EXPERTS}{linear}"
    return None
