"""Our kernels and FlashInfer's side by side, per op, at the engine's shapes: each op's `flashinfer`
variant (hunyuan_kernels/_flashinfer.py) against the variant the registry picks today, both checked against the
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
MoE (the AR phase of a hybrid4 rank: TP4, one micro of I 768 of the two resident, H 4096, 64 experts,
top-8, the shared MLP; N = 1, 16 decode tokens and a 1251-token prefill), where FlashInfer's module is built
(`bash bench/flashinfer_install.sh warm-bg moe`: its JIT build takes over 9 minutes; skipped with a note
otherwise): our `moe` op (router + routed experts + shared MLP, fp32 finalize) against the same computation
on FlashInfer's side, our router (PyTorch) then `cutlass_fused_moe` with the shared MLP as a 65th expert that
every token takes with weight 1 (top-9), and that call alone; FlashInfer's tactics are its heuristic's, then
the autotuned ones. The FP8 rows: our `moe_quant` fp8 (W8A8, weights per output channel, activations per
row) against FlashInfer's per-tensor FP8 (weights per expert, activations on a static scale), both checked
against the bf16 reference: not the same recipe, the same work. Not here: RoPE (ours fuses the q/k norm and
the cache write, FlashInfer's rotates only).
Writes flashinfer.json, flashinfer.txt and flashinfer.md (the markdown table for docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import time

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels import _flashinfer, decode_attention as da, norm, sampling
from hunyuan_kernels.moe import moe_reference, route, swiglu_halves
from hunyuan_kernels.quant import QWeight, quantize_fp8_rows

from .. import variants
from ..checks import compare
from ..report import Col, Output
from .kernels_moe import Dims
from .kernels_ops import us, verdict

DRY = True
EPS = 1e-5
HIDDEN, VOCAB, HQ, HKV, HEAD_DIM = 4096, 133120, 32, 8, 128
NORM_ROWS = (1, 4, 16, 1251, 4098)
DECODE_ROWS = (1, 4, 16)
CACHE, KEYS = 2048, 1251 + 750
MOE_TOKENS = (1, 16, 1251)
MOE_TOL = {"bf16": 1e-2, "fp8": 1e-1}          # relative error against the bf16 reference (E4M3: 3 mantissa bits)
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
    moes(rows, args.dry, fi_on, first, out)
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


# ---- MoE: our `moe` / `moe_quant` op against FlashInfer's CUTLASS fused MoE ---------------------------------

def moe_built() -> bool:
    """FlashInfer's SM90 CUTLASS fused MoE module is in the JIT cache (a first call would build it: 9+ min)."""
    from flashinfer.jit import env
    return (env.FLASHINFER_JIT_DIR / "fused_moe_90" / "fused_moe_90.so").exists()


def fp8_per_row(w: torch.Tensor) -> QWeight:
    """Our fp8 format: E4M3 with a scale per output channel (row)."""
    return QWeight("fp8", *quantize_fp8_rows(w))


