"""Next-token sampling on the device without sorting the vocabulary.

The distribution is the engine's `choose` (the HF warpers in order): logits / temperature, keep the
top_k largest (every token tied with the k-th value too), then keep the most likely survivors whose
accumulated probability, summed from the least likely up as `choose` does, exceeds 1 - top_p (the most
likely token always stays), then one seeded draw. `choose` sorts all V = 133120 logits for the top-p
step; here only the k survivors of a top-k are in order (torch.topk returns them sorted), and the top-p
cut becomes a value `thr` and a count: kept = {x > thr} and the `n_tie` highest-id tokens with x == thr.

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

import torch

from ._triton import HAS_TRITON, available, next_pow2, tl, triton
from .registry import backend, reference

MAX_TRITON_K = 4096        # the top-p cut runs in one block of the sorted survivors


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One sample of `probs` [V] as torch.multinomial(probs, 1) takes it (same noise, same token)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax()


def cut_ref(x: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The top-k then top-p kept set of x [V] as (thr, n_tie): kept = {x > thr} plus the n_tie highest-id
    tokens with x == thr (n_tie None: every tie is kept). None when neither warper is on. 0-d tensors."""
    V = x.numel()
    k_on, p_on = 0 < top_k < V, top_p < 1.0
    if not (k_on or p_on):
        return None
    if k_on:
        vals = x.topk(top_k).values                  # descending; the only selection over V
        kth = vals[-1]
        if not p_on:
            return kth, None
        # tokens tied with the k-th value beyond the k returned survive top-k too (`x >= kth`); they are
        # the least likely survivors, the first ones of the ascending accumulation
        extra = (x >= kth).sum() - top_k
    else:
        vals = x.sort(descending=True).values        # top-k disabled: the whole vocabulary, sorted
        kth, extra = vals[-1], torch.zeros((), dtype=torch.long, device=x.device)
    K = vals.numel()
    cut = 1 - top_p
    m = vals[0]
    e = (vals.flip(0) - m).exp()                     # ascending
    e_tie = (kth - m).exp()
    z = e.sum() + extra * e_tie
    p_tie = e_tie / z
    cum = (e / z).cumsum(0) + extra * p_tie
    n_vals = (cum > cut).sum()                       # a suffix of the ascending survivors
    # the extra ties are kept only if every listed survivor is: the j-th of them has accumulated j * p_tie
    # (clamp with a tensor bound reads it back on the host: minimum/clamp_min keep it on the device)
    kept_extra = torch.where(n_vals == K, torch.minimum((extra - torch.floor(cut / p_tie)).clamp_min(0),
                                                        extra.to(p_tie.dtype)), 0).long()
    n_keep = (n_vals + kept_extra).clamp(min=1)
    thr = vals.index_select(0, (n_keep.clamp(max=K) - 1).view(1))[0]
    return thr, n_keep - (vals > thr).sum()          # every x > thr >= kth is a listed survivor


def kept_mask(x: torch.Tensor, thr: torch.Tensor, n_tie: torch.Tensor | None) -> torch.Tensor:
    """The kept set of a cut as a bool mask over x [V]."""
    if n_tie is None:
        return x >= thr
    tie = x == thr
    later = tie.flip(0).cumsum(0).flip(0)            # ties at this id or after it
    return (x > thr) | (tie & (later <= n_tie))


@reference("sample")
def sample_ref(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None, greedy: bool = False,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] fp32 -> token id (0-d long tensor on the logits' device).

    `allowed` (ids) restricts the choice and forces greedy (the ratio tokens, as the official
    processor does). Branches only on the request's parameters, never on the logits.
    """
    if allowed is not None:
        return allowed[logits.index_select(0, allowed).argmax()]
    if greedy:
        return logits.argmax()
    x = logits / temperature
    c = cut_ref(x, top_k, top_p)
    if c is not None:
        x = x.masked_fill(~kept_mask(x, *c), float("-inf"))
    return _draw(x.softmax(-1), generator)


# ---- CUDA: torch.topk (the k survivors, sorted) + three small Triton kernels ---------------------------
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
        i = tl.arange(0, BLOCK)
        best = tl.load(best_ptr + i, mask=i < N, other=-2.0)
        j = tl.argmax(best, axis=0)
        tl.store(out_ptr, tl.load(arg_ptr + j).to(tl.int64))


PICK_BLOCK = 4096


def sample_device(x: torch.Tensor, top_k: int, top_p: float, generator: torch.Generator | None,
                  block: int = PICK_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw from x = logits / temperature [V] fp32 by the Triton kernels (top-k at most
    MAX_TRITON_K, or off with top_p == 1) -> (token, [thr, n_tie] of the top-p cut for the tests)."""
    V = x.numel()
    k_on, p_on = 0 < top_k < V, top_p < 1.0
    if k_on:
        vals, idx = x.topk(top_k)
        K = top_k
    else:
        vals, idx, K = x.max().view(1), x, 1
    q = torch.empty_like(x).exponential_(1, generator=generator)
    n = triton.cdiv(V, block)
    ge = torch.empty(n, dtype=torch.int32, device=x.device)
    eq = torch.empty(n, dtype=torch.int32, device=x.device)
    if k_on and p_on:
        _count_kernel[(n,)](x, vals, ge, eq, V, K, BLOCK=block, num_warps=8)
    best = torch.empty(n, dtype=torch.float32, device=x.device)
    arg = torch.empty(n, dtype=torch.int32, device=x.device)
    cut = torch.full((2,), float("nan"), dtype=torch.float32, device=x.device) if k_on and p_on else best
    _pick_kernel[(n,)](x, q, vals, idx, ge, eq, best, arg, cut, V, K, n, 1 - top_p, BLOCK=block,
                       BLOCK_K=max(2, next_pow2(K)), BLOCK_C=max(2, next_pow2(n)), TOP_K=k_on, TOP_P=k_on and p_on,
                       num_warps=8)
    out = torch.empty((), dtype=torch.long, device=x.device)
    _final_kernel[(1,)](best, arg, out, n, BLOCK=max(2, next_pow2(n)), num_warps=4)
    return out, cut


@backend("sample", "triton", devices=("cuda",), dtypes=(torch.float32,), available=available)
def sample_triton(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  generator: torch.Generator | None, greedy: bool = False,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    V = logits.numel()
    k_on = 0 < top_k < V
    if allowed is not None or greedy or logits.dim() != 1 or (top_p < 1.0 and not k_on) \
            or (k_on and top_k > MAX_TRITON_K):
        # ratio tokens / greedy are one or two ops already; top-p over the whole vocabulary sorts it
        return sample_ref(logits, temperature, top_k, top_p, generator, greedy, allowed)
    return sample_device(logits.contiguous() / temperature, top_k, top_p, generator)[0]
