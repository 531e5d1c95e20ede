"""The AR decode step's attention at the real shapes: the `decode_attention` op (Triton split-KV, the
length on the device) vs what the engine ran before it (SDPA over the whole static cache under a bool
mask, position-independent for the CUDA graph) and vs unmasked SDPA on the exact valid slice (what a
host-known length would allow; not graph-capturable across positions).

    python bench/bench_decode_attention.py                  # one H200: well under a minute
    python bench/bench_decode_attention.py --dry            # CPU, Triton interpreter, tiny shapes

--decode-attn (the default and only section): q [1, 32, 1, 128], cache [1, 8, L, 128] bf16 (tp1;
Hq 8 / Hkv 2 for tp4), L in (2017, 8192), valid lengths 1251 and 2000. Each fast path is first checked
against an fp32 softmax on the valid slice, its output drawn from 0xFF-filled (NaN) memory. Times are
medians of triton.testing.do_bench (L2 flushed between calls: the cache is read from HBM, as in
decode where 32 layers' caches do not fit L2); `graph` is the op replayed from a CUDA graph of 32
calls on 32 distinct layer caches, per call (what the decode loop pays, launch gaps included).
GB/s counts the floor, K and V of the valid prefix read once (2 * Hkv * length * D * 2 bytes), and
`floor` its fraction of the ~4.3 TB/s copy rate. A chunk sweep shows the split size's effect.
Details go to $OUT/decode_attention.json if set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before Triton is imported

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                   # noqa: E402
from kernels import decode_attention as da       # noqa: E402
from graph_timing import graph_replay_ms         # noqa: E402

FLOOR_GBS = 4300.0
D = 128


def naive(q, k, v, n):
    """fp32 softmax attention on keys [0, n) (T = 1), GQA by repeat."""
    G = q.shape[1] // k.shape[1]
    kk = k[:, :, :n].float().repeat_interleave(G, 1)
    vv = v[:, :, :n].float().repeat_interleave(G, 1)
    return ((q.float() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])).softmax(-1) @ vv


def poison(nbytes: int, device) -> None:
    """0xFF (NaN in every float dtype) into freed allocator blocks the op's outputs will reuse."""
    bufs = [torch.full((n,), 255, dtype=torch.uint8, device=device) for n in (nbytes, nbytes * 4)]
    del bufs


