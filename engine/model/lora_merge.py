"""The merged fast path of a LoRA adapter: strength * scale * B A folded into the base weights at load.

When an engine serves one adapter and only it (`--lora NAME=PATH --lora-merged`), nothing needs the base
weights any more, so each adapted linear becomes W + strength * scale * B A once and every step is the
base forward (no adapter tables, no per-row product: it costs nothing extra). Each rank folds only its
slices, by the rules its base weights follow (engine/model/peft.py `_slice`): qkv_proj and the MLPs'
gate_and_up_proj are column-parallel (B's rows of the rank's micros, packed like the qkv and gate/up
packs), o_proj and down_proj row-parallel (A's input columns of the rank's micros, side by side like
their packs). Besides the attention projections (all the unmerged path adapts), this path also takes
the MLPs: the shared MLP and every expert (engine/model/moe.py packs). The sum is formed in fp32 and
rounded once to the weights' dtype.

Quantized resident weights (codes and block scales kept as stored, the CUDA layout of the quantized
checkpoints) are refused: W + B A is not in the codes' grid, and re-quantizing it would change the
base weights beyond the adapter. Such an engine serves the adapter unmerged (exact: the product is added
to the quantized projection's output, and for the MLPs inside the quantized experts, `--lora-mlp`). A quantized checkpoint dequantized at load (the CPU, or
`resident="dense"`) holds float weights and merges like any other.
"""
from __future__ import annotations

import torch

from engine.model.packed import QuantPack
from engine.model.peft import AdapterError, PeftAdapter, sliced
from engine.parallel.layout import ShardLayout
from engine.checkpoint import names
from engine.checkpoint.names import DOWN_PROJ, GATE_AND_UP_PROJ


def _targets(model):
    """(checkpoint layer name, resident pack, index of the layer's weight in the pack) of every linear an
    adapter may adapt."""
    for i, layer in enumerate(model.transformer.layers):
        n, attn, mlp = names.layer(i), layer.self_attn, layer.mlp
        yield n.qkv_proj, attn.qkv, ()
        yield n.o_proj, attn.o_proj, ()
        if mlp.shared_w1 is not None:
            yield n.shared(GATE_AND_UP_PROJ), mlp.shared_w1, ()
            yield n.shared(DOWN_PROJ), mlp.shared_w2, ()
        for e in range(mlp.experts):
            yield n.expert(e, GATE_AND_UP_PROJ), mlp.w1, (slice(None), e)
            yield n.expert(e, DOWN_PROJ), mlp.w2, (e,)


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
    for module, pack, index in _targets(model):
        if (w := adapter.layers.get(module)) is None:
            continue
        if isinstance(pack, QuantPack):
            raise AdapterError(
                f"cannot merge LoRA adapter {adapter.folder}: {module} is kept quantized "
                f"({pack.format.fmt}), and W + BA is not in its codes' grid; serve the adapter unmerged "
                "(without --lora-merged; --lora-mlp for an adapter of the MLPs)")
        work.append((pack[index], w))
    for param, w in work:
        # [out, in] of this rank: rows-packed [micros * rows, H] (viewed as the pack), cols-packed [H, micros * cols]
        delta = (w.b.to(param.device, torch.float32) * (w.scale * strength)) @ w.a.to(param.device, torch.float32)
        param.copy_((param.float() + delta.view(param.shape)).to(param.dtype))
    model.merged_lora, model.merged_strength = name or adapter.folder.name, strength