def fp8_per_matrix(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, r, c] -> E4M3 codes and one fp32 scale per expert [E] (FlashInfer's per-tensor FP8 weights)."""
    codes, scale = quantize_fp8_rows(w.reshape(w.shape[0], -1))
    return codes.view(w.shape), scale.view(-1).contiguous()


class FiMoe:
    """FlashInfer's side of the `moe` op on one micro: its expert packs are ours with the shared MLP as one
    more expert (gate/up rows in our order, first half linear, second half through SiLU, which is also
    `cutlass_fused_moe`'s: it computes act(rows I..2I) * rows 0..I), made once as the engine would at load."""

    def __init__(self, w: dict, ms: int, inter: int, K: int, n: int, fmt: str, x: torch.Tensor):
        self.fi, self.K, self.fmt, self.gate = _flashinfer.lib(), K, fmt, w["gate"]
        assert w["shared_w1"].shape[1] == 2 * inter, "the shared MLP as one more expert needs its I to be theirs"
        cols = slice(ms * inter, (ms + 1) * inter)
        w1 = torch.cat([w["w1"][ms], w["shared_w1"][ms][None]])                          # [E+1, 2I, H]
        w2 = torch.cat([w["w2"][:, :, cols], w["shared_w2"][:, cols][None]]).contiguous()  # [E+1, H, I]
        self.scales: list[torch.Tensor] = []
        if fmt == "fp8":
            # static activation scales, calibrated on this input as a checkpoint's would be on real data
            self.x_scale = x.float().abs().amax() / 448
            h = torch.nn.functional.linear(x, w1.reshape(-1, w1.shape[-1])).view(x.shape[0], -1, 2 * inter)
            a_scale = swiglu_halves(h).float().abs().amax() / 448
            (w1, s1), (w2, s2) = fp8_per_matrix(w1), fp8_per_matrix(w2)
            # quant_scales (FlashInfer 0.7.4, per-tensor FP8): GEMM1 dequant [E], GEMM2 input quant (0-dim),
            # GEMM2 dequant [E], GEMM1 input dequant (0-dim)
            self.scales = [s1 * self.x_scale, 1 / a_scale, s2 * a_scale, self.x_scale.clone()]
        self.w1, self.w2 = w1, w2
        E1, dev = w1.shape[0], x.device
        self.out = torch.empty(n, w2.shape[1], dtype=torch.bfloat16, device=dev)
        self.shared_id = torch.full((n, 1), E1 - 1, dtype=torch.int32, device=dev)
        self.shared_p = torch.ones(n, 1, device=dev)
        wdt = torch.float8_e4m3fn if fmt == "fp8" else torch.bfloat16
        size = self.fi.cutlass_fused_moe_workspace_size(n, w2.shape[1], inter, E1, K + 1, x_dtype=wdt, weight_dtype=wdt,
                                                        device=dev)
        self.ws = torch.empty(size, dtype=torch.uint8, device=dev)      # no allocation per call: graphs capture it

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Our router (the reference's PyTorch ops), the shared expert appended; x quantized where FP8."""
        p, idx = route(x, self.gate, self.K, True)
        ids = torch.cat([idx.int(), self.shared_id], dim=1)
        xin = (x.float() / self.x_scale).to(torch.float8_e4m3fn) if self.fmt == "fp8" else x
        return xin, ids, torch.cat([p, self.shared_p], dim=1)

    def experts(self, xin, ids, p) -> torch.Tensor:
        return self.fi.cutlass_fused_moe(xin, ids, p, self.w1, self.w2, torch.bfloat16, self.scales,
                                         output=self.out, tune_max_num_tokens=2048, workspace_buffer=self.ws)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(*self.routing(x))


def moe_check(got: torch.Tensor, want: torch.Tensor, fmt: str) -> str:
    c = compare(got, want, MOE_TOL[fmt])
    return f"{'ok' if c.ok else 'FAIL'} (rel err {c.err:.1e})"


def moe_case(rows: list, dims: Dims, n: int, fmt: str, w: dict, pack: dict, fi_on: bool, first: dict) -> None:
    """One N and format: ours (the `moe` op, or `moe_quant` on `pack`'s fp8 experts), then FlashInfer's
    router + experts (its heuristic's tactics, then autotuned ones) and its experts alone; each side checked
    against the bf16 reference first."""
    inter, _, ms, mc = dims.decode
    x = dims.tokens_of(n, 40 + n)
    want = moe_reference(*dims.args(x, w, ms, mc))
    op = "moe_quant" if fmt == "fp8" else "moe"
    args = dims.args(x, pack, ms, mc)
    ours = lambda: kernels.call(op, *args)  # noqa: E731
    got = ours()
    shape = f"N{n} H{dims.H} E{dims.E} top-{dims.K} I{inter}"
    main = dict(op=f"{op} {fmt}: router + routed + shared MLP", shape=shape, ours=kernels.chosen(op),
                ours_check=moe_check(got, want, fmt), ours_us=us(ours, "events"),
                ours_graph_us=us(ours, "graph"))
    rows.append(main)
    if not fi_on:
        return
    try:             # FlashInfer's side never fails the suite: its error is a row
        fi_moe_rows(rows, main, FiMoe(w, ms, inter, dims.K, n, fmt, x), x, want, fmt, shape, first)
    except Exception as e:  # noqa: BLE001
        rows.append(dict(op=f"FlashInfer moe {fmt} failed: {type(e).__name__}: {e}"[:240], shape=shape))


def fi_moe_rows(rows: list, main: dict, fm: FiMoe, x, want, fmt: str, shape: str, first: dict) -> None:
    _first_call(first, "moe", lambda: fm(x))
    full = lambda: fm(x)  # noqa: E731
    routed = fm.routing(x)
    alone = lambda: fm.experts(*routed)  # noqa: E731
    main.update(fi_check=moe_check(full().clone(), want, fmt), fi_us=us(full, "events"),
                fi_graph_us=us(full, "graph"))
    rows.append(dict(op=f"FlashInfer cutlass_fused_moe {fmt} alone (routing given: 65 experts, top-9)", shape=shape,
                     fi_us=us(alone, "events"), fi_graph_us=us(alone, "graph")))
    t0 = time.perf_counter()
    with fm.fi.autotune(True):       # its autotuner profiles the tactics for this N once; later calls use them
        full()
    torch.cuda.synchronize()
    first[f"moe {fmt} autotune N{x.shape[0]}"] = time.perf_counter() - t0
    rows.append(dict(op=f"{main['op']}, FlashInfer autotuned", shape=shape,
                     **{k: main[k] for k in ("ours", "ours_us", "ours_graph_us")},
                     fi_check=moe_check(full().clone(), want, fmt), fi_us=us(full, "events"),
                     fi_graph_us=us(full, "graph")))
    rows.append(dict(op=f"FlashInfer cutlass_fused_moe {fmt} alone, autotuned", shape=shape,
                     fi_us=us(alone, "events"), fi_graph_us=us(alone, "graph")))


def moes(rows: list, dry: bool, fi_on: bool, first: dict, out: Output) -> None:
    """The AR single-micro MoE rows (FlashInfer's side only where its module is built)."""
    if fi_on and not moe_built():
        out.say("FlashInfer's fused MoE is not built (fused_moe_90 not in its JIT cache): MoE rows on our side "
                "only; build it with bash bench/flashinfer_install.sh warm-bg moe, then wait")
        fi_on = False
    dims = Dims(dry)
    inter, micros, _, _ = dims.decode
    w = dims.weights(inter, micros, seed=5)[0]
    fp8 = {k: fp8_per_row(w[k]) for k in ("w1", "w2", "shared_w1", "shared_w2")}
    for fmt, pack in (("bf16", w), ("fp8", {**w, **fp8})):
        for n in (1, 5) if dry else MOE_TOKENS:
            moe_case(rows, dims, n, fmt, w, pack, fi_on, first)
