"""The convolutions outside the transformer at 1024x1024, random weights at the real config
(bench/instruct_config.json):

  heads   the image heads (`patch_embed`, `final_layer`: 3x3 convs over 64x64 x 4096 channels, CFG
          batch 2) in bf16, per layout and cuDNN mode;
  conv    one VAE-decoder 3x3x3 conv at each of its large shapes, fp16, per way of computing it:
          F.conv3d (the reference; channels_last_3d too), the `taps2d` backend (kernels/conv.py: the
          frames as one stacked-tap conv2d, channels last, then a Triton tap sum), that conv2d alone,
          the same conv2d on NCHW frames, and three conv2d (one per temporal tap) accumulating;
  gn      GroupNorm + swish at the decoder's top level, reference (autocast) vs the Triton op;
  decode  the whole VAE decode under fp16 autocast, reference ops (`kernels.allowed()`) vs each new
          op alone vs both.

    python bench/bench_convs.py            # on the GPU, about a minute
    python bench/bench_convs.py --dry      # CPU, tiny shapes, Triton interpreter: checks the script runs

ms are medians (CUDA events). TFLOP/s counts F.conv3d's work (kt*kh*kw MACs per output, the zero
padding included; FlopCounterMode of the reference decode), so rates compare across variants. Every
fast output is drawn from NaN-filled memory and compared with the reference (max |diff|). The table
is printed last; details go to $OUT/bench_convs.json if OUT is set.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"      # before Triton is imported

import torch                                    # noqa: E402
import torch.nn.functional as F                 # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                              # noqa: E402
from kernels import conv, group_norm                         # noqa: E402
from engine.model.image_heads import UNetDown, UNetUp      # noqa: E402
from engine.model.vae import AutoencoderKLConv3D            # noqa: E402

DEV = "cpu" if DRY else "cuda"
HALF = torch.bfloat16 if DRY else torch.float16     # the VAE's autocast dtype (bf16: CPU autocast's)
FLOOR_GBS = 4300.0
CL, CL3 = torch.channels_last, torch.channels_last_3d
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (name, Cin, Cout, T, H=W) of the decoder's large convs at 1024x1024 (B = 1); --dry: tiny stand-ins
CONV_SHAPES = ([("L4 block", 16, 16, 4, 12), ("L1 up", 16, 40, 2, 6), ("conv_out", 16, 3, 4, 9)] if DRY else
               [("L4 block", 128, 128, 4, 1024), ("L3 block", 256, 256, 4, 512), ("L3 up", 256, 512, 4, 512),
                ("L2 block", 512, 512, 4, 256), ("L1 block", 1024, 1024, 2, 128), ("L1 up", 1024, 4096, 2, 128),
                ("L0 up", 1024, 8192, 1, 64), ("conv_out", 128, 3, 4, 1024)])
GN_SHAPE = (1, 32, 4, 16, 16) if DRY else (1, 128, 4, 1024, 1024)

rows: list[dict] = []


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, n: int = 5) -> float:
    fn()
    if DEV != "cuda":
        import time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def flops(fn) -> float:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def poisoned(fn, *like: tuple[tuple[int, ...], torch.dtype]):
    """fn() with the caching allocator's blocks of these (shape, dtype) sizes NaN-filled first (an
    element the fast path leaves unwritten then reads NaN)."""
    if DEV == "cuda":
        bufs = [torch.full(shape, float("nan"), dtype=dt, device=DEV) for shape, dt in like]
        del bufs
    out = fn()
    sync()
    return out


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def row(what: str, variant: str, ms: float, rate: float | None, unit: str, d: float | None) -> None:
    rows.append(dict(what=what, variant=variant, ms=ms, rate=rate, unit=unit, diff=d))
    print(rows[-1], flush=True)


def bench_heads(cfg: dict) -> None:
    H, inner, latent = cfg["hidden_size"], cfg.get("patch_embed_hidden_dim", 1024), cfg["vae"]["latent_channels"]
    dt, B, S = torch.bfloat16, 2, 64
    up = UNetUp(H, inner, latent, dtype=dt, device=DEV)
    down = UNetDown(latent, inner, H, dtype=dt, device=DEV)
    for m in (up, down):
        for p in m.parameters():
            p.normal_(0, 0.02)
    hidden = torch.randn(B, 1 + S * S, H, device=DEV, dtype=dt)[:, 1:]     # the step's image rows (a view)
    z = torch.randn(B, latent, S, S, device=DEV, dtype=dt)
    t_emb = torch.randn(B, H, device=DEV, dtype=dt)
    for name, fn in (("final_layer", lambda: up(hidden, t_emb, S, S)), ("patch_embed", lambda: down(z, t_emb))):
        ref, f = None, flops(fn)
        for layout in ("nchw", "channels_last"):
            for m in (up, down):
                m.to(memory_format=CL if layout == "channels_last" else torch.contiguous_format)
            for bench_mode in (False, True):
                torch.backends.cudnn.benchmark = bench_mode
                ms = median_ms(fn)
                out = fn().float()
                ref = out if ref is None else ref
                row(name + " bf16", f"{layout} benchmark={bench_mode}", ms, f / ms / 1e9, "TFLOP/s", diff(out, ref))
    torch.backends.cudnn.benchmark = False


def accumulate3(x: torch.Tensor, taps: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """One conv2d per temporal tap on only the frames it reads (3T-2 frame-taps, not 3T), summed into
    the centre tap's output in place; B == 1 (frames are views then). Returns [1,C,T,H,W]."""
    f = conv.frames_channels_last(x)
    y = F.conv2d(f, taps[1], b, padding=1)
    if f.shape[0] > 1:
        y[1:] += F.conv2d(f[:-1], taps[0], None, padding=1)
        y[:-1] += F.conv2d(f[1:], taps[2], None, padding=1)
    return y.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


