"""RoPE then the per-head q/k RMSNorm of the attention input, in one pass over the fused QKV projection,
optionally writing k and v straight into the static KV cache.

`qkv` is the projection viewed as the engine views it, [B, T, kv, g + 2, D]: per KV head its g query
heads, then k, then v (the checkpoint's per-group packing). Semantics are the engine's (official order):
rotate-half RoPE in fp32 (a `qkv`-dtype tensor times fp32 cos/sin promotes), then RMSNorm of the fp32
rotated head (normalised in fp32; its weight multiply happens in fp32, the norm's input dtype), then
rounded to the dtype of `qkv`. v passes through unchanged.

cos/sin are [T, D] (every row at the same sequence indices) or [B, T, D] (each row its own: a decode
step batching several requests), `index` likewise [T] or [B, T].

`parts` > 1 (Ulysses sequence parallelism over `parts` ranks) returns q, k and v already in the layout the
heads exchange sends, [parts, B, h / parts, T, D] with part r holding heads [r*h/parts, (r+1)*h/parts):
contiguous, so the all-to-all needs no copy of them first.
"""
from __future__ import annotations

import torch

from ._triton import FLOATS, HAS_TRITON, available, next_pow2, tl, triton
from .norm import rms_norm_ref
from .registry import backend, reference


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] -> fp32 rotate-half RoPE (the engine's `apply_rope`; cos/sin [T, D] or per row
    [B, T, D], fp32)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def _split(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, kv, g2, D = qkv.shape
    g = g2 - 2
    q = qkv[:, :, :, :g].reshape(B, T, kv * g, D).transpose(1, 2)
    return q, qkv[:, :, :, g].transpose(1, 2), qkv[:, :, :, g + 1].transpose(1, 2)


def _check_parts(qkv: torch.Tensor, parts: int) -> None:
    if parts < 1 or qkv.shape[2] % parts:
        raise ValueError(f"rope_qk_norm: {qkv.shape[2]} KV heads do not split into {parts} parts")


def _in_parts(t: torch.Tensor, parts: int) -> torch.Tensor:
    """[B, h, T, D] -> [parts, B, h/parts, T, D], contiguous (parts 1: unchanged)."""
    if parts == 1:
        return t
    B, h, T, D = t.shape
    return t.reshape(B, parts, h // parts, T, D).transpose(0, 1).contiguous()


@reference("rope_qk_norm")
def rope_qk_norm_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float,
                     parts: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, kv, g+2, D] -> q [B, kv*g, T, D], k [B, kv, T, D], v [B, kv, T, D] in qkv's dtype (each
    [parts, B, heads/parts, T, D] for parts > 1)."""
    _check_parts(qkv, parts)
    q, k, v = _split(qkv)
    q = rms_norm_ref(_apply_rope(q, cos, sin), q_weight, eps).to(qkv.dtype)
    k = rms_norm_ref(_apply_rope(k, cos, sin), k_weight, eps).to(qkv.dtype)
    return _in_parts(q, parts), _in_parts(k, parts), _in_parts(v.to(qkv.dtype), parts)


@reference("rope_qk_norm_cache")
def rope_qk_norm_cache_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, eps: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                           index: torch.Tensor) -> torch.Tensor:
    """As `rope_qk_norm`, with k and v written to cache_k/cache_v [B, kv, max_len, D] at sequence
    positions `index` [T] (the engine's `KVCache.write`) or, per row, [B, T]; returns q."""
    q, k, v = rope_qk_norm_ref(qkv, cos, sin, q_weight, k_weight, eps)
    if index.dim() == 1:
        cache_k.index_copy_(2, index, k)
        cache_v.index_copy_(2, index, v)
    else:                      # row b's tokens at its own indices: cache[b, :, index[b, t]] = k[b, :, t]
        rows = torch.arange(index.shape[0], device=index.device)[:, None]
        cache_k[rows, :, index] = k.transpose(1, 2)
        cache_v[rows, :, index] = v.transpose(1, 2)
    return q


if HAS_TRITON:
    @triton.jit
    def _rope_qk_norm_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, index_ptr,
                             B, T, KV, KV_P, stride_xb, stride_xt, stride_cb, stride_ct, stride_sb, stride_st,
                             stride_ib, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, eps,
                             G: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, INDEXED: tl.constexpr):
        # one program: one token (b, t) and BLOCK_R of its kv * (G + 2) head rows, in qkv's memory order
        HALF: tl.constexpr = D // 2
        tok = tl.program_id(0).to(tl.int64)
        b = tok // T
        t = tok % T
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < KV * (G + 2)
        kvh = (rows // (G + 2)).to(tl.int64)
        j = rows % (G + 2)                     # < G: query head, G: key, G + 1: value
        d = tl.arange(0, HALF)

        src = qkv_ptr + b * stride_xb + t * stride_xt + rows[:, None].to(tl.int64) * D + d[None, :]
        m2 = live[:, None]
        x1 = tl.load(src, mask=m2, other=0.0)
        x2 = tl.load(src + HALF, mask=m2, other=0.0)
        c_row = cos_ptr + b * stride_cb + t * stride_ct          # stride_cb 0: every row the same table
        s_row = sin_ptr + b * stride_sb + t * stride_st
        c1 = tl.load(c_row + d)[None, :]
        c2 = tl.load(c_row + HALF + d)[None, :]
        s1 = tl.load(s_row + d)[None, :]
        s2 = tl.load(s_row + HALF + d)[None, :]
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        # rotate-half: rot = (-x2, x1); r = x * cos + rot * sin, in fp32
        r1 = f1 * c1 - f2 * s1
        r2 = f2 * c2 + f1 * s2
        rstd = tl.math.rsqrt((tl.sum(r1 * r1, axis=1) + tl.sum(r2 * r2, axis=1)) / D + eps)[:, None]
        is_q = (j < G)[:, None]
        w1 = tl.where(is_q, tl.load(qw_ptr + d)[None, :].to(tl.float32), tl.load(kw_ptr + d)[None, :].to(tl.float32))
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + d)[None, :].to(tl.float32),
                      tl.load(kw_ptr + HALF + d)[None, :].to(tl.float32))
        y1 = (w1 * (r1 * rstd)).to(x1.dtype)
        y2 = (w2 * (r2 * rstd)).to(x1.dtype)

        # q: [parts, B, KV_P * G, T, D] contiguous (KV_P = KV / parts KV heads a part; parts 1: [B, KV * G, T, D])
        part = kvh // KV_P
        kvc = kvh % KV_P
        dst_q = q_ptr + (((part * B + b) * (KV_P * G) + kvc * G + j) * T + t)[:, None] * D + d[None, :]
        mq = m2 & is_q
        tl.store(dst_q, y1, mask=mq)
        tl.store(dst_q + HALF, y2, mask=mq)
        # k and v: the cache at the token's sequence index, or fresh [parts, B, KV_P, T, D] as q
        if INDEXED:
            pos = tl.load(index_ptr + b * stride_ib + t).to(tl.int64)    # stride_ib 0: shared indices
            dst_k = k_ptr + b * stride_kb + (kvh * stride_kh + pos * stride_kt)[:, None] + d[None, :]
            dst_v = v_ptr + b * stride_vb + (kvh * stride_vh + pos * stride_vt)[:, None] + d[None, :]
        else:
            fresh = (((part * B + b) * KV_P + kvc) * T + t)[:, None] * D + d[None, :]
            dst_k = k_ptr + fresh
            dst_v = v_ptr + fresh
        mk = m2 & (j == G)[:, None]
        tl.store(dst_k, y1, mask=mk)
        tl.store(dst_k + HALF, y2, mask=mk)
        mv = m2 & (j == G + 1)[:, None]
        tl.store(dst_v, x1, mask=mv)
        tl.store(dst_v + HALF, x2, mask=mv)


