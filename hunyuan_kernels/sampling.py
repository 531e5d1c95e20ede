"""Next-token sampling on the device without sorting the vocabulary.

The distribution is the engine's `choose` (the HF warpers in order): logits / temperature, keep the
top_k largest (every token tied with the k-th value too), then keep the most likely survivors whose
accumulated probability, summed from the least likely up as `choose` does, exceeds 1 - top_p (the most
likely token always stays), then one seeded draw. `choose` sorts all V = 133120 logits for the top-p
step; here only the k survivors of a top-k are in order (a radix-select top-k returns them sorted), and the
top-p cut becomes a value `thr` and a count: kept = {x > thr} and the `n_tie` highest-id tokens with x == thr.

- top_k == 0 (disabled, or >= V) with top_p < 1 still needs every logit in order, so that case sorts the
  whole vocabulary: correct, only slower (the engine's default top_k is 1024).
- Equal logits are common (the logits are bf16 values upcast), and a group of them often straddles the
  top-p cut. `choose` keeps as many of the group as its cumulative rule allows, the ones its ascending
  sort puts last; torch.sort's order among equal values is unspecified (CPU: arbitrary; a stable
  sort: the highest ids last). Here the count is the same and the kept ones are the highest ids, which
  is the stable sort's choice. Ties at the top-k cut are all kept, by both.

The draw is torch.multinomial's own one-sample algorithm (argmax of probs / Exp(1) noise from the
request's generator) without its validity checks, which read the device twice per call: with the same
generator state and the same kept set, the reference picks the same token as `choose`. No step of the
op reads the device; the caller's `int(token)` is the one host read of a decode step.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from . import _flashinfer
from ._triton import HAS_TRITON, available, next_pow2, tl, triton
from .registry import backend, call, reference

MAX_TRITON_K = 4096        # the top-p cut runs in one block of the sorted survivors
# the "triton" variant (top-k by topk_desc) up to this k, "triton_torch_topk" (torch.topk, then the same cut) above: inside a decode step (the sample op queued behind the step's
# graph, its host cost hidden) topk_desc took 45.1 us of GPU time against torch.topk's 70.7 at k = 1024,
# but 114.9 against 74.0 at k = 4096 (bench_decode_parts.py topk, now `python -m bench decode-parts`, one H200, 2026-12-01)
TOPK_TRITON_MAX_K = 1024


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample of `probs` [V] as torch.multinomial(probs, 1) takes it (same noise, same token)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax()


def cut_ref(x: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The top-k then top-p kept set of each row of x [..., V] as (thr, n_tie), each [..., 1]: kept =
    {x > thr} plus the n_tie highest-id tokens with x == thr (n_tie None: every tie is kept). None when
    neither warper is on. Every step is per row (the last dim): on the CPU a row of a batch and the same
    row alone give the same bits (the batched `sample_rows` variant relies on it; tested)."""
    V = x.shape[-1]
    k_on, p_on = 0 < top_k < V, top_p < 1.0
    if not (k_on or p_on):
        return None
    if k_on:
        vals = x.topk(top_k).values                  # descending; the only selection over V
        kth = vals[..., -1:]
        if not p_on:
            return kth, None
        # tokens tied with the k-th value beyond the k returned survive top-k too (`x >= kth`); they are
        # the least likely survivors, the first ones of the ascending accumulation
        extra = (x >= kth).sum(-1, keepdim=True) - top_k
    else:
        vals = x.sort(descending=True).values        # top-k disabled: the whole vocabulary, sorted
        kth = vals[..., -1:]
        extra = torch.zeros_like(kth, dtype=torch.long)
    K = vals.shape[-1]
    cut = 1 - top_p
    m = vals[..., :1]
    e = (vals.flip(-1) - m).exp()                    # ascending
    e_tie = (kth - m).exp()
    z = e.sum(-1, keepdim=True) + extra * e_tie
    p_tie = e_tie / z
    cum = (e / z).cumsum(-1) + extra * p_tie
    n_vals = (cum > cut).sum(-1, keepdim=True)       # a suffix of the ascending survivors
    # the extra ties are kept only if every listed survivor is: the j-th of them has accumulated j * p_tie
    # (clamp with a tensor bound reads it back on the host: minimum/clamp_min keep it on the device)
    kept_extra = torch.where(n_vals == K, torch.minimum((extra - torch.floor(cut / p_tie)).clamp_min(0),
                                                        extra.to(p_tie.dtype)), 0).long()
    n_keep = (n_vals + kept_extra).clamp(min=1)
    thr = vals.gather(-1, n_keep.clamp(max=K) - 1)
    return thr, n_keep - (vals > thr).sum(-1, keepdim=True)   # every x > thr >= kth is a listed survivor


