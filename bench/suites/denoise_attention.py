"""The denoise step's attention at one hybrid4 rank's real shapes: which SDPA form runs it fastest.

    python -m bench denoise-attention            # one H200: well under a minute
    python -m bench denoise-attention --dry      # CPU, tiny shapes, fp32 (the checks only)

One rank of TP2 x SP2 (Ulysses) with CFG batched: q [2, 8, S, 128] (S = the image rows of both SP
ranks), K/V the first kv_len positions of the static cache [2, 2, max_len, 128] (GQA 4), bf16, every
image row unmasked. T2I: S 4098, kv_len 6102; TI2I: S 4098, kv_len 10851. The forms:
  gqa        what the engine runs: SDPA(q, k, v, enable_gqa=True) on the cache views
  folded     the 4 query heads of a KV head folded into the sequence, q [2, 2, 4*S, 128]: plain
             attention, exact because no image row is masked (a view in and out, no copy)
  keymask    what the engine runs since the denoise step key left out the prompt length: `folded` over
             kv_len + GAP keys, GAP of them (between the prefix and the image rows' own keys) hidden by
             an additive key mask [B, 1, 1, keys] (engine/runtime/denoise.py `tail_index`: up to 511)
  + a backend forced (cudnn / flash / efficient) where it accepts the form
  meta       the 3 causal meta rows again under their bool mask (what a step adds per layer)
The Ulysses layout copies around it (q of [2, 16, 2049, 128] and k/v of [2, 4, 2049, 128] from sequence
shards to head shards, the output back) are timed as the engine writes them (a permute then reshape)
and as a concatenation of the SP chunks (one batched copy kernel), with the GB/s they reach.
Each form is first checked against fp32 attention (GQA by repeat) on the same inputs; times are medians
of triton.testing.do_bench. TFLOP/s counts 4 * B * Hq * S * kv_len * D.
"""
from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..report import Col, Output
from ..timing import time_ms

DRY = True
D = 128
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    pass


def gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def folded(q, k, v):
    """Query heads of one KV head folded into the sequence: [B, Hq, S, D] -> [B, Hkv, g*S, D] (a view)."""
    B, Hq, S, _ = q.shape
    return F.scaled_dot_product_attention(q.reshape(B, k.shape[1], -1, D), k, v).view(B, Hq, S, D)


GAP = 256          # hidden keys of the keymask form: half the engine's TAIL_GRAIN, its mean gap


def keymask(q, k, v, mask):
    """`folded` under a key mask [B, 1, 1, keys] (additive), broadcast over the heads and query rows."""
    B, Hq, S, _ = q.shape
    return F.scaled_dot_product_attention(q.reshape(B, k.shape[1], -1, D), k, v, attn_mask=mask).view(B, Hq, S, D)


def reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.float().repeat_interleave(g, 1) for t in (k, v))
    return torch.softmax(q.float() @ kk.transpose(-1, -2) / D ** 0.5, -1) @ vv


