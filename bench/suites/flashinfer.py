"""Our kernels and FlashInfer's side by side, per op, at the engine's shapes: each op's `flashinfer`
variant (kernels/_flashinfer.py) against the variant the registry picks today, both checked against the
reference first, timed eager (CUDA events around back-to-back calls, launches included) and replayed
from a CUDA graph of 20 calls (what the captured decode loop pays).

    bash bench/device_run.sh flashinfer      # the GPU machine: installs the carried FlashInfer, then this
    python -m bench flashinfer               # one H200 with FlashInfer 0.7 importable
    python -m bench flashinfer --dry         # CPU, tiny shapes, our side only: the suite runs

Rows: rms_norm and add_rms_norm at decode (1, 4, 16 rows) and prefill / denoise sizes (1251, 4098 rows) of
hidden 4096; decode_attention at 1, 4, 16 rows of 2001 keys (a 1251-token prompt + 750 CoT tokens) in a
2048-key cache, 32 query / 8 KV heads of 128; `sample` (one row, V 133120, top-k 1024). Beside them, for
scale, what the op contracts rule out: FlashInfer's in-place fused add + RMSNorm, and its own batched
sampler (one call for all rows, its own RNG) against our one-row op called once a row. `first call s`:
the first call of each FlashInfer family in this process (its JIT compile where the cache is cold).
Not here: RoPE (ours fuses the q/k norm and the cache write, FlashInfer's rotates only) and the CUTLASS
fused MoE (its JIT build outlasted two 9-minute calls, issue 32).
Writes flashinfer.json, flashinfer.txt and flashinfer.md (the markdown table for docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import time

import torch

import kernels
from kernels import _flashinfer, decode_attention as da, norm, sampling

from .. import variants
from ..report import Col, Output
from .kernels_ops import us, verdict

DRY = True
EPS = 1e-5
HIDDEN, VOCAB, HQ, HKV, HEAD_DIM = 4096, 133120, 32, 8, 128
NORM_ROWS = (1, 4, 16, 1251, 4098)
DECODE_ROWS = (1, 4, 16)
CACHE, KEYS = 2048, 1251 + 750
FI = _flashinfer.NAME


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seeds", type=int, default=20, help="draws compared with the reference per sample case")


def _first_call(first: dict, family: str, fn) -> None:
    """Time the first FlashInfer call of a family (its JIT build on a cold cache)."""
    if family in first:
        return
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first[family] = time.perf_counter() - t0


def _pair(rows: list, op: str, shape: str, ours: str, args: tuple, want, dt, fi_on: bool, graph: bool = True,
          check=verdict) -> None:
    """One row: the registry's pick (`ours`) and the flashinfer variant on the same arguments."""
    mine = variants.runner(op, ours, *args, direct=True)
    r = dict(op=op, shape=shape, ours=ours, ours_check=check(mine(), want, dt), ours_us=us(mine, "events"),
             ours_graph_us=us(mine, "graph") if graph else None)
    if fi_on:
        theirs = variants.runner(op, FI, *args, direct=True)
        r.update(fi_check=check(theirs(), want, dt), fi_us=us(theirs, "events"),
                 fi_graph_us=us(theirs, "graph") if graph else None)
    rows.append(r)


def norms(rows: list, dev: str, H: int, sizes: tuple, fi_on: bool, first: dict) -> None:
    dt = torch.bfloat16
    g = torch.Generator(dev).manual_seed(0)
    w = (torch.randn(H, generator=g, device=dev) * 0.2 + 1).to(dt)
    for n in sizes:
        x = torch.randn(n, H, generator=g, device=dev).to(dt)
        r = torch.randn(n, H, generator=g, device=dev).to(dt)
        if fi_on:
            _first_call(first, "norm", lambda: norm.rms_norm_flashinfer(x, w, EPS))
        _pair(rows, "rms_norm", f"{n}x{H}", "triton", (x, w, EPS), norm.rms_norm_ref(x, w, EPS), dt, fi_on)
        _pair(rows, "add_rms_norm", f"{n}x{H}", "triton", (x, r, w, EPS), norm.add_rms_norm_ref(x, r, w, EPS), dt,
              fi_on)
        if fi_on:      # the in-place kernel on its own buffers (the values drift; the time does not)
            xi, ri = x.clone(), r.clone()
            inplace = lambda: _flashinfer.lib().norm.fused_add_rmsnorm(xi, ri, w, EPS)  # noqa: E731
            rows.append(dict(op="fused_add_rmsnorm in place (not the op's contract)", shape=f"{n}x{H}",
                             fi_us=us(inplace, "events"), fi_graph_us=us(inplace, "graph")))


def decodes(rows: list, dev: str, sizes: tuple, L: int, keys: int, Hq: int, Hkv: int, D: int, fi_on: bool,
            first: dict) -> None:
    dt = torch.bfloat16
    g = torch.Generator(dev).manual_seed(1)
    for B in sizes:
        q = torch.randn(B, Hq, 1, D, generator=g, device=dev).to(dt)
        k = torch.randn(B, Hkv, L, D, generator=g, device=dev).to(dt)
        v = torch.randn(B, Hkv, L, D, generator=g, device=dev).to(dt)
        length = torch.full((B,), keys, dtype=torch.long, device=dev)
        if fi_on:
            _first_call(first, "decode", lambda: da.decode_attention_flashinfer(q, k, v, length))
        _pair(rows, "decode_attention", f"B{B} {keys}/{L} keys", "triton", (q, k, v, length),
              da.decode_attention_ref(q, k, v, length), dt, fi_on)


