"""The checkpoint plan of the model: every tensor the official checkpoint holds (name -> shape, derived
from the config alone), and the load that validates a folder against it and reads each rank's slices
straight into the resident buffers (each module reads its own packed slices: engine/model/packed.py).
Validation runs before any tensor is read, so a mismatched folder never half-loads.

Quantized checkpoints: the backbone linears (qkv, o_proj, shared MLP, experts) may be stored in any
format of engine/checkpoint/quant.py; each one's tensor set is found from the tensors themselves, compared with
what `quantization_config` declares (the tensors win, with a warning naming the layer), checked
against the plan's K splits, and validated with everything else before the first read. Everything
else (router, embeddings, heads, norms, image-side modules) must be stored in high precision.
`resident_packs` says which packs may stay quantized on the device (the loader keeps them so on CUDA);
`quantize="fp8"` makes FP8 weights from a high-precision checkpoint as it is read (online FP8)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from engine.model.hunyuan import HunyuanImage3, image_side_modules
from engine.model.packed import PackFormat, check_col_split
from engine.parallel.layout import ShardLayout
from engine.checkpoint import names
from engine.checkpoint.shards import FLOAT_DTYPES, Checkpoint, CheckpointError, TensorSpec
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.names import SKIPPED_PREFIXES
from engine.checkpoint.qtensors import TensorSet, detect, group_by_layer
from engine.checkpoint.quant import QuantScheme, UnsupportedFormat, WeightFormat
from engine.checkpoint.shapes import backbone_linears

Progress = Callable[[int, int, str], None]


def _backbone_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The backbone's tensors as stored in high precision: the norms and routers, then every linear's weight
    (its shape from `backbone_linears`, the one table of the linears)."""
    H, D = cfg.hidden_size, cfg.head_dim
    out: dict[str, tuple[int, ...]] = {names.WTE: (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        n = names.layer(i)
        out |= {n.input_layernorm: (H,), n.post_attention_layernorm: (H,), n.query_layernorm: (D,),
                n.key_layernorm: (D,), n.router: (cfg.num_experts[i], H)}
    out |= {names.weight(layer): (rows, cols) for layer, (rows, cols, _) in backbone_linears(cfg).items()}
    out |= {names.LN_F: (H,), names.weight(names.LM_HEAD): (cfg.vocab_size, H)}
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
    p = names.VISION_HEAD
    return {p + "probe": (1, 1, h), p + "attention.in_proj_weight": (3 * h, h), p + "attention.in_proj_bias": (3 * h,),
            p + "attention.out_proj.weight": (h, h), p + "attention.out_proj.bias": (h,),
            p + "layernorm.weight": (h,), p + "layernorm.bias": (h,),
            p + "mlp.fc1.weight": (f, h), p + "mlp.fc1.bias": (f,), p + "mlp.fc2.weight": (h, f), p + "mlp.fc2.bias": (h,)}


class FormatMismatchWarning(UserWarning):
    """quantization_config declares a layer in one format and its tensors are in another (they win)."""


def _first_quantized(ckpt: Checkpoint, layers) -> str:
    """The first backbone linear not stored as a plain float weight (else the first one)."""
    by_layer = group_by_layer(ckpt.tensors)
    for layer in layers:
        found = by_layer.get(layer, {})
        if set(found) != {"weight"} or found["weight"].dtype not in FLOAT_DTYPES:
            return layer
    return next(iter(layers))


ONLINE_FORMATS = ("fp8",)


def plan_checkpoint(cfg: ModelConfig, ckpt: Checkpoint, layout: ShardLayout = ShardLayout(),
                    scheme: QuantScheme | None = None, quantize: str | None = None
                    ) -> tuple[dict[str, TensorSpec], dict[str, TensorSet]]:
    """What the folder must hold (name -> spec) and the tensor set of every backbone linear, or a
    CheckpointError naming the layer; reads no tensor. `quantize` ("fp8"): the load quantizes the
    backbone linears itself, which needs them stored in high precision."""
    if quantize is not None and quantize not in ONLINE_FORMATS:
        raise ValueError(f"unknown quantize {quantize!r} (supported: {', '.join(ONLINE_FORMATS)})")
    scheme = scheme or QuantScheme.from_config(cfg.raw, ckpt.folder)
    linears = backbone_linears(cfg)
    if scheme.unsupported:
        raise CheckpointError(f"checkpoint {ckpt.folder} is quantized with {scheme.unsupported}, which this engine "
                              f"does not load (first quantized layer: {_first_quantized(ckpt, linears)})")
    shapes = checkpoint_shapes(cfg)
    expected: dict[str, TensorSpec | tuple[int, ...]] = dict(shapes)
    by_layer = group_by_layer(ckpt.tensors)
    formats: dict[str, TensorSet] = {}
    mismatches: list[str] = []
    for layer, (n, k, k_split) in linears.items():
        ts = detect(layer, by_layer.get(layer, {})) or TensorSet(layer, WeightFormat.BF16)
        try:
            declared = scheme.declared(layer)
        except UnsupportedFormat as e:
            raise CheckpointError(f"checkpoint {ckpt.folder}: {e} is not a format this engine loads "
                                  f"(first such layer: {layer})") from None
        if declared is not ts.format:
            mismatches.append(f"{layer}: quantization_config says {declared.value}, its tensors are "
                              f"{ts.format.value}; loading it as {ts.format.value}")
        f = ts.format
        if quantize and f.quantized:
            raise CheckpointError(f"--quantize {quantize} quantizes a high-precision checkpoint at load, but "
                                  f"{ckpt.folder} is already quantized ({layer} is stored as {f.value}): load it as it "
                                  "is, without --quantize")
        if f.block and k % f.block:
            raise CheckpointError(f"{layer} is stored as {f.value} but its K ({k}) is not a multiple of the "
                                  f"{f.block}-element block")
        if k_split:
            check_col_split(layer, k, f, layout, k_split)
        del expected[names.weight(layer)]
        expected |= ts.specs(n, k)
        if f.quantized:
            formats[layer] = ts
    mismatches += _check_high_precision(shapes, linears, by_layer, scheme)
    for m in mismatches[:8]:
        warnings.warn(m, FormatMismatchWarning, stacklevel=3)
    if len(mismatches) > 8:
        warnings.warn(f"... and {len(mismatches) - 8} more layers whose tensors are not in the format "
                      "quantization_config declares", FormatMismatchWarning, stacklevel=3)
    return expected, formats


def _check_high_precision(shapes: dict[str, tuple[int, ...]], linears: dict, by_layer: dict,
                          scheme: QuantScheme) -> list[str]:
    """Every tensor other than the backbone linears must be stored in high precision (CheckpointError
    naming the first that is not); returns the layers quantization_config declares quantized anyway."""
    mismatches = []
    for name, shape in shapes.items():
        layer = name.rpartition(".")[0]
        if layer in linears or not name.endswith(".weight"):
            continue
        found = by_layer.get(layer, {})
        ts = None
        try:
            ts = detect(layer, found)
        except CheckpointError:
            pass
        quantized = (ts is not None and ts.format.quantized) or set(found) - {"weight", "bias"}
        if quantized:
            raise CheckpointError(
                f"{layer} is stored quantized ({', '.join(sorted(found))}), but this engine keeps it in high "
                "precision (router, embeddings, LM head, norms, ViT, VAE, embedders, patch_embed, final_layer): "
                "quantize the checkpoint with this layer ignored")
        if len(shape) == 2:
            try:
                declared = scheme.declared(layer)
            except UnsupportedFormat:
                declared = WeightFormat.BF16
            if declared.quantized:
                mismatches.append(f"{layer}: quantization_config says {declared.value}, its tensors are "
                                  "high precision; loading it as it is stored")
    return mismatches


def resident_packs(cfg: ModelConfig, formats: dict[str, TensorSet], quantize: str | None = None
                   ) -> dict[str, PackFormat]:
    """The backbone packs that can stay quantized on the device (pack name -> format): qkv, o_proj and
    the shared MLP's two linears per layer, and `mlp.experts.gate_and_up_proj` / `.down_proj` for all
    experts of a layer together, which need every expert in one format. A layer's MoE packs stay
    quantized only when both expert packs do (the quantized MoE op takes quantized experts); anything
    else is dequantized at load. With `quantize` every backbone linear is quantized by the load."""
    def fmt(layer: str) -> PackFormat | None:
        if quantize:
            return PackFormat(quantize)
        ts = formats.get(layer)
        return PackFormat.of(ts.format, ts.global_inverse) if ts is not None and ts.format.quantized else None

    out: dict[str, PackFormat] = {}
    for i in range(cfg.num_layers):
        n = names.layer(i)
        kept = {}
        for pack, layers in n.packs(cfg.num_experts[i], bool(cfg.shared_intermediate(i))).items():
            found = {fmt(layer) for layer in layers}      # a pack has one format: all its layers in it
            if len(found) == 1 and None not in found:
                kept[pack] = found.pop()
        if any(n.experts_pack(x) not in kept for x in names.MLP_LINEARS):
            # the quantized MoE op takes both expert packs quantized: else the layer's MoE is all float
            kept = {pack: f for pack, f in kept.items() if pack in (n.qkv_proj, n.o_proj)}
        out |= kept
    return out


def load_weights(model: HunyuanImage3, ckpt: Checkpoint, progress: Progress | None = None,
                 quantize: str | None = None,
                 plan: tuple[dict[str, TensorSpec], dict[str, TensorSet]] | None = None) -> None:
    """Plan and validate the checkpoint against the config (or take the `plan` made before the model was
    built), then read this rank's slices into the model; `quantize` ("fp8"): the backbone linears are
    quantized as they are read (FP8 per output channel of this shard's slice)."""
    expected, formats = plan or plan_checkpoint(model.cfg, ckpt, model.layout, quantize=quantize)
    ckpt.validate(expected, skipped=[n for n in ckpt.tensors if n.startswith(SKIPPED_PREFIXES)])
    ckpt.formats = formats
    ckpt.online = frozenset(backbone_linears(model.cfg)) if quantize else frozenset()
    listed, done = list(expected), 0
    tr = model.transformer
    with torch.no_grad():
        tr.load_ends(ckpt, model.layout)
        for i, layer in enumerate(tr.layers):
            n = names.layer(i)
            layer.load(ckpt, n, model.layout)
            done += sum(1 for name in listed if name.startswith(n.prefix))
            if progress:
                progress(done, len(listed), f"layer {i + 1}/{model.cfg.num_layers}")
        for prefix, mod in model.replicated_modules().items():
            for key, t in mod.state_dict().items():
                t.copy_(ckpt.read(f"{prefix}.{key}"))
                done += 1
            if progress:
                progress(done, len(listed), prefix)
