"""Which kernels multiply the resident quantized experts, chosen once at load (`--moe-kernels`), and their
packs laid out for them then (hunyuan_kernels/quant/humming.py `lay_out`): nothing is converted per step,
and the memory stays what the codes and scales take (the laid-out codes replace the plain ones).

    triton        the plain packs, on our Triton kernels (decode GEMVs, the batched and grouped paths)
    humming       humming-kernels' W4A16 grouped GEMMs (bf16 activations: the reference's numbers within
                  bf16 rounding), MXFP4 experts on Hopper (NVFP4, MXFP8 and FP8 experts too: W4A16 / W8A16,
                  GPU-tested, not timed yet, so only when named)
    humming-fp8   its W4A8 GEMMs: activations quantized per row to FP8 E4M3, the E8M0 block scales folded
                  per expert (blocks more than 11 binades below their expert's largest are rounded); NVFP4 / MXFP8
                  / FP8 experts: W4A8 / W8A8 on their block or channel scales
    auto          humming-fp8 where humming can take every expert pack and they are MXFP4 (installed, a
                  Hopper GPU, packs of its tile sizes, no LoRA tables of the MLPs), else triton. W4A8 rather than
                  W4A16: faster in every phase on one H200 (docs/benchmarks.md, humming) and, scored on the
                  embedded model quantized by auto-round with W4A8's numbers (`train.evaluate --fp8-activations`),
                  as accurate (auto-round's MX schemes declare FP8 activations too); `humming` keeps bf16
                  activations

A laid-out pack runs only on its family's variant of the `moe_quant` op: LoRA adapters of the MLPs
(`moe_lora`, which reads the plain codes) need `triton`.

Which kernels multiply the MXFP8 weights (the mixed builds' attention and shared MLP; every linear of an MXFP8
build), chosen after the experts' (`--mxfp8-kernels`):

    triton        weight-only (bf16 activations): the decode GEMVs, and for 256 rows or more the weight
                  dequantized once a call into a bf16 GEMM
    fp8           folded at load into FP8 per output channel (formats.fold_mx: a row's scale its largest
                  block scale, the other blocks' codes rescaled, exact but for codes under E4M3's normal
                  range) and multiplied as the FP8 builds' weights are: W8A8, the activations quantized per
                  token (cuBLAS's FP8 GEMMs; a few tokens on the decode GEMV); no dequantize pass in the DiT step
    auto          fp8 where the experts run humming-fp8 (FP8 activations chosen already), else triton
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:        # the choices are read by the command lines, which import no torch: the rest imports lazily
    from torch import nn

    from engine.model.moe import MoE
    from engine.model.packed import QuantPack

MOE_KERNELS = ("auto", "triton", "humming", "humming-fp8")
AUTO_FORMATS = ("mxfp4",)     # the expert formats `auto` lays out for humming: the ones measured faster there
MXFP8_KERNELS = ("auto", "triton", "fp8")


def _mxfp8_packs(model: "nn.Module") -> "list[QuantPack]":
    from engine.model.packed import QuantPack
    return [m for m in model.modules() if isinstance(m, QuantPack) and m.format.fmt == "mxfp8" and m.layout is None]


def _quantized_moes(model: "nn.Module") -> "list[MoE]":
    from engine.model.moe import MoE
    from engine.model.packed import QuantPack
    return [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.w1, QuantPack)]


def why_not_humming(moes: "list[MoE]", lora_mlp: bool, activations: str = "fp8") -> str | None:
    """Why humming cannot take these experts with these activations (a sentence), or None."""
    from hunyuan_kernels.quant import humming
    if not humming.available():
        got = humming.installed()
        return ("humming-kernels 0.1.19 is not installed (pip install '.[humming]')" if got is None
                else "humming's kernels run on a Hopper GPU (SM 9.0) here")
    if lora_mlp:
        return "LoRA adapters of the MLPs (--lora-mlp) read the plain expert packs"
    for m in moes:
        for w in (m.w1.value(), m.w2.value()):
            why = humming.fits_pack(w, activations)
            if why:
                return why
    return None


def lay_out_experts(model: "nn.Module", choice: str = "auto", lora_mlp: bool = False,
                    notes: list[str] | None = None) -> str:
    """Lay out every quantized expert pack of `model` for the kernels `choice` names (see the module's
    docstring) and return the kernels its experts run on: "triton", "humming" or "humming-fp8". A named
    choice that cannot be served is refused (ValueError saying why); "auto" then keeps triton. Under "auto",
    humming failing on the first layer's packs (its kernels compile there: no nvcc / NVRTC, a CUDA it does
    not know) keeps triton too, before any pack changed, and says why in `notes` (the start-up log)."""
    if choice not in MOE_KERNELS:
        raise ValueError(f"--moe-kernels {choice!r}: one of {', '.join(MOE_KERNELS)}")
    moes = _quantized_moes(model)
    if choice == "triton" or (choice == "auto" and not moes):
        return "triton"
    if not moes:
        raise ValueError(f"--moe-kernels {choice}: this model keeps no quantized experts on the device (humming "
                         "multiplies MXFP4 experts as a CUDA bf16 engine keeps them)")
    if choice == "auto" and not _auto_formats(moes):
        return "triton"
    activations = "bf16" if choice == "humming" else "fp8"           # auto: W4A8 (the module's docstring)
    why = why_not_humming(moes, lora_mlp, activations)
    if why:
        if choice == "auto":
            return "triton"
        raise ValueError(f"--moe-kernels {choice}: {why}")
    from hunyuan_kernels.quant import humming
    for i, m in enumerate(moes):
        try:
            w1 = humming.lay_out(m.w1.value(), activations)
            w2 = humming.lay_out(m.w2.value(), activations, micros=m.micros)
        except Exception as e:  # noqa: BLE001 - auto's probe: any failure of the first layout keeps ours
            if choice != "auto" or i:
                raise
            if notes is not None:
                notes.append(f"humming could not lay out the experts ({type(e).__name__}: {e}); they run on triton")
            return "triton"
        m.w1.take_layout(w1)
        m.w2.take_layout(w2)
    return "humming-fp8" if activations == "fp8" else "humming"


def fold_mxfp8_weights(model: "nn.Module", choice: str = "auto", moe_kernels: str = "triton") -> str:
    """Fold every MXFP8 pack of `model` into FP8 per output channel when `choice` (see the module's docstring;
    `moe_kernels`: what `lay_out_experts` returned) says so, and return what its MXFP8 weights run on:
    "triton" or "fp8" ("triton" too when it keeps none). A named "fp8" that cannot be served is refused
    (ValueError saying why); "auto" then keeps triton."""
    if choice not in MXFP8_KERNELS:
        raise ValueError(f"--mxfp8-kernels {choice!r}: one of {', '.join(MXFP8_KERNELS)}")
    packs = _mxfp8_packs(model)
    if choice == "triton" or (choice == "auto" and (moe_kernels != "humming-fp8" or not packs)):
        return "triton"
    if not packs:
        raise ValueError("--mxfp8-kernels fp8: this model keeps no MXFP8 weights on the device (the MXFP8 and "
                         "mixed MXFP4 builds on a CUDA engine keep them)")
    import torch
    dev = packs[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        if choice == "auto":
            return "triton"
        raise ValueError("--mxfp8-kernels fp8: W8A8 needs FP8 tensor cores (compute capability 8.9 or newer), "
                         f"and {torch.cuda.get_device_name(dev)} has none")
    for p in packs:
        p.fold_to_fp8()
    return "fp8"


def fold_all_to_fp8(model: "nn.Module") -> int:
    """Fold every plain MX pack of `model` (MXFP8 and MXFP4, the experts too) into FP8 per output channel, so
    every quantized GEMM runs W8A8 with its activations quantized per token: on the CPU's reference ops, the
    numbers `--moe-kernels humming-fp8 --mxfp8-kernels fp8` compute on a Hopper GPU, up to the folds' rounding
    (per row here, per expert in humming: formats.fold_rounded and humming.clamped_share count each) and the
    sum order. How `train.evaluate --fp8-activations` scores FP8 activations on a model humming cannot take
    (the embedded model's tiny shapes) or without a GPU. An MXFP4 pack's codes take twice the bytes after:
    an evaluation's layout, never a serving one. Returns the number of packs folded."""
    from engine.model.packed import QuantPack
    packs = [m for m in model.modules()
             if isinstance(m, QuantPack) and m.format.fmt in ("mxfp8", "mxfp4") and m.layout is None]
    for p in packs:
        p.fold_to_fp8()
    return len(packs)


ACTIVATIONS = {"humming": "W4A16", "humming-fp8": "W4A8", "fp8": "W8A8"}


def kernels_text(moe_kernels: str | None, mxfp8_kernels: str | None) -> str:
    """The chosen kernels in words, e.g. "experts on humming-fp8 (W4A8)" ("" when everything runs on ours)."""
    chosen = (("experts", moe_kernels), ("MXFP8 weights", mxfp8_kernels))
    return ", ".join(f"{what} on {k} ({ACTIVATIONS[k]})" for what, k in chosen if k in ACTIVATIONS)


def _auto_formats(moes: "list[MoE]") -> bool:
    """Whether every expert pack is in a format `auto` lays out for humming (AUTO_FORMATS)."""
    return all(m.w1.format.fmt in AUTO_FORMATS for m in moes)


def humming_hint(model: "nn.Module", capability: tuple[int, int] | None) -> str | None:
    """A sentence for the start-up log where `auto` kept triton only because humming-kernels is not installed
    (a Hopper GPU, `capability`; MXFP4 experts it could take), else None: the faster path is one pip away."""
    from hunyuan_kernels.quant import humming
    moes = _quantized_moes(model)
    if capability != (9, 0) or not moes or humming.installed() is not None or not _auto_formats(moes):
        return None
    if any(humming.fits_pack(w, "fp8") for m in moes for w in (m.w1.value(), m.w2.value())):
        return None
    return ("humming-kernels is not installed: `pip install '.[humming]'` runs these MXFP4 experts on its W4A8 "
            "GEMMs, faster in every phase on an H200 (docs/benchmarks.md, humming)")
