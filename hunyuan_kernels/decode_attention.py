"""Decode attention over the valid prefix of a static KV cache, the prefix length read from a device
tensor (so one CUDA graph of the AR decode step serves every position).

    decode_attention(q [B, Hq, T, D], k_cache [B, Hkv, L, D], v_cache [B, Hkv, L, D], length) -> [B, Hq, T, D]

Keys [0, length) are attended (`length` an int64 tensor of one element, or [B]: each row its own, a
decode step batching several requests; values above L read as L).
The T <= MAX_T queries are the last T tokens of that prefix: query t sits at sequence index
length - T + t and sees keys j <= its own index (causal within the last T keys; T = 1 for a decode
step). GQA: query head h reads KV head h // (Hq / Hkv). Scale 1/sqrt(D), softmax and accumulation in
fp32, the result in q's dtype. Requires length >= T (every query sees at least one key).

The reference is SDPA: on the CPU over the valid slice (a host read of `length`), on a GPU over the
whole cache under a mask made on the device (graph-safe; the fallback for shapes the kernels do not
take, such as the test models' head_dim 8 and 32).

The Triton backend is split-KV flash-decoding: programs (B * Hkv, cdiv(L, CHUNK)) each take the G query
heads of one KV head (G * T rows, padded to 16 for tl.dot) over one CHUNK of keys, stopping at
`length`; programs whose chunk starts at or past `length` exit at once. A second kernel combines the
live chunks of each query row in chunk order (deterministic, no atomics). The grid depends on L only,
never on `length`, and nothing is read back to the host.

Floor: K and V of the prefix are read once, 2 * B * Hkv * length * D * itemsize bytes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import _flashinfer
from ._triton import HAS_TRITON, INTERPRET, available, next_pow2, tl, triton
from .registry import backend, reference

# keys per split program. Small, so that a short valid prefix still fills the 132 SMs (length 1251 at
# Hkv 8: 160 programs; the chunks past `length` exit at once) while the fp32 partials stay small next
# to K and V (G * D * 4 bytes per chunk and query head vs 2 * CHUNK * D * 2). `python -m bench decode-attention`
# sweeps it.
CHUNK = 64
BLOCK_N = 64      # keys per tile inside a chunk
MAX_T = 8         # queries per call (the decode step has 1)
MIN_ROWS = 16     # tl.dot's smallest M: the G * T query rows of a KV head are padded to it


def _causal_mask(T: int, n: int, length, device) -> torch.Tensor | None:
    """[T, n] bool over keys [0, n): query t (at index length - T + t) sees keys j <= length - T + t.
    `length` an int or a device tensor (no host read); None where every key is visible."""
    if T == 1 and isinstance(length, int):
        return None
    keys = torch.arange(n, device=device)
    return keys[None, :] <= (length - T + torch.arange(T, device=device))[:, None]


@reference("decode_attention")
def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         length: torch.Tensor) -> torch.Tensor:
    """SDPA. On the CPU over the valid slice (`length` read on the host); on other devices over the
    whole static cache under a mask built on the device (no host read, so a graph can capture it: the
    CUDA fallback where the Triton kernels do not fit, e.g. fp32 or head_dim < 64)."""
    L = k_cache.shape[2]
    T = q.shape[2]
    gqa = q.shape[1] // k_cache.shape[1] > 1
    if q.device.type == "cpu":
        lengths = length.reshape(-1).tolist()
        if len(lengths) > 1:         # each row over its own valid slice
            return torch.cat([decode_attention_ref(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], length[b:b + 1])
                              for b in range(q.shape[0])])
        n = min(int(lengths[0]), L)
        return F.scaled_dot_product_attention(q, k_cache[:, :, :n], v_cache[:, :, :n],
                                              attn_mask=_causal_mask(T, n, n, q.device), enable_gqa=gqa)
    return masked_whole_cache(q, k_cache, v_cache, length)


def masked_whole_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       length: torch.Tensor) -> torch.Tensor:
    """SDPA over the whole static cache, keys past `length` masked on the device (the decode step's
    attention before this op; the reference off the CPU)."""
    L, T = k_cache.shape[2], q.shape[2]
    n = length.reshape(-1).clamp(max=L)
    if q.shape[0] > 1:
        # row by row: how SDPA splits the keys depends on the batch, so a batched call rounds a row
        # otherwise than the same row alone (seen on the H200, 2026-12-03: a greedy request's text changed
        # when decoded beside three others in bf16); alone, each row is exactly the one-row call
        return torch.cat([masked_whole_cache(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1],
                                             n[b:b + 1] if n.numel() > 1 else n) for b in range(q.shape[0])])
    mask = _causal_mask(T, L, n[:1], q.device)
    return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                          enable_gqa=q.shape[1] // k_cache.shape[1] > 1)


if HAS_TRITON:
    from ._triton import dot as _dot  # noqa: F401  (called inside the kernels below)

    # L and the split count change with the cache size only; compiling a variant per divisibility of
    # theirs buys nothing (they index rows, never set an alignment)
    @triton.jit(do_not_specialize=["KV", "L", "n_splits"])
    def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, KV, L, n_splits, qk_scale,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kl,
                      stride_vb, stride_vh, stride_vl, stride_len,
                      G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, UPCAST: tl.constexpr):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // KV).to(tl.int64)
        length = tl.minimum(tl.load(len_ptr + b * stride_len).to(tl.int32), L)    # stride_len 0: one length
        start = split * CHUNK
        if start < length:         # chunks past the prefix do nothing (the combine skips them)
            kvh = (bh % KV).to(tl.int64)
            rows = tl.arange(0, BLOCK_M)
            live = rows < G * T
            g = rows // T
            t = rows % T
            d = tl.arange(0, D)
            qh = (kvh * G + g).to(tl.int64)
            q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                        mask=live[:, None], other=0.0)
            limit = length - T + 1 + t             # row sees keys j < limit
            stop = tl.minimum(start + CHUNK, length)
            k_base = k_ptr + b * stride_kb + kvh * stride_kh
            v_base = v_ptr + b * stride_vb + kvh * stride_vh
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)      # running max, log2 domain
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            for n0 in range(start, stop, BLOCK_N):
                j = n0 + tl.arange(0, BLOCK_N)
                jm = j < stop
                # masked loads: rows past `length` are never read (they may hold anything)
                kt = tl.load(k_base + j[None, :].to(tl.int64) * stride_kl + d[:, None], mask=jm[None, :], other=0.0)
                s = _dot(q, kt, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST) * qk_scale
                s = tl.where(j[None, :] < limit[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet: no NaN
                p = tl.math.exp2(s - m_sub[:, None])
                alpha = tl.math.exp2(m_i - m_sub)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + j[:, None].to(tl.int64) * stride_vl + d[None, :], mask=jm[:, None], other=0.0)
                acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST)
                m_i = m_new
            part = (bh * n_splits + split) * (G * T) + rows
            tl.store(m_ptr + part, m_i, mask=live)
            tl.store(l_ptr + part, l_i, mask=live)
            tl.store(acc_ptr + part.to(tl.int64)[:, None] * D + d[None, :], acc, mask=live[:, None])

    @triton.jit(do_not_specialize=["KV", "L", "n_splits"])
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, len_ptr, out_ptr, KV, L, n_splits, stride_len,
                        G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK_S: tl.constexpr):
        # one program: one query row (b, kv head, g, t); its live chunks merged in chunk order
        pid = tl.program_id(0)
        GT: tl.constexpr = G * T
        bh = pid // GT
        r = pid % GT
        length = tl.minimum(tl.load(len_ptr + (bh // KV) * stride_len).to(tl.int32), L)
        n_live = tl.cdiv(length, CHUNK)
        d = tl.arange(0, D)
        m_run = tl.full([1], float("-inf"), tl.float32)
        l_run = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for s0 in range(0, n_live, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            sm = s < n_live
            part = (bh * n_splits + s) * GT + r
            m_s = tl.load(m_ptr + part, mask=sm, other=float("-inf"))
            l_s = tl.load(l_ptr + part, mask=sm, other=0.0)
            a_s = tl.load(acc_ptr + part.to(tl.int64)[:, None] * D + d[None, :], mask=sm[:, None], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            w = tl.math.exp2(m_s - m_sub)                   # 0 for masked-off and key-less partials
            alpha = tl.math.exp2(m_run - m_sub)
            l_run = l_run * alpha + tl.sum(w * l_s, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * a_s, axis=0)
            m_run = m_new
        out = acc / tl.where(l_run > 0, l_run, 1.0)
        # out [B, Hq, T, D] contiguous: row (bh, r) = (b, kvh * G + g, t) is flat row bh * GT + r
        tl.store(out_ptr + pid.to(tl.int64) * D + d, out.to(out_ptr.dtype.element_ty))


def fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor) -> bool:
    """The shapes, dtypes and layouts the Triton kernels take (else the reference runs)."""
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return False
    B, Hq, T, D = q.shape
    Bk, Hkv, L, Dk = k_cache.shape
    return (Bk == B and Dk == D and Hkv > 0 and Hq % Hkv == 0 and 1 <= T <= MAX_T and 64 <= D <= 256
            and next_pow2(D) == D and L > 0 and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and length.numel() in (1, B) and not length.is_floating_point() and length.device == q.device)


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor,
           chunk: int = CHUNK, block_n: int = BLOCK_N, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """The two kernels (chunk / block_n / warps / stages exposed for the bench's sweep)."""
    B, Hq, T, D = q.shape
    _, Hkv, L, _ = k_cache.shape
    G = Hq // Hkv
    block_n = min(block_n, chunk)
    n_splits = triton.cdiv(L, chunk)
    rows = G * T
    dev = q.device
    # scratch: per call from the caching allocator (static inside a captured graph)
    m = torch.empty(B * Hkv, n_splits, rows, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    acc = torch.empty(B * Hkv, n_splits, rows, D, dtype=torch.float32, device=dev)
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=dev)
    length = length.reshape(-1)
    stride_len = length.stride(0) if length.numel() > 1 else 0
    qk_scale = (1.0 / math.sqrt(D)) * math.log2(math.e)
    extra = {} if INTERPRET else dict(num_warps=num_warps, num_stages=num_stages)
    _split_kernel[(B * Hkv, n_splits)](
        q, k_cache, v_cache, length, m, s, acc, Hkv, L, n_splits, qk_scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_len,
        G=G, T=T, D=D, BLOCK_M=max(MIN_ROWS, next_pow2(rows)), BLOCK_N=block_n, CHUNK=chunk, UPCAST=INTERPRET,
        **extra)
    _combine_kernel[(B * Hkv * rows,)](
        m, s, acc, length, out, Hkv, L, n_splits, stride_len, G=G, T=T, D=D, CHUNK=chunk,
        BLOCK_S=min(32, next_pow2(n_splits)), **({} if INTERPRET else dict(num_warps=4)))
    return out


@backend("decode_attention", "triton", devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
         available=available, fits=fits)
def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            length: torch.Tensor) -> torch.Tensor:
    return launch(q, k_cache, v_cache, length)