def _tokens(name: str, args: tuple, seeds: int) -> str:
    """The `sample` variant's tokens against the reference's over `seeds` generator states (one miss in 20
    allowed: two scores that round differently)."""
    logits, temperature, top_k, top_p, _ = args
    dev = logits.device.type
    misses = sum(int(variants.run("sample", name, logits, temperature, top_k, top_p, torch.Generator(dev).manual_seed(s))
                     != sampling.sample_ref(logits, temperature, top_k, top_p, torch.Generator(dev).manual_seed(s)))
                 for s in range(seeds))
    return "ok" if misses <= seeds // 20 else f"FAIL ({misses}/{seeds} tokens differ)"


def samples(rows: list, dev: str, V: int, k: int, seeds: int, fi_on: bool, first: dict) -> None:
    g = torch.Generator(dev).manual_seed(2)
    logits = (torch.randn(V, generator=g, device=dev) * 2.5).bfloat16().float()     # bf16 values: ties
    gen = torch.Generator(dev).manual_seed(3)
    if fi_on:
        _first_call(first, "topk", lambda: sampling.topk_flashinfer(logits, k))
    for p in (0.95, 1.0):
        args = (logits, 0.6, k, p, gen)
        r = dict(op="sample", shape=f"V{V} k{k} p{p}", ours="triton", ours_check=_tokens("triton", args, seeds),
                 ours_us=us(variants.runner("sample", "triton", *args, direct=True), "events"))
        if fi_on:
            r.update(fi_check=_tokens(FI, args, seeds), fi_us=us(variants.runner("sample", FI, *args, direct=True),
                                                                 "events"))
        rows.append(r)
    x = logits / 0.6
    rows.append(dict(op="top-k alone (ours: topk_desc)", shape=f"V{V} k{k}", ours="triton",
                     ours_us=us(lambda: sampling.topk_desc(x, k), "events"),
                     fi_us=us(lambda: sampling.topk_flashinfer(x, k), "events") if fi_on else None))
    for B in DECODE_ROWS:     # FlashInfer's own sampler: one call, its RNG (not the op's contract)
        batch = logits.expand(B, V).contiguous()
        ours = lambda: [kernels.call("sample", batch[b], 0.6, k, 0.95, gen) for b in range(B)]  # noqa: E731
        r = dict(op="FlashInfer's sampler, one call (not the op's contract)", shape=f"{B} rows V{V} k{k} p0.95",
                 ours="one call a row", ours_us=us(ours, "events"))
        if fi_on:
            fs = _flashinfer.lib().sampling
            if "sampler" not in first:
                _first_call(first, "sampler", lambda: fs.top_k_top_p_sampling_from_logits(batch / 0.6, k, 0.95))
            r["fi_us"] = us(lambda: fs.top_k_top_p_sampling_from_logits(batch / 0.6, k, 0.95, generator=gen), "events")
        rows.append(r)


def _ratio(r: dict) -> float | None:
    """FlashInfer's time over ours (< 1: FlashInfer faster), graph times where both have them."""
    for a, b in (("fi_graph_us", "ours_graph_us"), ("fi_us", "ours_us")):
        if r.get(a) is not None and r.get(b) is not None:
            return r[a] / r[b]
    return None


COLS = [Col("op", "op"), Col("shape", "shape"), Col("ours", "ours"), Col("ours us", "ours_us", ".1f"),
        Col("ours graph", "ours_graph_us", ".1f"), Col("FI us", "fi_us", ".1f"), Col("FI graph", "fi_graph_us", ".1f"),
        Col("FI/ours", _ratio, ".2f"), Col("ours check", "ours_check"), Col("FI check", "fi_check")]


def markdown(rows: list) -> str:
    lines = ["| " + " | ".join(c.header for c in COLS) + " |", "|" + "---|" * len(COLS)]
    lines += ["| " + " | ".join(c.cell(r) for c in COLS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, out: Output) -> bool:
    dev = "cpu" if args.dry else "cuda"
    fi_on = not args.dry and _flashinfer.available()
    out.data["flashinfer"] = _flashinfer.installed()
    out.say(f"flashinfer: {out.data['flashinfer'] or 'not installed at a supported version (our side only)'}")
    if not args.dry and not fi_on:
        out.say("FlashInfer is needed on CUDA: bash bench/flashinfer_install.sh (see there)")
        return False
    H, V, k = (64, 3000, 64) if args.dry else (HIDDEN, VOCAB, 1024)
    rows: list[dict] = []
    first: dict[str, float] = {}
    norms(rows, dev, H, (1, 5) if args.dry else NORM_ROWS, fi_on, first)
    if args.dry:
        decodes(rows, dev, (1, 2), 96, 70, 4, 2, 64, fi_on, first)
    else:
        decodes(rows, dev, DECODE_ROWS, CACHE, KEYS, HQ, HKV, HEAD_DIM, fi_on, first)
    samples(rows, dev, V, k, 3 if args.dry else args.seeds, fi_on, first)
    out.data.update(rows=rows, first_call_s=first)
    out.table(rows, COLS)
    if first:
        out.say("first call s (JIT build on a cold cache): " + ", ".join(f"{f} {s:.1f}" for f, s in first.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flashinfer.md").write_text(markdown(rows))
    bad = [r for r in rows if any(str(r.get(c, "")).startswith("FAIL") for c in ("ours_check", "fi_check"))]
    if bad:
        out.say(f"{len(bad)} row(s) differ from the reference")
    return not bad