def bench_conv() -> None:
    g = torch.Generator(DEV).manual_seed(0)
    for shape in CONV_SHAPES:
        bench_conv_shape(*shape, g)
        if DEV == "cuda":
            torch.cuda.empty_cache()


def bench_conv_shape(name: str, cin: int, cout: int, T: int, S: int, g: torch.Generator) -> None:
    x = torch.randn(1, cin, T, S, S, generator=g, device=DEV).to(HALF)
    w = (torch.randn(cout, cin, 3, 3, 3, generator=g, device=DEV) / (27 * cin) ** 0.5).to(HALF)
    b = (torch.randn(cout, generator=g, device=DEV) * 0.1).to(HALF)
    pad = (1, 1, 1)
    what = f"{name} {cin}>{cout} T{T} {S}^2"
    work = 2.0 * cin * cout * 27 * T * S * S
    ref = conv.conv3d_same_ref(x, w, b, pad)
    x3, w3 = x.to(memory_format=CL3), w.to(memory_format=CL3)
    k0, k1 = conv.used_taps(3, 1, T)
    ws, cpad = conv.stacked_tap_weight(w, k0, k1)
    frames = conv.frames_channels_last(x)
    frames_nchw, ws_nchw = frames.contiguous(), ws.contiguous()
    taps = [w[:, :, k].contiguous(memory_format=CL) for k in range(3)]
    variants = [
        ("conv3d (reference)", lambda: conv.conv3d_same_ref(x, w, b, pad), True),
        ("conv3d channels_last_3d", lambda: F.conv3d(x3, w3, b, padding=pad), True),
        ("taps2d (backend)", lambda: conv.conv3d_same_taps(x, w, b, pad), True),
        ("  its stacked conv2d alone", lambda: conv.tap_outputs(frames, ws, (1, 1)), False),
        ("  same conv2d, NCHW frames", lambda: F.conv2d(frames_nchw, ws_nchw, None, padding=1), False),
        ("3 conv2d accumulating", lambda: accumulate3(x, taps, b), True),
    ]
    for variant, fn, checked in variants:
        if variant.startswith("3 conv2d") and cout % 8:
            continue                                  # cuDNN's channels-last path wants Cout % 8 == 0
        d = diff(poisoned(fn, (ref.shape, ref.dtype), (ref.shape, ref.dtype)), ref) if checked else None
        ms = median_ms(fn)
        row(what, variant, ms, work / ms / 1e9, "TFLOP/s", d)
    # the backend's two memory passes around its conv2d, as GB/s of the bytes each moves once
    y = conv.tap_outputs(frames, ws, (1, 1))
    out = torch.empty_like(ref)
    for variant, fn, moved in (
            ("  its frames copy (channels last)", lambda: conv.frames_channels_last(x), 2 * x.nbytes),
            ("  same copy, PyTorch's permute", lambda: x.permute(0, 2, 3, 4, 1).contiguous(), 2 * x.nbytes),
            ("  its tap sum (Triton)", lambda: conv.sum_taps(y, b, 1, T, cout, cpad, k0 - 1, out),
             y.nbytes + out.nbytes)):
        ms = median_ms(fn)
        row(what, variant, ms, moved / ms / 1e6, f"GB/s {moved / ms / 1e6 / FLOOR_GBS:.0%}", None)


