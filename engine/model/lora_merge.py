"""The merged fast path of a LoRA adapter: strength * scale * B A folded into the base weights at load.

When an engine serves one adapter and only it (`--lora NAME=PATH --lora-merged`), nothing needs the base
weights any more, so each adapted linear becomes W + strength * scale * B A once and every step is the
base forward (no adapter tables, no per-row product: it costs nothing extra). Each rank folds only its
slices, by the rules its base weights follow (engine/model/lora.py): qkv_proj is column-parallel (B's
rows of the rank's micros, packed [micros, rows, H] like the qkv pack), o_proj row-parallel (A's input
columns of the rank's micros, side by side like the o_proj pack). The sum is formed in fp32 and rounded
once to the weights' dtype.

Quantized resident weights (codes and block scales kept as stored, the CUDA layout of the quantized
checkpoints) are refused: W + B A is not in the codes' grid, and re-quantizing it would change the
base weights beyond the adapter. Such an engine serves the adapter unmerged (exact: the product is added
to the quantized projection's output). A quantized checkpoint dequantized at load (the CPU, or
`resident="dense"`) holds float weights and merges like any other.
"""
from __future__ import annotations

import torch

from engine.model.packed import QuantPack
from engine.model.peft import AdapterError, PeftAdapter, sliced
from engine.parallel.layout import ShardLayout
from engine.spec import names


@torch.no_grad()
def merge_adapter(model, adapter: PeftAdapter, strength: float = 1.0, name: str | None = None) -> None:
    """Fold `adapter` (read for this rank's layout, or whole: cut here) at `strength` into the resident
    qkv_proj / o_proj of `model` (a HunyuanImage3), which then serves it as `name` (`model.merged_lora`:
    what a request must name, at lora_scale `strength`). AdapterError, before any weight changes, when a weight it adapts is kept
    quantized, the adapter was read for another rank, or the model already serves adapters."""
    if model.lora is not None or model.merged_lora is not None:
        raise AdapterError(f"cannot merge LoRA adapter {adapter.folder}: the model already serves "
                           f"{'adapter tables' if model.lora is not None else repr(model.merged_lora)}")
    if adapter.layout == ShardLayout() != model.layout:
        adapter = sliced(adapter, model.layout)
    if adapter.layout != model.layout:
        raise AdapterError(f"LoRA adapter {adapter.folder} was read for {adapter.layout}, not this rank's "
                           f"{model.layout}")
    work = []
    for i, layer in enumerate(model.transformer.layers):
        n, attn = names.layer(i), layer.self_attn
        for module, param in ((n.qkv_proj, attn.qkv), (n.o_proj, attn.o_proj)):
            if (w := adapter.layers.get(module)) is None:
                continue
            if isinstance(param, QuantPack):
                raise AdapterError(
                    f"cannot merge LoRA adapter {adapter.folder}: {module} is kept quantized "
                    f"({param.format.fmt}), and W + BA is not in its codes' grid; serve the adapter unmerged "
                    "(without --lora-merged)")
            work.append((param, w))
    for param, w in work:
        # [out, in] of this rank: qkv's rows [micros * rows, H] (viewed as the pack), o_proj's [H, micros * cols]
        delta = (w.b.to(param.device, torch.float32) * (w.scale * strength)) @ w.a.to(param.device, torch.float32)
        param.copy_((param.float() + delta.view(param.shape)).to(param.dtype))
    model.merged_lora, model.merged_strength = name or adapter.folder.name, strength
