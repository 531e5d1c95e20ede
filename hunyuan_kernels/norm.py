"""RMSNorm and the residual add fused with the next norm.

Semantics are the engine's `RMSNorm` (the official HunyuanRMSNorm): the row is normalised in fp32,
cast back to the input dtype, and only then multiplied by the weight (a product rounded to the
promoted dtype of weight and input, as `weight * y` rounds it). `add_rms_norm` first rounds the sum
`x + residual` to the dtype, as the decoder layer's `x = x + attn` does, so the normed values and the
carried residual stream are the same numbers as today's two separate ops.
"""
from __future__ import annotations

import torch

from . import _flashinfer
from ._triton import FLOATS, HAS_TRITON, available, next_pow2, tl, triton
from .registry import backend, reference

MAX_TRITON_WIDTH = 65536   # one row per program, the whole row in registers; wider rows use the reference


@reference("rms_norm")
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@reference("add_rms_norm")
def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


if HAS_TRITON:
    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr, N, stride_x, stride_res, stride_y, stride_sum,
                         eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            # the sum is rounded to the storage dtype before the norm reads it (as `x + residual` is)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        y = (xf * rstd).to(x.dtype)          # back to the input dtype, then the weight multiply
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * y.to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [rows, N] with unit column stride (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    N = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    w = weight.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    y2, s2 = y.view(-1, N), s.view(-1, N)
    rows = x2.shape[0]
    if rows:
        block = next_pow2(N)
        _rms_norm_kernel[(rows,)](x2, r2, w, y2, s2, N, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0),
                                  eps, HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block))
    return y, s


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.shape[-1] <= MAX_TRITON_WIDTH and weight.shape == (x.shape[-1],) and x.device == weight.device


@backend("rms_norm", "triton", devices=("cuda",), dtypes=FLOATS, available=available,
         fits=lambda x, weight, eps: _fits(x, weight))
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


@backend("add_rms_norm", "triton", devices=("cuda",), dtypes=FLOATS, available=available,
         fits=lambda x, residual, weight, eps: (_fits(x, weight) and residual.shape == x.shape
                                                and residual.dtype == x.dtype))
def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, residual, weight, eps)


# ---- FlashInfer (hunyuan_kernels/_flashinfer.py): after the Triton variant, so chosen only where selected ----------
#
# Its rmsnorm multiplies x * rstd * weight in fp32 and rounds once, where ours rounds the normed row to the
# dtype before the weight multiply: about a quarter of the outputs differ, by a unit in the last place (two
# at most: the GPU test's bound), never in the residual sum. Its fused add + RMSNorm (`fused_add_rmsnorm`) works in place, the
# sum into `residual` and the norm into `input`, and squares the unrounded sum: not this op's contract
# (the reference leaves its inputs alone), so `add_rms_norm` here is the rounded sum (as the reference
# rounds it) then FlashInfer's rmsnorm, two launches; the bench times the in-place kernel beside it.

def _flashinfer_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """bf16/fp16 rows whose width is a multiple of 8 (its 16-byte vectors), the weight of the same dtype."""
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.shape[-1] % 8 == 0
            and _fits(x, weight))


def _flashinfer_rms(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    s2 = s.reshape(-1, s.shape[-1]).contiguous()     # its kernel takes dense rows
    y = torch.empty_like(s2)
    if s2.shape[0]:
        _flashinfer.lib().norm.rmsnorm(s2, weight.contiguous(), eps, out=y)
    return y.view(s.shape)


@backend("rms_norm", _flashinfer.NAME, devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
         available=_flashinfer.available, fits=lambda x, weight, eps: _flashinfer_fits(x, weight))
def rms_norm_flashinfer(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _flashinfer_rms(x, weight, eps)


@backend("add_rms_norm", _flashinfer.NAME, devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
         available=_flashinfer.available,
         fits=lambda x, residual, weight, eps: (_flashinfer_fits(x, weight) and residual.shape == x.shape
                                                and residual.dtype == x.dtype))
def add_rms_norm_flashinfer(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return _flashinfer_rms(s, weight, eps), s