def forms(name: str, S: int, kv_len: int, device: str, dt: torch.dtype, timer, rows: list) -> None:
    g = torch.Generator(device).manual_seed(0)
    max_len = (kv_len + 1023) // 1024 * 1024
    q = torch.randn(2, 8, S, D, generator=g, device=device).to(dt)
    cache_k = torch.randn(2, 2, max_len, D, generator=g, device=device).to(dt)
    cache_v = torch.randn(2, 2, max_len, D, generator=g, device=device).to(dt)
    k, v = cache_k[:, :, :kv_len], cache_v[:, :, :kv_len]
    ref = reference(q, k, v)
    flop = 4 * 2 * 8 * S * kv_len * D
    # the keymask form: the same valid keys as k/v with GAP random keys hidden before the last S (the image's own)
    keys = torch.arange(kv_len + GAP, device=device)
    valid = (keys < kv_len - S) | (keys >= kv_len - S + GAP)
    hidden = torch.zeros(2, 1, 1, kv_len + GAP, dtype=dt, device=device).masked_fill_(~valid, float("-inf"))
    kg, vg = (torch.randn(2, 2, kv_len + GAP, D, generator=g, device=device).to(dt) for _ in range(2))
    kg[:, :, valid], vg[:, :, valid] = k, v
    masked = lambda q, k, v: keymask(q, kg, vg, hidden)    # noqa: E731 - the same valid keys as k, v
    for form, fn in (("gqa", gqa), ("folded", folded), ("keymask", masked)):
        for bname, b in BACKENDS.items():
            try:
                with sdpa_kernel([b]) if b is not None else contextlib.nullcontext():
                    out = fn(q, k, v)
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        raise AssertionError(f"{form}/{bname}: max rel error {err:.3g}")
                    ms = timer(lambda: fn(q, k, v))
            except RuntimeError as e:        # a backend that refuses the form
                rows.append(dict(case=name, form=form, backend=bname, why=str(e).splitlines()[0][:80]))
                continue
            rows.append(dict(case=name, form=form, backend=bname, ms=ms, rate=flop / ms / 1e9, unit="TFLOP/s", err=err))
    qm = q[:, :, :3]                          # the meta rows: 3 queries under a bool mask over every key
    mask = torch.ones(3, kv_len, dtype=torch.bool, device=device).tril(kv_len - 3)
    add = torch.zeros(3, kv_len, dtype=dt, device=device).masked_fill_(~mask, float("-inf"))
    for what, m in (("bool mask", mask), ("additive", add)):
        rows.append(dict(case=name, form=f"meta (3 rows, {what})", backend="default",
                         ms=timer(lambda m=m: F.scaled_dot_product_attention(qm, k, v, attn_mask=m, enable_gqa=True))))


def copies(device: str, dt: torch.dtype, timer, rows: list, T: int = 2049) -> None:
    """The exchange's layout copies at one rank's shapes, T local tokens (the exchange itself is a no-op
    here)."""
    sp, B = 2, 2

    def add(form: str, fn, moved: int) -> None:
        ms = timer(fn)
        rows.append(dict(case="copy", form=form, backend="", ms=ms, rate=moved / ms / 1e6, unit="GB/s"))
    for what, h in (("q", 16), ("k/v", 4)):
        x = torch.randn(sp, B, h // sp, T, D, device=device).to(dt)    # what all_to_all returns
        permute = lambda: x.permute(1, 2, 0, 3, 4).reshape(B, h // sp, sp * T, D)   # noqa: E731
        cat = lambda: torch.cat(x.unbind(0), dim=2)                                   # noqa: E731
        assert torch.equal(permute(), cat())
        for form, fn in (("permute+reshape", permute), ("cat of chunks", cat)):
            add(f"{what} seq->heads {form}", fn, 2 * x.numel() * x.element_size())
    o = torch.randn(sp, B, 8, T, D, device=device).to(dt)              # out after the return exchange
    add("out heads->tokens permute", lambda: o.permute(1, 3, 0, 2, 4).reshape(B, T, sp * 8 * D),
        2 * o.numel() * o.element_size())
    out = torch.randn(B, 8, sp * T, D, device=device).to(dt)          # attention's output, before the exchange
    send = lambda: out.view(B, 8, sp, T, D).permute(2, 0, 1, 3, 4).contiguous()     # noqa: E731
    stack = lambda: torch.stack(out.split(T, dim=2))                                 # noqa: E731
    assert torch.equal(send(), stack())
    for form, fn in (("permute.contiguous", send), ("stack of chunks", stack)):
        add(f"out send buffer {form}", fn, 2 * out.numel() * out.element_size())


def run(args: argparse.Namespace, out: Output) -> bool:
    rows: list[dict] = []
    if args.dry:
        def timer(fn):
            return time_ms(fn, "wall", n=1, warmup=0)
        forms("tiny", 64, 200, "cpu", torch.float32, timer, rows)
        copies("cpu", torch.float32, timer, rows, T=33)
    else:
        def timer(fn):
            return time_ms(fn, "bench")
        for name, S, kv_len in (("T2I", 4098, 6102), ("TI2I", 4098, 10851)):
            forms(name, S, kv_len, "cuda", torch.bfloat16, timer, rows)
        copies("cuda", torch.bfloat16, timer, rows)
    out.data["rows"] = rows
    out.table(rows, [Col("case", "case"), Col("form", "form"), Col("backend", "backend"), Col("ms", "ms", ".3f"),
                     Col("rate", "rate", ".0f"), Col("unit", "unit"), Col("why not", "why")])
    return True