def kept_mask(x: torch.Tensor, thr: torch.Tensor, n_tie: torch.Tensor | None) -> torch.Tensor:
    """The kept set of a cut as a bool mask over x [..., V] (thr, n_tie: [..., 1] or 0-d)."""
    if n_tie is None:
        return x >= thr
    tie = x == thr
    later = tie.flip(-1).cumsum(-1).flip(-1)         # ties at this id or after it
    return (x > thr) | (tie & (later <= n_tie))


def warp(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """x [..., V] (logits / temperature) with every token outside the top-k / top-p kept set at -inf."""
    c = cut_ref(x, top_k, top_p)
    return x if c is None else x.masked_fill(~kept_mask(x, *c), float("-inf"))


@reference("sample")
def sample_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None, greedy: bool = False,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] fp32 -> token id (0-d long tensor on the logits' device).

    `allowed` (ids) restricts the choice and forces greedy (the ratio tokens, as the official
    processor does). Branches only on the request's parameters, never on the logits.
    """
    if allowed is not None:      # index_select, not allowed[i]: indexing by a 0-d CUDA tensor reads it to the host
        return allowed.index_select(0, logits.index_select(0, allowed).argmax().view(1)).view(())
    if greedy:
        return logits.argmax()
    return _draw(warp(logits / temperature, top_k, top_p).softmax(-1), generator)


# ---- CUDA top-k: a radix select over order-preserving keys, then one sort of the k survivors ----------
#
# torch.topk(x, 1024) at V = 133120 is a dozen small kernels and a radix sort (~66 us of CUDA time). Here:
# every fp32 maps to a uint32 key whose unsigned order is the float order (negatives: all bits flipped;
# others: the sign bit set), so -inf is an ordinary small key and NaN sorts above +inf (ignored, harmless).
# 1. digits, 4 launches of the same kernel (LEVEL 0..3): each program of a CHUNK of x writes the histogram
#    of the LEVEL-th byte of the keys whose higher bytes equal the k-th key's (its 256 counts into
#    hist[LEVEL, program]); it derives those higher bytes itself from the earlier levels' histograms (1 KB
#    a program a level, read redundantly by every program: cheaper than a launch). Integer counts, no
#    atomics: deterministic.
# 2. compact: every program derives the k-th key, the number G of keys above it and, per chunk, the
#    count above it and tied with it (all from the histograms), so it knows where its chunk's survivors
#    go: the keys above the k-th in id order into [0, G), the first k - G ties in id order into [G, k).
# 3. sort: one program sorts the k (key, id) pairs descending, packed as key << 32 | (2^32 - 1 - id)
#    into uint64 (equal values in id order), and unpacks the values and ids.
# Six launches of fixed grids; nothing reads the device or depends on the data's shape (graph-capturable).

TOPK_CHUNK = 4096           # keys per program of the digit and compact passes (33 programs at V = 133120)

if HAS_TRITON:
    @triton.jit
    def _key(x_ptr, offs, inside):
        """The order-preserving uint32 key of x[offs] (0 outside, below every real key); -0.0 is +0.0, as
        the float comparisons of the other kernels have it."""
        b = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.uint32, bitcast=True)
        b = tl.where(b == 0x80000000, 0, b)
        key = tl.where((b >> 31) != 0, b ^ 0xFFFFFFFF, b | 0x80000000)
        return tl.where(inside, key, 0)

    @triton.jit
    def _descend(hist_ptr, P, K, LEVEL: tl.constexpr, BLOCK_P: tl.constexpr):
        """The k-th largest key's bytes above LEVEL from the histograms of the levels below it ->
        (prefix, k_rem: its rank among the keys with that prefix, gt [BLOCK_P]: per chunk, the keys above
        it already decided by those bytes)."""
        rows = tl.arange(0, BLOCK_P)
        bins = tl.arange(0, 256)
        prefix = tl.full((), 0, tl.uint32)
        k_rem = K + tl.full((), 0, tl.int32)
        gt = tl.zeros((BLOCK_P,), dtype=tl.int32)
        for j in tl.static_range(LEVEL):
            h = tl.load(hist_ptr + (j * P + rows[:, None]) * 256 + bins[None, :], mask=rows[:, None] < P, other=0)
            tot = tl.sum(h, axis=0)
            ge = tl.cumsum(tot, axis=0, reverse=True)          # keys with this byte or a larger one
            d = tl.max(tl.where(ge >= k_rem, bins, 0), axis=0)  # the k-th key's byte: ge[0] >= k_rem always
            above = bins[None, :] > d
            k_rem -= tl.sum(tl.where(bins > d, tot, 0), axis=0)
            gt += tl.sum(tl.where(above, h, 0), axis=1)
            prefix = (prefix << 8) | d.to(tl.uint32)
        return prefix, k_rem, gt

    @triton.jit
    def _digit_kernel(x_ptr, hist_ptr, V, K, P, LEVEL: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.program_id(1)                       # the row of x [rows, V]; hist [rows, 4, P, 256]
        x_ptr += row * V
        hist_ptr += row * (4 * P * 256)
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        inside = offs < V
        key = _key(x_ptr, offs, inside)
        live = inside
        if LEVEL > 0:
            prefix, _k_rem, _gt = _descend(hist_ptr, P, K, LEVEL, BLOCK_P)
            live = inside & ((key >> (32 - 8 * LEVEL)) == prefix)
        digit = ((key >> (24 - 8 * LEVEL)) & 0xFF).to(tl.int32)
        h = tl.histogram(digit, 256, mask=live)
        tl.store(hist_ptr + (LEVEL * P + pid) * 256 + tl.arange(0, 256), h)

    @triton.jit
    def _compact_kernel(x_ptr, hist_ptr, pack_ptr, V, K, P, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.program_id(1)                       # pack [rows, K]
        x_ptr += row * V
        hist_ptr += row * (4 * P * 256)
        pack_ptr += row * K
        kth, n_tie, gt = _descend(hist_ptr, P, K, 4, BLOCK_P)  # n_tie: the ties at the k-th key to take
        rows = tl.arange(0, BLOCK_P)
        eq = tl.load(hist_ptr + (3 * P + rows) * 256 + (kth & 0xFF).to(tl.int32), mask=rows < P, other=0)
        before = rows < pid
        gt_before = tl.sum(tl.where(before, gt, 0), axis=0)
        eq_before = tl.sum(tl.where(before, eq, 0), axis=0)
        n_gt = K - n_tie
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        inside = offs < V
        key = _key(x_ptr, offs, inside)
        is_gt = inside & (key > kth)
        is_eq = inside & (key == kth)
        pos_gt = gt_before + tl.cumsum(is_gt.to(tl.int32), axis=0) - 1
        rank_eq = eq_before + tl.cumsum(is_eq.to(tl.int32), axis=0) - 1
        pos = tl.where(is_gt, pos_gt, n_gt + rank_eq)
        take = (is_gt & (pos_gt < n_gt)) | (is_eq & (rank_eq < n_tie))   # bounds hold by construction
        packed = (key.to(tl.uint64) << 32) | (0xFFFFFFFF - offs.to(tl.uint32)).to(tl.uint64)
        tl.store(pack_ptr + pos, packed.to(tl.int64, bitcast=True), mask=take & (pos >= 0) & (pos < K))

    @triton.jit
    def _sort_kernel(pack_ptr, vals_ptr, idx_ptr, K, BLOCK_K: tl.constexpr):
        row = tl.program_id(1)                       # pack, vals, idx [rows, K]
        pack_ptr += row * K
        vals_ptr += row * K
        idx_ptr += row * K
        d = tl.arange(0, BLOCK_K)
        live = d < K
        packed = tl.load(pack_ptr + d, mask=live, other=0).to(tl.uint64, bitcast=True)   # stored as int64
        packed = tl.sort(packed, descending=True)
        key = (packed >> 32).to(tl.uint32)
        bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
        tl.store(vals_ptr + d, bits.to(tl.float32, bitcast=True), mask=live)
        tl.store(idx_ptr + d, (0xFFFFFFFF - (packed & 0xFFFFFFFF)).to(tl.int64), mask=live)


def topk_desc(x: torch.Tensor, k: int, chunk: int = TOPK_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) of x [V] fp32 (1 <= k <= min(V, MAX_TRITON_K)) by the Triton kernels -> (vals [k]
    fp32, exactly torch.topk's values; idx [k] int64, distinct, x[idx] == vals; ties at the k-th value:
    the lowest ids). x [rows, V] (contiguous): the same per row, each row by the same programs as alone
    (the row is the grids' second axis) -> (vals, idx) [rows, k]."""
    V = x.shape[-1]
    assert x.dim() in (1, 2) and x.is_contiguous() and x.dtype == torch.float32
    assert 1 <= k <= min(V, MAX_TRITON_K) and x.numel() < 2 ** 31
    rows = x.shape[0] if x.dim() == 2 else 1
    P = triton.cdiv(V, chunk)
    BLOCK_P = max(2, next_pow2(P))
    hist = torch.empty((*x.shape[:-1], 4, P, 256), dtype=torch.int32, device=x.device)
    for level in range(4):
        _digit_kernel[(P, rows)](x, hist, V, k, P, LEVEL=level, CHUNK=chunk, BLOCK_P=BLOCK_P, num_warps=8)
    pack = torch.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)   # uint64 bits (torch's uint64 is thin)
    _compact_kernel[(P, rows)](x, hist, pack, V, k, P, CHUNK=chunk, BLOCK_P=BLOCK_P, num_warps=8)
    vals = torch.empty((*x.shape[:-1], k), dtype=torch.float32, device=x.device)
    idx = torch.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)
    BLOCK_K = max(2, next_pow2(k))
    _sort_kernel[(1, rows)](pack, vals, idx, k, BLOCK_K=BLOCK_K, num_warps=16 if BLOCK_K >= 2048 else 8)
    return vals, idx


