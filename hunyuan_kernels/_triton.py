"""Triton, when it can be imported (the CPU test machine has it too: its interpreter runs the kernels on
CPU tensors with TRITON_INTERPRET=1, set before this module is first imported)."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - Triton ships with CUDA torch builds
    triton = tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"

# the float dtypes every elementwise op here supports on CUDA
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def available() -> bool:
    return HAS_TRITON


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


if HAS_TRITON:
    @triton.jit
    def dot(a, b, acc, UPCAST: tl.constexpr):
        """tl.dot, with the operands taken to fp32 first under the interpreter (UPCAST): it multiplies bf16
        as raw integers otherwise."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, acc)


def round_bf16_in_interpreter() -> None:
    """Make Triton's CPU interpreter round fp32 -> bf16 (and fp32 -> float8 E4M3) to nearest even, as
    the GPU does (Triton 3.6's interpreter truncates), so interpreter runs can be compared with the reference at bf16 precision.
    For tests and dry runs only; a no-op unless TRITON_INTERPRET=1."""
    if not (HAS_TRITON and INTERPRET):
        return
    import numpy as np
    import triton.runtime.interpreter as ti
    real = ti._convert_float
    if getattr(real, "rounds_bf16", False):
        return

    def convert(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16).reshape(data.shape)
        if src == tl.float32 and dst == tl.float8e4nv:     # the interpreter's own cast is off by a binade
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy()).to(torch.float8_e4m3fn)
            return t.view(torch.uint8).numpy().reshape(data.shape)
        return real(data, src, dst, rounding)
    convert.rounds_bf16 = True
    ti._convert_float = convert


def shim_interpreter_scalars() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and converts them with int(), which
    numpy >= 2.4 refuses for 1-d arrays (a kernel loop over a runtime bound fails). Convert through the
    element instead; the kernels themselves are unchanged. For tests and dry runs only; a no-op unless
    TRITON_INTERPRET=1."""
    if not (HAS_TRITON and INTERPRET):
        return
    import triton.runtime.interpreter as ti
    if getattr(ti, "_scalar_shim", False):
        return
    orig = ti._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    ti._scalar_shim = True


def shim_interpreter_masks() -> None:
    """Triton 3.9's interpreter gives `block_mask & scalar_condition` an int32 handle (its binary op
    promotes the scalar's splat), and its load/store then refuse the mask ("mask has unsupported
    dtype"); the compiled kernel treats it as the i1 it is. Hand the interpreter's load/store a bool view
    of such masks. For tests and dry runs only; a no-op unless TRITON_INTERPRET=1."""
    if not (HAS_TRITON and INTERPRET):
        return
    import numpy as np
    import triton.runtime.interpreter as ti
    b = ti.InterpreterBuilder
    if getattr(b, "_mask_shim", False):
        return

    def as_bool(mask):
        if not (isinstance(mask, ti.TensorHandle) and isinstance(mask.data, np.ndarray)) or mask.data.dtype == np.bool_:
            return mask
        return ti.TensorHandle(mask.data.astype(np.bool_), tl.int1)

    load, store = b.create_masked_load, b.create_masked_store
    b.create_masked_load = lambda self, ptrs, mask, *a, **kw: load(self, ptrs, as_bool(mask), *a, **kw)
    b.create_masked_store = lambda self, ptrs, value, mask, *a, **kw: store(self, ptrs, value, as_bool(mask), *a, **kw)
    b._mask_shim = True


def prepare_interpreter() -> None:
    """Every fix above, for a test or dry run under TRITON_INTERPRET=1 (a no-op otherwise)."""
    round_bf16_in_interpreter()
    shim_interpreter_scalars()
    shim_interpreter_masks()