def _fits(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
          k_weight: torch.Tensor) -> bool:
    D = qkv.shape[-1]
    return (qkv.dim() == 5 and qkv.shape[3] >= 3 and D % 2 == 0 and next_pow2(D // 2) == D // 2
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.shape in ((qkv.shape[1], D), (qkv.shape[0], qkv.shape[1], D)) and sin.shape == cos.shape
            and q_weight.shape == (D,) and k_weight.shape == (D,))


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """qkv with each token's (kv, g+2, D) block contiguous (true of the projection's output)."""
    _, _, kv, g2, D = t.shape
    if t.stride(4) == 1 and t.stride(3) == D and t.stride(2) == g2 * D:
        return t
    return t.contiguous()


def _launch(qkv, cos, sin, q_weight, k_weight, eps, k_out, v_out, index, parts: int = 1) -> torch.Tensor:
    """k_out/v_out: the cache (index given) or fresh contiguous [parts, B, kv/parts, T, D] buffers."""
    qkv = _inner_contiguous(qkv)
    B, T, kv, g2, D = qkv.shape
    g = g2 - 2
    cos, sin = (c if c.stride(-1) == 1 else c.contiguous() for c in (cos, sin))
    stride_cb, stride_sb = (cos.stride(0), sin.stride(0)) if cos.dim() == 3 else (0, 0)
    stride_ib = index.stride(0) if index is not None and index.dim() == 2 else 0
    q = torch.empty(*((parts,) if parts > 1 else ()), B, kv * g // parts, T, D, dtype=qkv.dtype, device=qkv.device)
    rows = kv * g2
    block_r = min(next_pow2(rows), max(1, 2048 // D))
    if B * T:
        _rope_qk_norm_kernel[(B * T, triton.cdiv(rows, block_r))](
            qkv, cos, sin, q_weight.contiguous(), k_weight.contiguous(), q, k_out, v_out,
            index if index is not None else qkv, B, T, kv, kv // parts, qkv.stride(0), qkv.stride(1), stride_cb,
            cos.stride(-2), stride_sb, sin.stride(-2), stride_ib, k_out.stride(0), k_out.stride(1), k_out.stride(2),
            v_out.stride(0), v_out.stride(1), v_out.stride(2),
            eps, G=g, D=D, BLOCK_R=block_r, INDEXED=index is not None, num_warps=4)
    return q


@backend("rope_qk_norm", "triton", devices=("cuda",), dtypes=FLOATS, available=available,
         fits=lambda qkv, cos, sin, q_weight, k_weight, *a, **k: _fits(qkv, cos, sin, q_weight, k_weight))
def rope_qk_norm_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, eps: float,
                        parts: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As the reference; q, k and v come back contiguous (ready for a collective)."""
    _check_parts(qkv, parts)
    B, T, kv, _, D = qkv.shape
    k = torch.empty(*((parts,) if parts > 1 else ()), B, kv // parts, T, D, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    return _launch(qkv, cos, sin, q_weight, k_weight, eps, k, v, None, parts), k, v


def _cache_fits(qkv, cos, sin, q_weight, k_weight, eps, cache_k, cache_v, index) -> bool:
    B, T, kv, _, D = qkv.shape
    return (_fits(qkv, cos, sin, q_weight, k_weight) and index.shape in ((T,), (B, T)) and index.stride(-1) == 1
            and not index.is_floating_point()
            and all(c.dtype == qkv.dtype and c.shape[0] == B and c.shape[1] == kv and c.shape[3] == D
                    and c.stride(3) == 1 for c in (cache_k, cache_v)))


@backend("rope_qk_norm_cache", "triton", devices=("cuda",), dtypes=FLOATS, available=available, fits=_cache_fits)
def rope_qk_norm_cache_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor,
                              k_weight: torch.Tensor, eps: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                              index: torch.Tensor) -> torch.Tensor:
    return _launch(qkv, cos, sin, q_weight, k_weight, eps, cache_k, cache_v, index)
