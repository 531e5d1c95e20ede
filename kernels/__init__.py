"""Fused GPU ops, one module each, with the plain-PyTorch reference of each beside it (the CPU path).

`kernels.registry` picks the implementation per device type and dtype; the engine calls ops only
through it (`kernels.call("op", ...)`), so a backend is an entry there, never a patch of the engine.
This package imports nothing of `engine`.
"""
from .registry import allowed, call, chosen, ops  # noqa: F401
from . import conv  # noqa: F401,E402  conv3d_same (the VAE's 3D convs as 2D convs over frames)
from . import decode_attention  # noqa: F401,E402  decode_attention (GQA over a static cache's prefix)
from . import group_norm  # noqa: F401,E402  group_norm_swish
from . import moe  # noqa: F401,E402  moe (routed + shared MoE, deterministic fp32 finalize)
from . import moe_quant  # noqa: F401,E402  moe_quant (the moe op over quantized experts)
from . import norm  # noqa: F401,E402  rms_norm, add_rms_norm
from . import quant  # noqa: F401,E402  dequant_*, linear_* / grouped_mm_* on quantized weights, FP8
from . import rope  # noqa: F401,E402  rope_qk_norm, rope_qk_norm_cache
from . import sampling  # noqa: F401,E402  sample
