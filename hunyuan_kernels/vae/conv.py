"""The VAE's 'same' 3D convolution (stride 1, zero padding, T_out == T), and a CUDA path that runs it
as one 2D convolution over the frames.

    conv3d_same(x [B,Cin,T,H,W], weight [Cout,Cin,kt,kh,kw], bias [Cout] | None, padding (pt,ph,pw))

Why a second path: at the VAE decoder's shapes cuDNN's 3D kernels reach about a third of the H200's
fp16 rate, its channels-last 2D kernels much more. A 3D conv is a sum of 2D convs over its temporal
taps, output frame t = sum_k W[:, :, k] (*) x[t + k - pt] with zero frames outside [0, T). So the
frames are folded into the batch (channels last: one tiled-transpose pass, a view for a
channels_last_3d x), every tap is computed by ONE conv2d whose output channels are the taps stacked
(weight [taps*Cout, Cin, kh, kw]; a matmul for 1x1 kernels), and a Triton kernel sums each output
frame's taps from its neighbour frames, adds the bias once and writes the [B,Cout,T,H,W] result
(contiguous, as F.conv3d's; the same kernel does the transpose). It computes taps*T frame-taps, as many as
cuDNN's padded 3D conv; taps that can see no frame (|k - pt| >= T, all but the centre at T = 1) are
left out. Each tap's sum is rounded to the conv's dtype before the three are added in fp32: one more
rounding than F.conv3d, within that dtype's bounds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._triton import HAS_TRITON, INTERPRET, available, next_pow2, tl, triton
from ..registry import backend, reference

CHANNEL_ALIGN = 8      # cuDNN's tensor-core kernels want channel counts in multiples of 8 (fp16/bf16)


@reference("conv3d_same")
def conv3d_same_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    padding: tuple[int, int, int]) -> torch.Tensor:
    if x.shape[2] == 1 and weight.shape[2] == 2 * padding[0] + 1:
        # one frame: only the centre temporal tap sees data, so the equivalent 2D conv is exact
        # and does a third of the work
        k = weight.shape[2] // 2
        return F.conv2d(x[:, :, 0], weight[:, :, k], bias, padding=padding[1:]).unsqueeze(2)
    return F.conv3d(x, weight, bias, padding=padding)


if HAS_TRITON:
    @triton.jit
    def _tap_sum_kernel(y_ptr, bias_ptr, out_ptr, T, P, C, syb, syt, syp, syk, syc, sob, soc, sot, sop,
                        TAPS: tl.constexpr, FIRST: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """out[b, c, t, p] = bias[c] + sum_k y[b, t + k + FIRST, p, k, c] over the frames inside [0, T),
        both in any strides (p: the H*W pixels). The conv's tap sum (y: its stacked conv2d output,
        channels last) and, with one tap, the channels-last copy of the frames. A tile is loaded
        along y's unit-stride dim and stored along out's (Triton moves it through shared memory)."""
        n = tl.program_id(2)
        b = (n // T).to(tl.int64)
        t = n % T
        p = (tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
        c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
        mask = (p < P)[:, None] & (c < C)[None, :]
        pc = p[:, None] * syp + c[None, :] * syc
        for k in tl.static_range(TAPS):
            s = t + k + FIRST
            inside = (s >= 0) & (s < T)
            s = tl.minimum(tl.maximum(s, 0), T - 1)         # a valid address even where masked off
            src = y_ptr + b * syb + s.to(tl.int64) * syt + k * syk + pc
            v = tl.load(src, mask=mask & inside, other=0.0).to(tl.float32)
            if k == 0:
                acc = v               # (one tap: a plain copy, -0.0 kept)
            else:
                acc += v
        if HAS_BIAS:
            acc += tl.load(bias_ptr + c, mask=c < C, other=0.0).to(tl.float32)[None, :]
        dst = out_ptr + b * sob + c[None, :] * soc + t.to(tl.int64) * sot + p[:, None] * sop
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(y, y_strides, bias, out, out_strides, B: int, T: int, P: int, C: int, taps: int, first: int) -> None:
    block_c = max(16, min(64, next_pow2(C)))
    grid = (triton.cdiv(P, 4096 // block_c), triton.cdiv(C, block_c), B * T)
    _tap_sum_kernel[grid](y, bias if bias is not None else y, out, T, P, C, *y_strides, *out_strides,
                          TAPS=taps, FIRST=first, HAS_BIAS=bias is not None,
                          BLOCK_P=4096 // block_c, BLOCK_C=block_c, num_warps=4)


def _triton_runs(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or INTERPRET)


def frames_channels_last(x: torch.Tensor) -> torch.Tensor:
    """[B,C,T,H,W] -> [B*T,C,H,W] in channels-last memory: a view when x is channels_last_3d, else
    one tiled-transpose pass (PyTorch's strided copy where Triton cannot run or H, W do not merge)."""
    B, C, T, H, W = x.shape
    xt = x.permute(0, 2, 3, 4, 1)
    if xt.is_contiguous() or not _triton_runs(x) or x.stride(3) != W * x.stride(4):
        f = xt.contiguous()
    else:
        f = torch.empty((B, T, H, W, C), dtype=x.dtype, device=x.device)
        sb, sc, st, _, sp = x.stride()
        _launch(x, (sb, st, sp, 0, sc), None, f, (T * H * W * C, 1, H * W * C, C), B, T, H * W, C, 1, 0)
    return f.view(B * T, H, W, C).permute(0, 3, 1, 2)


def used_taps(kt: int, pt: int, T: int) -> tuple[int, int]:
    """[k0, k1): the temporal taps that see a frame for some output (|k - pt| < T)."""
    return max(0, pt - T + 1), min(kt, pt + T)


def stacked_tap_weight(weight: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, int]:
    """[Cout,Cin,kt,kh,kw] -> ([taps*Cpad, Cin, kh, kw] channels last, Cpad): taps k0..k1-1 stacked on
    the output channels, each tap's block padded with zero rows to a multiple of CHANNEL_ALIGN."""
    cout, cin, _, kh, kw = weight.shape
    cpad = -(-cout // CHANNEL_ALIGN) * CHANNEL_ALIGN
    taps = k1 - k0
    w = (weight.new_zeros if cpad != cout else weight.new_empty)((taps, cpad, kh, kw, cin))
    w[:, :cout].copy_(weight[:, :, k0:k1].permute(2, 0, 3, 4, 1))
    return w.view(taps * cpad, kh, kw, cin).permute(0, 3, 1, 2), cpad


def tap_outputs(frames: torch.Tensor, w: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """The stacked-tap 2D conv of channels-last frames -> [N, taps*Cpad, H', W'] channels last."""
    if w.shape[2:] == (1, 1) and padding == (0, 0):
        # a 1x1 kernel is a matmul over pixels; the frames' memory is already [N*H*W, Cin]
        n, cin, h, wd = frames.shape
        y = frames.permute(0, 2, 3, 1).reshape(-1, cin) @ w.reshape(w.shape[0], cin).t()
        return y.view(n, h, wd, -1).permute(0, 3, 1, 2)
    return F.conv2d(frames, w, None, padding=padding).contiguous(memory_format=torch.channels_last)


def sum_taps(y: torch.Tensor, bias: torch.Tensor | None, B: int, T: int, cout: int, cpad: int,
             first: int, out: torch.Tensor) -> torch.Tensor:
    """y [B*T, taps*cpad, H, W] channels last (tap k of frame s at channels k*cpad...) -> out
    [B,cout,T,H,W]: out[:, :, t] = bias + sum_k tap k of frame t + k + first."""
    ch = y.shape[1]
    P = y.shape[2] * y.shape[3]
    _launch(y, (T * P * ch, P * ch, ch, cpad, 1), bias, out, out.view(B, cout, T, P).stride(),
            B, T, P, cout, ch // cpad, first)
    return out


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padding) -> bool:
    kt = weight.shape[2]
    return (x.ndim == 5 and weight.ndim == 5 and kt == 2 * padding[0] + 1 and x.shape[1] == weight.shape[1]
            and x.shape[1] % CHANNEL_ALIGN == 0 and weight.dtype == x.dtype and x.device == weight.device
            and (bias is None or bias.dtype == x.dtype))


@backend("conv3d_same", "taps2d", devices=("cuda",), dtypes=(torch.float16, torch.bfloat16), available=available,
         fits=_fits)
def conv3d_same_taps(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     padding: tuple[int, int, int]) -> torch.Tensor:
    """The stacked-tap 2D version of `conv3d_same_ref` for the shapes `_fits` takes (any device where
    Triton runs: the CPU tests call it under the interpreter)."""
    B, _, T, H, W = x.shape
    cout, _, kt, kh, kw = weight.shape
    pt, ph, pw = padding
    k0, k1 = used_taps(kt, pt, T)
    w, cpad = stacked_tap_weight(weight, k0, k1)
    y = tap_outputs(frames_channels_last(x), w, (ph, pw))
    out = torch.empty((B, cout, T, y.shape[2], y.shape[3]), dtype=x.dtype, device=x.device)
    return sum_taps(y, bias, B, T, cout, cpad, k0 - pt, out)
