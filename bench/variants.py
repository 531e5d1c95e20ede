"""Running one variant of a kernel op by name, as the suites compare them.

On CUDA through the registry: within `kernels.allowed(name)` the op is called and `kernels.chosen` must
name the variant afterwards, so a row is the variant the engine would run for these arguments (its
`fits` took them), never a silent fall-back to the reference. In a --dry run (CPU, Triton's interpreter)
the registry serves the reference only, since the fast variants are CUDA's; there the variant's own
function runs, so the dry run still executes the kernels the suite times on the GPU. `runner` gives the
call to time (see there for what it includes).
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.registry import REFERENCE

# (op, variant) -> "module:function", for the --dry runs
_FUNCTIONS = {
    ("rms_norm", "triton"): "hunyuan_kernels.norm:rms_norm_triton",
    ("add_rms_norm", "triton"): "hunyuan_kernels.norm:add_rms_norm_triton",
    ("rope_qk_norm", "triton"): "hunyuan_kernels.rope:rope_qk_norm_triton",
    ("rope_qk_norm_cache", "triton"): "hunyuan_kernels.rope:rope_qk_norm_cache_triton",
    ("sample", "triton"): "hunyuan_kernels.sampling:sample_triton",
    ("sample", "triton_torch_topk"): "hunyuan_kernels.sampling:sample_triton_torch_topk",
    ("decode_attention", "triton"): "hunyuan_kernels.decode_attention:decode_attention_triton",
    **{(op, "flashinfer"): f"hunyuan_kernels.{module}:{op}_flashinfer" for op, module in (
        ("rms_norm", "norm"), ("add_rms_norm", "norm"), ("sample", "sampling"), ("decode_attention", "decode_attention"))},
    ("conv3d_same", "taps2d"): "hunyuan_kernels.vae.conv:conv3d_same_taps",
    ("group_norm_swish", "triton"): "hunyuan_kernels.vae.group_norm:group_norm_swish_triton",
    ("moe", "decode"): "hunyuan_kernels.moe.cuda:moe_decode",
    ("moe", "fused"): "hunyuan_kernels.moe.cuda:moe_fused",
    ("moe", "grouped"): "hunyuan_kernels.moe.cuda:moe_grouped",
    ("moe", "two_dispatch"): "bench.ablations:two_dispatch",
    ("moe_quant", "decode"): "hunyuan_kernels.quant.moe_cuda:moe_quant_decode",
    ("moe_quant", "grouped"): "hunyuan_kernels.quant.moe_cuda:moe_quant_grouped",
    ("linear_fp8", "scaled_mm"): "hunyuan_kernels.quant.cuda:linear_fp8_cuda",
    ("grouped_mm_fp8", "scaled_mm"): "hunyuan_kernels.quant.cuda:grouped_mm_fp8_cuda",
    **{(f"linear_{f}", v): f"hunyuan_kernels.quant.cuda:linear_{f}_{v}"
       for f in ("mxfp8", "mxfp4", "nvfp4") for v in ("gemv", "triton")},
    **{(f"grouped_mm_{f}", "triton"): f"hunyuan_kernels.quant.cuda:grouped_mm_{f}_triton"
       for f in ("mxfp8", "mxfp4", "nvfp4")},
}


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


def function(op: str, name: str) -> Callable[..., Any]:
    """The variant's own function (what a --dry run calls)."""
    if name not in kernels.ops().get(op, ()):
        raise KeyError(f"kernel op {op!r} has no variant {name!r} (registered: {kernels.ops().get(op)})")
    module, fn = _FUNCTIONS[(op, name)].split(":")
    return getattr(importlib.import_module(module), fn)


def _on_cpu(name: str, args: tuple, kwargs: dict) -> bool:
    """A --dry run's fast variant: its own function runs (the registry would serve the reference)."""
    return name != REFERENCE and _first_tensor(args, kwargs).device.type != "cuda"


def run(op: str, name: str, *args, **kwargs):
    """`op` on these arguments by the variant `name` ("torch": the reference), checked to be what ran."""
    if _on_cpu(name, args, kwargs):
        return function(op, name)(*args, **kwargs)
    with kernels.allowed(*(() if name == REFERENCE else (name,))):
        out = kernels.call(op, *args, **kwargs)
    if kernels.chosen(op) != name:
        raise RuntimeError(f"{op}: variant {name!r} asked for, {kernels.chosen(op)!r} ran (its fits refused "
                           f"these arguments)")
    return out


def runner(op: str, name: str, *args, direct: bool = False, **kwargs) -> Callable[[], Any]:
    """`run` as a call without arguments, to be timed; on CUDA run once here, checked to be what runs when
    `name` is selected. Where the registry picks `name` for these arguments by itself the call is the
    engine's own `kernels.call`, its dispatch included; otherwise, and with `direct`, it is the variant's
    own function (a selection around every call would add host time that a small op's eager timing
    shows; `direct` times two variants alike)."""
    if name == REFERENCE:
        run(op, name, *args, **kwargs)
        return lambda: run(op, name, *args, **kwargs)
    if not _on_cpu(name, args, kwargs):
        if not direct:
            kernels.call(op, *args, **kwargs)
            if kernels.chosen(op) == name:
                return lambda: kernels.call(op, *args, **kwargs)
        run(op, name, *args, **kwargs)
    fn = function(op, name)
    return lambda: fn(*args, **kwargs)


def first(op: str, device: str, dtype: torch.dtype) -> str:
    """The variant a call of `op` on this device and dtype tries first (before any `fits`)."""
    return kernels.registry.candidates(op, device, dtype)[0].backend