# ---- FlashInfer (hunyuan_kernels/_flashinfer.py): after the Triton variant, so chosen only where selected ----------
#
# The static cache [B, Hkv, L, D] is FlashInfer's paged cache in its HND layout with one page of L keys a
# row (page b = row b), and the row's `length` is that page's fill ("last_page_len"). Its batch decode
# (fa2, CUDA cores) is planned on the host once per shape; the plan holds no length, only the device
# buffer the kernel reads each row's fill from, so `length` stays on the device and a graph replays at any
# position. Its planner splits a row's keys by whole pages only, so with one page a row nothing is split:
# one program per (row, KV head), 8 at one row (ours splits the keys into 64-key chunks). Smaller pages
# would need each row's page count on the host every step. T = 1 only (its decode takes one query a row);
# scale 1/sqrt(D), softmax in fp32 as the reference.
FLASHINFER_WORKSPACE_BYTES = 128 << 20      # its float workspace (the merge pass's partials), one a device
FLASHINFER_GROUPS = (1, 2, 3, 4, 8)          # the GQA group sizes its decode kernels are built for
_fi_plans: dict[tuple, tuple] = {}           # (device, B, Hq, Hkv, D, L, dtype) -> (wrapper, fill buffer)
_fi_workspace: dict[torch.device, torch.Tensor] = {}