# ---- CUDA: topk_desc (the k survivors, sorted) + three small Triton kernels ---------------------------
#
# 1. counts: per chunk of V, #{x >= kth} and #{x == kth} (top-p only; summed later, never atomically);
# 2. pick: every program derives the cut (thr, n_tie) from the sorted survivors and the counts (a few
#    thousand flops, redundant per program, cheaper than a launch), ranks the ties of its chunk from the
#    highest id down, and writes the best exp(x - max) / q of its chunk's kept tokens;
# 3. final: the first best of the chunks' bests (the first of equal maxima, as torch.argmax).

if HAS_TRITON:
    @triton.jit
    def _count_kernel(x_ptr, vals_ptr, ge_ptr, eq_ptr, V, K, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.program_id(1)                       # x [rows, V], vals [rows, K], ge and eq [rows, chunks]
        x_ptr += row * V
        vals_ptr += row * K
        ge_ptr += row * tl.num_programs(0)
        eq_ptr += row * tl.num_programs(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        x = tl.load(x_ptr + offs, mask=inside, other=float("-inf"))
        kth = tl.load(vals_ptr + K - 1)
        tl.store(ge_ptr + pid, tl.sum((inside & (x >= kth)).to(tl.int32), axis=0))
        tl.store(eq_ptr + pid, tl.sum((inside & (x == kth)).to(tl.int32), axis=0))

    @triton.jit
    def _pick_kernel(x_ptr, q_ptr, vals_ptr, idx_ptr, ge_ptr, eq_ptr, best_ptr, arg_ptr, cut_ptr,
                     V, K, NCHUNK, cut, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                     TOP_K: tl.constexpr, TOP_P: tl.constexpr):
        pid = tl.program_id(0)
        row = tl.program_id(1)     # x, q [rows, V]; vals, idx [rows, K]; ge, eq, best, arg [rows, NCHUNK]; cut [rows, 2]
        x_ptr += row * V
        q_ptr += row * V
        vals_ptr += row * K
        idx_ptr += row * K
        ge_ptr += row * NCHUNK
        eq_ptr += row * NCHUNK
        best_ptr += row * NCHUNK
        arg_ptr += row * NCHUNK
        cut_ptr += row * 2
        m = tl.load(vals_ptr)                        # the largest x (vals = [max] with no warper on)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        inside = offs < V
        x = tl.load(x_ptr + offs, mask=inside, other=float("-inf"))
        q = tl.load(q_ptr + offs, mask=inside, other=1.0)
        if TOP_K:
            kth = tl.load(vals_ptr + K - 1)
            if TOP_P:
                c = tl.arange(0, BLOCK_C)
                n_ge = tl.sum(tl.load(ge_ptr + c, mask=c < NCHUNK, other=0), axis=0)
                extra = (n_ge - K).to(tl.float32)
                d = tl.arange(0, BLOCK_K)            # descending position of a survivor
                live = d < K
                vals = tl.load(vals_ptr + d, mask=live, other=float("-inf"))
                # ascending accumulation: the extra ties first, then the survivors from K - 1 down to 0
                e_asc = tl.flip(tl.where(live, tl.exp(vals - m), 0.0), 0)
                e_tie = tl.exp(kth - m)
                z = tl.sum(e_asc, axis=0) + extra * e_tie
                p_tie = e_tie / z
                cum = tl.cumsum(e_asc / z, axis=0) + extra * p_tie
                a = tl.arange(0, BLOCK_K)
                asc_live = a >= BLOCK_K - K          # the padding sits first after the flip
                n_vals = tl.sum((asc_live & (cum > cut)).to(tl.int32), axis=0)
                kept_extra = tl.minimum(tl.maximum(extra - tl.floor(cut / p_tie), 0.0), extra)
                kept_extra = tl.where(n_vals == K, kept_extra, 0.0).to(tl.int32)
                n_keep = tl.maximum(n_vals + kept_extra, 1)
                thr = tl.min(tl.where(d < tl.minimum(n_keep, K), vals, float("inf")), axis=0)
                n_tie = n_keep - tl.sum((live & (vals > thr)).to(tl.int32), axis=0)
                # ties with thr in later chunks: counted from the listed survivors when thr > kth (every
                # such tie is listed), from the chunk counts when thr == kth (the unlisted ties)
                idx = tl.load(idx_ptr + d, mask=live, other=0)
                later_listed = tl.sum((live & (vals == thr) & (idx >= (pid + 1) * BLOCK)).to(tl.int32), axis=0)
                eq = tl.load(eq_ptr + c, mask=(c > pid) & (c < NCHUNK), other=0)
                later = tl.where(thr == kth, tl.sum(eq, axis=0), later_listed)
                tie = inside & (x == thr)
                rank = tl.cumsum(tie.to(tl.int32), axis=0, reverse=True) + later   # ties at this id or after
                kept = inside & ((x > thr) | (tie & (rank <= n_tie)))
                if pid == 0:
                    tl.store(cut_ptr, thr)
                    tl.store(cut_ptr + 1, n_tie.to(tl.float32))
            else:
                kept = inside & (x >= kth)
        else:
            kept = inside
        score = tl.where(kept, tl.exp(x - m) / q, -1.0)
        best, arg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_ptr + pid, best)
        tl.store(arg_ptr + pid, pid * BLOCK + arg)

    @triton.jit
    def _final_kernel(best_ptr, arg_ptr, out_ptr, N, BLOCK: tl.constexpr):
        row = tl.program_id(1)                       # best, arg [rows, N]; out [rows]
        best_ptr += row * N
        arg_ptr += row * N
        out_ptr += row
        i = tl.arange(0, BLOCK)
        best = tl.load(best_ptr + i, mask=i < N, other=-2.0)
        j = tl.argmax(best, axis=0)
        tl.store(out_ptr, tl.load(arg_ptr + j).to(tl.int64))


PICK_BLOCK = 4096


def sample_device(x: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator | None,
                  block: int = PICK_BLOCK, radix: bool = True,
                  topk: Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw from x = logits / temperature [V] fp32 by the Triton kernels (top-k at most
    MAX_TRITON_K, or off with top_p == 1) -> (token, [thr, n_tie] of the top-p cut for the tests). The
    top-k by `topk` where given (torch.topk's contract: the k largest values, descending, and their ids),
    else by `topk_desc` (radix) or by torch.topk."""
    V = x.numel()
    k_on, p_on = 0 < top_k < V, top_p < 1.0
    if k_on:
        topk = topk or (topk_desc if radix else torch.topk)
        vals, idx = topk(x, top_k)
    else:
        vals, idx = x.max().view(1), x
    q = torch.empty_like(x).exponential_(1, generator=generator)
    out, cut = _pick_rows(x.view(1, V), q.view(1, V), vals, idx, top_k, top_p, block)
    return out[0], (cut[0] if k_on and p_on else cut)


def _pick_rows(x: torch.Tensor, q: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor, top_k: int, top_p: float,
               block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut and the draw of every row of x [rows, V] with its noise q [rows, V] and its top-k survivors
    vals, idx [rows, k] (contiguous; top-k off: vals = each row's max, idx unused), one program per chunk
    and row (the row is the grids' second axis) -> (tokens [rows], the cuts [rows, 2] (top-k and top-p on;
    else a scratch buffer))."""
    rows, V = x.shape
    k_on, p_on = 0 < top_k < V, top_p < 1.0
    K = top_k if k_on else 1
    n = triton.cdiv(V, block)
    ge = torch.empty((rows, n), dtype=torch.int32, device=x.device)
    eq = torch.empty((rows, n), dtype=torch.int32, device=x.device)
    if k_on and p_on:
        _count_kernel[(n, rows)](x, vals, ge, eq, V, K, BLOCK=block, num_warps=8)
    best = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    arg = torch.empty((rows, n), dtype=torch.int32, device=x.device)
    cut = torch.full((rows, 2), float("nan"), dtype=torch.float32, device=x.device) if k_on and p_on else best
    _pick_kernel[(n, rows)](x, q, vals, idx, ge, eq, best, arg, cut, V, K, n, 1 - top_p, BLOCK=block,
                            BLOCK_K=max(2, next_pow2(K)), BLOCK_C=max(2, next_pow2(n)), TOP_K=k_on,
                            TOP_P=k_on and p_on, num_warps=8)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    _final_kernel[(1, rows)](best, arg, out, n, BLOCK=max(2, next_pow2(n)), num_warps=4)
    return out, cut


def sample_rows_device(x: torch.Tensor, q: torch.Tensor, top_k: int, top_p: float, block: int = PICK_BLOCK,
                       chunk: int = TOPK_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_device of every row of x [rows, V] (contiguous, logits / temperature) with the noise q
    [rows, V] already drawn, one top-k and top-p for all rows (top-k by `topk_desc`) -> (tokens [rows],
    cuts [rows, 2] as sample_device's): each row's token and cut are the ones sample_device gives that row
    alone with that noise, the same programs running on it (the row is the grids' second axis)."""
    rows, V = x.shape
    if 0 < top_k < V:
        vals, idx = topk_desc(x, top_k, chunk=chunk)
    else:       # each row's max, the value x.max() gives it alone (a ±0 max: the same exp(x - m) either way)
        vals, idx = x.amax(-1, keepdim=True), x
    return _pick_rows(x, q, vals, idx, top_k, top_p, block)


def _device_fits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator, greedy: bool = False,
                 allowed: torch.Tensor | None = None, max_k: int = MAX_TRITON_K) -> bool:
    """One row, sampled (ratio tokens and greedy are one or two ops already, the reference's), with a
    top-k of at most `max_k` or none at all with top_p == 1 (top-p over the whole vocabulary sorts it:
    the reference)."""
    return logits.dim() == 1 and _batchable(logits.numel(), top_k, top_p, greedy, allowed, max_k)


@backend("sample", "triton", devices=("cuda",), dtypes=(torch.float32,), available=available,
         fits=lambda *a, **k: _device_fits(*a, **k, max_k=TOPK_TRITON_MAX_K))
def sample_triton(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None, greedy: bool = False,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    return sample_device(logits.contiguous() / temperature, top_k, top_p, generator)[0]


@backend("sample", "triton_torch_topk", devices=("cuda",), dtypes=(torch.float32,), available=available,
         fits=_device_fits)
def sample_triton_torch_topk(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                             generator: torch.Generator | None, greedy: bool = False,
                             allowed: torch.Tensor | None = None) -> torch.Tensor:
    return sample_device(logits.contiguous() / temperature, top_k, top_p, generator, radix=False)[0]


# ---- FlashInfer: its top-k in place of ours; the cut and the draw stay ours ------------------------------
#
# FlashInfer's own samplers (flashinfer.sampling.top_k_top_p_sampling_from_logits and kin) cannot keep this
# op's contract: they draw by rejection sampling from Philox streams keyed by (seed, offset, output row), so
# the same generator state gives another token than `choose`, a request's token changes with its batch
# slot (their docs: per-row seeds "do not make sampling invariant to batch position"), and their top-p keeps
# the head whose mass reaches p, ties unranked. Only the selection step is interchangeable: flashinfer.top_k
# (sorted, deterministic, ties to the lowest ids: torch.topk's values exactly) feeds the same cut and the
# same Exp(1) race from the request's generator, so the token is the reference's.
FLASHINFER_MAX_K = 2048    # its sorted deterministic top-k sorts on the device up to this k


def topk_flashinfer(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) of x [V] by flashinfer.top_k (values descending, ties at the k-th: lowest ids)."""
    fi = _flashinfer.lib()
    vals, idx = fi.top_k(x.view(1, -1), k, sorted=True, deterministic=True, tie_break=fi.TopKTieBreak.SMALL)
    return vals[0], idx[0]


def _flashinfer_fits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator,
                     greedy: bool = False, allowed: torch.Tensor | None = None) -> bool:
    """A top-k on (its step is the only one replaced) of at most FLASHINFER_MAX_K."""
    return 0 < top_k < logits.numel() and _device_fits(logits, temperature, top_k, top_p, generator, greedy,
                                                       allowed, max_k=FLASHINFER_MAX_K)


@backend("sample", _flashinfer.NAME, devices=("cuda",), dtypes=(torch.float32,),
         available=lambda: available() and _flashinfer.available(), fits=_flashinfer_fits)
def sample_flashinfer(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                      generator: torch.Generator | None, greedy: bool = False,
                      allowed: torch.Tensor | None = None) -> torch.Tensor:
    return sample_device(logits.contiguous() / temperature, top_k, top_p, generator, topk=topk_flashinfer)[0]


# ---- sample_rows: every row of a batched decode step in one call ----------------------------------------
#
# A `sample` call is ~30 small launches (~250-290 us of host time on one H200), once per row of a decode
# step. `sample_rows` takes the step's rows at once: each row keeps its own parameters and generator, and
# its token is the one `sample` gives it for the same generator state.
#
# Both variants group the rows by equal (temperature, top_k, top_p), draw each row's noise as its own [V]
# draw from its own generator, in row order, as the per-row loop draws it (rows sharing a generator advance
# it in the loop's order; the rows a variant does not take run `sample` in their place in that order), and
# divide a group's rows [b, V] by its temperature with the same scalar division as the per-row op.
#
# The batched variant then runs the reference's own steps (`warp`, softmax, the Exp(1) race) on [b, V]:
# every step is per row (the cut reads a row's own top-k values and counts, torch.topk's values are exact
# whatever the batch, the ties are ranked by id within the row). On the CPU each row's arithmetic is then
# the per-row reference's, bit for bit (the tests check it against `sample`, generator states included).
# It is not registered for CUDA: there `sample` runs the Triton variants, whose exp (ex2.approx) and sums
# round differently from torch's, so torch ops on [b, V] would pick another token near a tie of scores or at
# a cut moved by one token (the GPU test of `sample` allows its variants a few such misses against the
# reference), and CUDA's reductions and scans can change their thread layout with b, so a row's token could
# even depend on its batch.
#
# The triton_rows variant (CUDA) runs the `triton` variant's own kernels with the group's rows as their
# grids' second axis (`sample_rows_device`): each program reads its row at an offset and does exactly the
# arithmetic it does for that row alone (same BLOCK / CHUNK / BLOCK_K, warps and reduction shapes), so each
# row gets the token and cut of `sample_device`, bit for bit; a group costs the launches of one row. It
# takes exactly the rows `sample` gives its `triton` variant (radix top-k of at most TOPK_TRITON_MAX_K, or
# no warper); the others (greedy, ratio tokens, top-p over the whole vocabulary, a larger top-k, which
# `sample` gives torch.topk: its ids of ties may depend on the batch) run `sample` row by row. The group
# key holds the exact top_k and top_p because the kernels take them as scalars: their parameter lists are
# those of the one-row launch, which the sm_90 compile checks pin. Measured on the interpreter (the tests);
# it is the CUDA default because those tests prove the bits and its kernels compile for sm_90; the GPU
# test compares it with the per-row op at the model's vocabulary.

def _batchable(V: int, top_k: int, top_p: float, greedy: bool, allowed: torch.Tensor | None,
               max_k: int = MAX_TRITON_K) -> bool:
    """A row the batched paths take: sampled, with a top-k of at most max_k or no warper at all.
    Greedy and ratio-token rows are one op already; top-p over the whole vocabulary sorts it and sums V
    values, whose order differs between a row alone and a batch (threads split one row, not a batch)."""
    k_on = 0 < top_k < V
    return allowed is None and not greedy and (top_k <= max_k if k_on else top_p >= 1.0)


@reference("sample_rows")
def sample_rows_ref(logits: torch.Tensor, rows: Sequence[int], temperature: Sequence[float],
                    top_k: Sequence[int], top_p: Sequence[float], generators: Sequence[torch.Generator | None],
                    greedy: Sequence[bool], allowed: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """logits [N, V] fp32, the i-th sample read from row rows[i] with the i-th parameters -> tokens [B]
    long on the logits' device: the `sample` op row by row (whichever variant it picks)."""
    return torch.stack([call("sample", logits[r], *a)
                        for r, *a in zip(rows, temperature, top_k, top_p, generators, greedy, allowed)])


def sample_rows_grouped(logits: torch.Tensor, rows: Sequence[int], temperature: Sequence[float],
                        top_k: Sequence[int], top_p: Sequence[float], generators: Sequence[torch.Generator | None],
                        greedy: Sequence[bool], allowed: Sequence[torch.Tensor | None], max_k: int,
                        pick: Callable[[torch.Tensor, torch.Tensor, int, float], torch.Tensor]) -> torch.Tensor:
    """sample_rows by groups of equal (temperature, top_k, top_p) among the rows `_batchable` takes with
    `max_k`: pick(x [b, V] = the group's logits / temperature, noise [b, V], top_k, top_p) -> tokens [b];
    the other rows by `sample`, in row order with the noise draws."""
    V = logits.shape[-1]
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i in range(len(rows)):
        if _batchable(V, top_k[i], top_p[i], greedy[i], allowed[i], max_k):
            groups.setdefault((temperature[i], top_k[i], top_p[i]), []).append(i)
    noise = {key: torch.empty(len(members), V, dtype=logits.dtype, device=logits.device)
             for key, members in groups.items()}
    where = {i: (key, j) for key, members in groups.items() for j, i in enumerate(members)}
    tokens: list[torch.Tensor | None] = [None] * len(rows)
    # in row order: rows that share a generator (None: the default one) advance it as the per-row loop does
    for i, r in enumerate(rows):
        if i in where:
            key, j = where[i]
            noise[key][j].exponential_(1, generator=generators[i])   # a contiguous [V] row: _draw's values
        else:
            tokens[i] = call("sample", logits[r], temperature[i], top_k[i], top_p[i], generators[i], greedy[i],
                             allowed[i])
    for (t, k, p), members in groups.items():
        x = torch.stack([logits[rows[i]] for i in members]) / t
        for i, tok in zip(members, pick(x, noise[(t, k, p)], k, p).unbind()):
            tokens[i] = tok
    return torch.stack(tokens)


@backend("sample_rows", "triton_rows", devices=("cuda",), dtypes=(torch.float32,), available=available,
         fits=lambda logits, rows, *a: logits.dim() == 2 and len(rows) * logits.shape[-1] < 2 ** 31)
def sample_rows_triton(logits: torch.Tensor, rows: Sequence[int], temperature: Sequence[float],
                       top_k: Sequence[int], top_p: Sequence[float], generators: Sequence[torch.Generator | None],
                       greedy: Sequence[bool], allowed: Sequence[torch.Tensor | None], block: int | None = None,
                       chunk: int | None = None, max_k: int | None = None) -> torch.Tensor:
    """sample_rows_ref's tokens on CUDA (each row's `sample` with its default variants), a group of rows
    of equal settings in the launches of one row; block, chunk and max_k (PICK_BLOCK, TOPK_CHUNK,
    TOPK_TRITON_MAX_K: the `triton` variant's top-k limit) for the tests at a small vocabulary."""
    block, chunk = block or PICK_BLOCK, chunk or TOPK_CHUNK
    return sample_rows_grouped(logits, rows, temperature, top_k, top_p, generators, greedy, allowed,
                               max_k or TOPK_TRITON_MAX_K,
                               lambda x, q, k, p: sample_rows_device(x, q, k, p, block, chunk)[0])


@backend("sample_rows", "batched", devices=("cpu",), dtypes=(torch.float32,))
def sample_rows_batched(logits: torch.Tensor, rows: Sequence[int], temperature: Sequence[float],
                        top_k: Sequence[int], top_p: Sequence[float], generators: Sequence[torch.Generator | None],
                        greedy: Sequence[bool], allowed: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """sample_rows_ref's tokens with a fixed number of launches per group of equal settings, plus one noise
    draw per row; the other rows (greedy, ratio tokens, top-p over the whole vocabulary) by `sample`."""
    return sample_rows_grouped(logits, rows, temperature, top_k, top_p, generators, greedy, allowed, MAX_TRITON_K,
                               lambda x, q, k, p: (warp(x, k, p).softmax(-1) / q).argmax(-1))