def bench_gn() -> None:
    g = torch.Generator(DEV).manual_seed(1)
    C = GN_SHAPE[1]
    w = torch.randn(C, generator=g, device=DEV) * 0.1 + 1
    b = torch.randn(C, generator=g, device=DEV) * 0.1
    for in_dtype in (torch.float32, HALF):     # the residual stream (fp32 under autocast), a conv output
        x = (torch.randn(GN_SHAPE, generator=g, device=DEV) * 2 + 0.5).to(in_dtype)
        what = f"gn+swish C{C} T{GN_SHAPE[2]} {GN_SHAPE[3]}^2 {SHORT[in_dtype]}>{SHORT[HALF]}"
        least = x.nbytes + x.numel() * HALF.itemsize      # bytes: x read once, the result written once

        def ref():
            with torch.autocast(DEV, dtype=HALF):
                return group_norm.group_norm_swish_ref(x, w, b, 32, 1e-6, HALF)
        r = ref()
        fast = lambda: group_norm.group_norm_swish_triton(x, w, b, 32, 1e-6, HALF)  # noqa: E731
        checked = diff(poisoned(fast, (r.shape, r.dtype)), r)
        for variant, fn, d in (("reference (autocast ops)", ref, None), ("triton", fast, checked)):
            ms = median_ms(fn)
            row(what, variant, ms, least / ms / 1e6, f"GB/s {least / ms / 1e6 / FLOOR_GBS:.0%}", d)


def bench_decode(cfg: dict) -> None:
    with torch.device(DEV):
        vae = AutoencoderKLConv3D(cfg)
    g = torch.Generator(DEV).manual_seed(2)
    for name, p in vae.named_parameters():   # O(1) activations: norms ~1, biases ~0.05, kernels ~1/sqrt(fan_in)
        r = torch.randn(p.shape, generator=g, device=DEV)
        p.copy_(1 + 0.1 * r if ".norm" in name and name.endswith(".weight") else
                0.05 * r if p.ndim == 1 else r / p[0].numel() ** 0.5)
    side = 4 if DRY else 64
    z = torch.randn(1, cfg["latent_channels"], side, side, generator=g, device=DEV)
    what = f"vae decode {16 * side}^2"

    def decode():
        with torch.autocast(DEV, dtype=HALF):
            return vae.decode_latent(z).float()
    with kernels.allowed():
        work = flops(decode)
        ref = decode()
        ms = median_ms(decode, 3)
        row(what, "reference ops", ms, work / ms / 1e9, "TFLOP/s", None)
    top = (1, cfg["block_out_channels"][0], cfg["ffactor_temporal"], 16 * side, 16 * side)   # top-level activation
    act = [(top, HALF), (top, HALF), (top, torch.float32)]
    chosen = {op: kernels.chosen(op, DEV, HALF) for op in ("conv3d_same", "group_norm_swish")}
    print("chosen on", DEV, chosen)
    for variant, allow, bench_mode in (("conv3d_same: taps2d", ("taps2d",), False),
                                       ("group_norm_swish: triton", ("triton",), False),
                                       ("both", None, False), ("both, cudnn.benchmark", None, True)):
        torch.backends.cudnn.benchmark = bench_mode
        with kernels.allowed(*allow) if allow else contextlib.nullcontext():
            out = poisoned(decode, *act)
            ms = median_ms(decode, 3)
            row(what, variant, ms, work / ms / 1e9, "TFLOP/s", diff(out, ref))
    torch.backends.cudnn.benchmark = False


def main() -> None:
    cfg = json.loads(Path(__file__).with_name("instruct_config.json").read_text())
    if DRY:
        from kernels._triton import prepare_interpreter
        prepare_interpreter()
        cfg["vae"] = {**cfg["vae"], "block_out_channels": [32, 32, 32, 32, 32], "latent_channels": 16,
                      "layers_per_block": 1}
    with torch.no_grad():
        if not DRY:
            bench_heads(cfg)
        bench_conv()
        bench_gn()
        bench_decode(cfg["vae"])
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "bench_convs.json").write_text(json.dumps(dict(
            device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry)", rows=rows), indent=1))
    print(f"\n{'what':<32}{'variant':<35}{'ms':>9}{'rate':>8}{'':<12}{'max diff':>10}")
    for r in rows:
        rate = f"{r['rate']:8.0f} {r['unit']:<11}" if r["rate"] is not None else " " * 20
        d = f"{r['diff']:10.2e}" if r["diff"] is not None else "-".rjust(10)
        print(f"{r['what']:<32}{r['variant']:<35}{r['ms']:9.2f}{rate}{d}")


if __name__ == "__main__":
    main()