def _flashinfer_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor) -> bool:
    if not fits(q, k_cache, v_cache, length):
        return False
    return (q.shape[2] == 1 and q.shape[3] in (64, 128, 256) and q.shape[1] // k_cache.shape[1] in FLASHINFER_GROUPS
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.dtype in (torch.bfloat16, torch.float16))


def _flashinfer_plan(q: torch.Tensor, k_cache: torch.Tensor) -> tuple:
    """The planned wrapper for this shape and the int32 [B] buffer of the rows' fills it reads (made once;
    plan reads the host, so the first call of a shape must come before any graph capture)."""
    B, Hq, _, D = q.shape
    _, Hkv, L, _ = k_cache.shape
    key = (q.device, B, Hq, Hkv, D, L, q.dtype)
    found = _fi_plans.get(key)
    if found is None:
        fi = _flashinfer.lib()
        ws = _fi_workspace.get(q.device)
        if ws is None:
            ws = _fi_workspace[q.device] = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=q.device)     # one page a row
        pages = torch.arange(B, dtype=torch.int32, device=q.device)
        fill = torch.full((B,), L, dtype=torch.int32, device=q.device)
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            ws, kv_layout="HND", use_cuda_graph=True, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=pages, paged_kv_last_page_len_buffer=fill, backend="fa2")
        wrapper.plan(indptr, pages, fill, Hq, Hkv, D, L, q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        found = _fi_plans[key] = (wrapper, fill)
    return found


@backend("decode_attention", _flashinfer.NAME, devices=("cuda",), dtypes=(torch.bfloat16, torch.float16),
         available=_flashinfer.available, fits=_flashinfer_fits)
def decode_attention_flashinfer(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                length: torch.Tensor) -> torch.Tensor:
    B, Hq, _, D = q.shape
    wrapper, fill = _flashinfer_plan(q, k_cache)
    # each row's fill on the device (values above L read as L; one length serves every row)
    fill.copy_(length.reshape(-1).clamp(max=k_cache.shape[2]).expand(B))
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    wrapper.run(q[:, :, 0], (k_cache, v_cache), out=out[:, :, 0])
    return out
