"""Fused GPU ops, each with its plain-PyTorch reference beside it (the CPU path).

`hunyuan_kernels.registry` picks the implementation per device type, dtype and the arguments' shapes;
the engine calls ops only through it (`kernels.call("op", ...)`), so a backend is an entry there, never a
patch of the engine. This package imports nothing of `engine`.

Its users import it as `import hunyuan_kernels as kernels`. It is not named `kernels` because the PyPI
distribution `kernels` (Hugging Face's hub kernels, required by transformers >= 5.25) installs a
top-level package of that name.

    registry.py          ops, their variants, `call`, `chosen`, `allowed`
    _triton.py           Triton where it imports (CPU builds of torch have none), interpreter fixes
    _flashinfer.py       FlashInfer where it imports (the `flashinfer` extra), for the variants named `flashinfer`
    scratch.py           scratch buffers (NaN-poisoned in tests)
    norm.py              rms_norm, add_rms_norm
    rope.py              rope_qk_norm, rope_qk_norm_cache
    decode_attention.py  decode_attention (GQA over a static cache's valid prefix)
    sampling.py          sample, sample_rows
    lora.py              lora_add (a projection's output plus each row's LoRA update)
    moe/                 moe (routed + shared MoE)
    quant/               quantized weights: dequant_*, linear_*, grouped_mm_*, FP8, moe_quant; moe_lora (either packs)
    vae/                 conv3d_same, group_norm_swish
"""
from .registry import allowed, call, chosen, ops  # noqa: F401
from . import decode_attention, lora, moe, norm, quant, rope, sampling, vae  # noqa: F401,E402  (register the ops)