def check(Hq, Hkv, L, n, dt, device, seed) -> dict:
    g = torch.Generator(device).manual_seed(seed)
    q = torch.randn(1, Hq, 1, D, generator=g, device=device).to(dt)
    k = torch.randn(1, Hkv, L, D, generator=g, device=device).to(dt)
    v = torch.randn(1, Hkv, L, D, generator=g, device=device).to(dt)
    want = naive(q, k, v, n)
    poison(Hq * D * 2 + Hkv * (L // da.CHUNK + 1) * (Hq // Hkv) * D * 4, device)
    out = kernels.call("decode_attention", q, k, v, torch.tensor([n], device=device))
    err = (out.float() - want).abs().max().item()
    ok = bool(torch.isfinite(out).all()) and err < 2e-2
    return dict(Hq=Hq, Hkv=Hkv, L=L, length=n, max_abs_err=err, ok=ok)


def bench_time(fn) -> float:
    import triton
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3     # us


def graph_time(make_call, layers: int = 32) -> float:
    """us per call of `layers` calls replayed from one CUDA graph (each on its own layer's cache)."""
    return graph_replay_ms([make_call(i) for i in range(layers)]) * 1e3 / layers


def time_shape(Hq: int, Hkv: int, L: int, dt: torch.dtype, device: str, layers: int = 32) -> list[dict]:
    """The three attentions at one shape and the lengths 1251 / 2000, plus the op's chunk sweep."""
    ks = [torch.randn(1, Hkv, L, D, device=device, dtype=dt) for _ in range(layers)]
    vs = [torch.randn(1, Hkv, L, D, device=device, dtype=dt) for _ in range(layers)]
    q = torch.randn(1, Hq, 1, D, device=device, dtype=dt)
    rows = []
    for n in (1251, 2000):
        length = torch.tensor([n], device=device)
        mask = torch.arange(L, device=device)[None, :] < n          # [1, L]: the decode mask before the op
        floor_bytes = 2 * Hkv * n * D * 2

        def op(i, length=length):
            return lambda: kernels.call("decode_attention", q, ks[i], vs[i], length)

        def masked(i, mask=mask):
            return lambda: F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=mask, enable_gqa=True)

        def sliced(i, n=n):
            return lambda: F.scaled_dot_product_attention(q, ks[i][:, :, :n], vs[i][:, :, :n], enable_gqa=True)

        def row(impl, us, gus):
            return dict(Hq=Hq, Hkv=Hkv, L=L, length=n, impl=impl, us=us, graph_us=gus,
                        GBs=floor_bytes / us / 1e3, floor=floor_bytes / us / 1e3 / FLOOR_GBS)
        for name, make in (("triton", op), ("sdpa_masked_whole", masked), ("sdpa_slice", sliced)):
            rows.append(row(name, bench_time(make(0)), graph_time(make, layers)))
        for chunk in (32, 128, 256):            # the split size (the module's CHUNK is the default)
            rows.append(row(f"triton chunk {chunk}",
                            bench_time(lambda c=chunk: da.launch(q, ks[0], vs[0], length, chunk=c)), float("nan")))
    return rows


def decode_attn(dry: bool) -> tuple[list[dict], list[dict]]:
    device = "cpu" if dry else "cuda"
    dt = torch.bfloat16
    if not dry:
        assert kernels.chosen("decode_attention", "cuda", dt) == "triton", "the Triton backend is not chosen"
    shapes = [(8, 2, 130, (1, 77, 130))] if dry else [
        (Hq, Hkv, L, (1, 1251, 2000, 2017) if L == 2017 else (1, 1251, 2000, 8192))
        for Hq, Hkv in ((32, 8), (8, 2)) for L in (2017, 8192)]
    checks = []
    for i, (Hq, Hkv, L, lengths) in enumerate(shapes):
        for n in lengths:
            if dry:
                from kernels._triton import prepare_interpreter
                prepare_interpreter()
                q, k, v = (torch.randn(1, h, s, D).to(dt) for h, s in ((Hq, 1), (Hkv, L), (Hkv, L)))
                out = da.launch(q, k, v, torch.tensor([n]))
                err = (out.float() - naive(q, k, v, n)).abs().max().item()
                checks.append(dict(Hq=Hq, Hkv=Hkv, L=L, length=n, max_abs_err=err,
                                   ok=bool(torch.isfinite(out).all()) and err < 2e-2))
            else:
                checks.append(check(Hq, Hkv, L, n, dt, device, seed=1000 * i + n))
    if dry:
        return checks, []

    rows = []
    for Hq, Hkv in ((32, 8), (8, 2)):
        for L in (2017, 8192):
            rows += time_shape(Hq, Hkv, L, dt, device)
    return checks, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-attn", action="store_true", help="the decode attention section (the default)")
    ap.add_argument("--dry", action="store_true", help="CPU, Triton interpreter, tiny shapes, no timing")
    args = ap.parse_args()
    t0 = time.perf_counter()
    checks, rows = decode_attn(args.dry)
    bad = [c for c in checks if not c["ok"]]
    for c in checks:
        print(f"check Hq {c['Hq']:2d} Hkv {c['Hkv']} L {c['L']:5d} length {c['length']:5d}: "
              f"max |err| {c['max_abs_err']:.2e} {'ok' if c['ok'] else 'FAIL'}")
    if rows:
        print(f"\n{'Hq/Hkv':>6} {'L':>5} {'len':>5} {'impl':<20} {'ms':>8} {'graph ms':>9} {'GB/s':>7} {'floor':>6}")
        for r in rows:
            print(f"{r['Hq']:>3}/{r['Hkv']:<2} {r['L']:>5} {r['length']:>5} {r['impl']:<20} {r['us'] / 1e3:8.4f} "
                  f"{r['graph_us'] / 1e3:9.4f} {r['GBs']:7.0f} {r['floor']:6.1%}")
    print(f"\n{len(checks) - len(bad)}/{len(checks)} checks ok, {time.perf_counter() - t0:.1f} s")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "decode_attention.json").write_text(json.dumps(dict(checks=checks, rows=rows), indent=1))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
