"""The denoise step's attention at one hybrid4 rank's real shapes: which SDPA form runs it fastest.

    python bench/bench_denoise_attention.py            # one H200: well under a minute
    python bench/bench_denoise_attention.py --dry      # CPU, tiny shapes (the checks only)

One rank of TP2 x SP2 (Ulysses) with CFG batched: q [2, 8, S, 128] (S = the image rows of both SP
ranks), K/V the first kv_len positions of the static cache [2, 2, max_len, 128] (GQA 4), bf16, every
image row unmasked. T2I: S 4098, kv_len 6102; TI2I: S 4098, kv_len 10851. The forms:
  gqa        what the engine runs: SDPA(q, k, v, enable_gqa=True) on the cache views
  folded     the 4 query heads of a KV head folded into the sequence, q [2, 2, 4*S, 128]: plain
             attention, exact because no image row is masked (a view in and out, no copy)
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
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

D = 128
BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def folded(q, k, v):
    """Query heads of one KV head folded into the sequence: [B, Hq, S, D] -> [B, Hkv, g*S, D] (a view)."""
    B, Hq, S, _ = q.shape
    out = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], -1, D), k, v)
    return out.view(B, Hq, S, D)


def reference(q, k, v):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.float().repeat_interleave(g, 1) for t in (k, v))
    return torch.softmax(q.float() @ kk.transpose(-1, -2) / D ** 0.5, -1) @ vv


def run(name: str, S: int, kv_len: int, device: str, dt: torch.dtype, timer, rows: list) -> None:
    g = torch.Generator(device).manual_seed(0)
    max_len = (kv_len + 1023) // 1024 * 1024
    q = torch.randn(2, 8, S, D, generator=g, device=device).to(dt)
    cache_k = torch.randn(2, 2, max_len, D, generator=g, device=device).to(dt)
    cache_v = torch.randn(2, 2, max_len, D, generator=g, device=device).to(dt)
    k, v = cache_k[:, :, :kv_len], cache_v[:, :, :kv_len]
    ref = reference(q, k, v)
    flop = 4 * 2 * 8 * S * kv_len * D
    for form, fn in (("gqa", gqa), ("folded", folded)):
        for bname, b in BACKENDS.items():
            try:
                with sdpa_kernel([b]) if b is not None else _null():
                    out = fn(q, k, v)
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    if not err < 2e-2:
                        raise AssertionError(f"{form}/{bname}: max rel error {err:.3g}")
                    ms = timer(lambda: fn(q, k, v))
            except RuntimeError as e:        # a backend that refuses the form
                rows.append(dict(case=name, form=form, backend=bname, ms=None, why=str(e).splitlines()[0][:80]))
                continue
            rows.append(dict(case=name, form=form, backend=bname, ms=ms, tflops=flop / ms / 1e9, err=err))
    # the meta rows: 3 queries under a bool mask over every key
    qm = q[:, :, :3]
    mask = torch.ones(3, kv_len, dtype=torch.bool, device=device).tril(kv_len - 3)
    ms = timer(lambda: F.scaled_dot_product_attention(qm, k, v, attn_mask=mask, enable_gqa=True))
    rows.append(dict(case=name, form="meta (3 rows, bool mask)", backend="default", ms=ms, tflops=None))
    add = torch.zeros(3, kv_len, dtype=dt, device=device).masked_fill_(~mask, float("-inf"))
    ms = timer(lambda: F.scaled_dot_product_attention(qm, k, v, attn_mask=add, enable_gqa=True))
    rows.append(dict(case=name, form="meta (3 rows, additive)", backend="default", ms=ms, tflops=None))


def copies(device: str, dt: torch.dtype, timer, rows: list) -> None:
    """The exchange's layout copies at one rank's shapes (the exchange itself is a no-op here)."""
    sp, B, T = 2, 2, 2049
    for what, h in (("q", 16), ("k/v", 4)):
        x = torch.randn(sp, B, h // sp, T, D, device=device).to(dt)    # what all_to_all returns
        permute = lambda: x.permute(1, 2, 0, 3, 4).reshape(B, h // sp, sp * T, D)
        cat = lambda: torch.cat(x.unbind(0), dim=2)
        assert torch.equal(permute(), cat())
        for form, fn in (("permute+reshape", permute), ("cat of chunks", cat)):
            ms = timer(fn)
            rows.append(dict(case="copy", form=f"{what} seq->heads {form}", backend="", ms=ms,
                             gbs=2 * x.numel() * x.element_size() / ms / 1e6))
    o = torch.randn(sp, B, 8, T, D, device=device).to(dt)              # out after the return exchange
    tok = lambda: o.permute(1, 3, 0, 2, 4).reshape(B, T, sp * 8 * D)
    ms = timer(tok)
    rows.append(dict(case="copy", form="out heads->tokens permute", backend="", ms=ms,
                     gbs=2 * o.numel() * o.element_size() / ms / 1e6))
    out = torch.randn(B, 8, sp * T, D, device=device).to(dt)          # attention's output, before the exchange
    send = lambda: out.view(B, 8, sp, T, D).permute(2, 0, 1, 3, 4).contiguous()
    stack = lambda: torch.stack(out.split(T, dim=2))
    assert torch.equal(send(), stack())
    for form, fn in (("permute.contiguous", send), ("stack of chunks", stack)):
        ms = timer(fn)
        rows.append(dict(case="copy", form=f"out send buffer {form}", backend="", ms=ms,
                         gbs=2 * out.numel() * out.element_size() / ms / 1e6))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes: the checks only")
    args = ap.parse_args()
    rows: list[dict] = []
    if args.dry:
        def timer(fn):
            fn()
            return 1.0
        run("tiny", 64, 200, "cpu", torch.float32, timer, rows)
        copies("cpu", torch.float32, timer, rows)
    else:
        import triton.testing
        def timer(fn):
            return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
        for name, S, kv_len in (("T2I", 4098, 6102), ("TI2I", 4098, 10851)):
            run(name, S, kv_len, "cuda", torch.bfloat16, timer, rows)
        copies("cuda", torch.bfloat16, timer, rows)
    print(f"{'case':6} {'form':36} {'backend':9} {'ms':>8} {'TFLOP/s or GB/s':>8}")
    for r in rows:
        ms = f"{r['ms']:8.3f}" if r["ms"] is not None else "   -    "
        tf = f"{r['tflops']:8.0f}" if r.get("tflops") else (f"{r['gbs']:8.0f}" if r.get("gbs") else "")
        print(f"{r['case']:6} {r['form']:36} {r['backend']:9} {ms} {tf} {r.get('why', '')}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "denoise_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
