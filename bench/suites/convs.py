"""The convolutions outside the transformer at 1024x1024, random weights at the real config
(bench/instruct_config.json):

  heads   the image heads (`patch_embed`, `final_layer`: 3x3 convs over 64x64 x 4096 channels, CFG
          batch 2) in bf16, per layout and cuDNN mode;
  conv    one VAE-decoder 3x3x3 conv at each of its large shapes, fp16, per way of computing it:
          F.conv3d (the reference; channels_last_3d too), the `taps2d` variant (hunyuan_kernels/vae/conv.py: the
          frames as one stacked-tap conv2d, channels last, then a Triton tap sum), that conv2d alone,
          the same conv2d on NCHW frames, and three conv2d (one per temporal tap) accumulating;
  gn      GroupNorm + swish at the decoder's top level, reference (autocast) vs the Triton variant;
  decode  the whole VAE decode under fp16 autocast, reference ops (`kernels.allowed()`) vs each
          variant alone vs both.

    python -m bench convs            # on the GPU, about a minute
    python -m bench convs --dry      # CPU, tiny shapes, Triton interpreter: the suite runs

ms are medians (CUDA events). TFLOP/s counts F.conv3d's work (kt*kh*kw MACs per output, the zero
padding included; FlopCounterMode of the reference decode), so rates compare across variants. Every
fast output is drawn from NaN-filled memory and compared with the reference (max |diff|).
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import hunyuan_kernels as kernels
from engine.model.image_heads import UNetDown, UNetUp
from engine.model.vae import AutoencoderKLConv3D
from hunyuan_kernels.vae import conv, group_norm

from .. import variants
from ..checks import nan_blocks
from ..rank import CONFIG
from ..report import Col, Output
from ..timing import sync, time_ms

DRY = True
FLOOR_GBS = 4300.0
CL, CL3 = torch.channels_last, torch.channels_last_3d
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# (name, Cin, Cout, T, H=W) of the decoder's large convs at 1024x1024 (B = 1)
CONV_SHAPES = [("L4 block", 128, 128, 4, 1024), ("L3 block", 256, 256, 4, 512), ("L3 up", 256, 512, 4, 512),
               ("L2 block", 512, 512, 4, 256), ("L1 block", 1024, 1024, 2, 128), ("L1 up", 1024, 4096, 2, 128),
               ("L0 up", 1024, 8192, 1, 64), ("conv_out", 128, 3, 4, 1024)]
DRY_CONV_SHAPES = [("L4 block", 16, 16, 4, 12), ("L1 up", 16, 40, 2, 6), ("conv_out", 16, 3, 4, 9)]


class Setup:
    """Device, the VAE's autocast dtype (bf16: CPU autocast's) and the shapes: real, or tiny (--dry)."""

    def __init__(self, dry: bool):
        self.dry, self.dev = dry, "cpu" if dry else "cuda"
        self.half = torch.bfloat16 if dry else torch.float16
        self.conv_shapes = DRY_CONV_SHAPES if dry else CONV_SHAPES
        self.gn_shape = (1, 32, 4, 16, 16) if dry else (1, 128, 4, 1024, 1024)
        self.side = 2 if dry else 64           # latent side: 1024x1024 (dry: 32x32)

    def ms(self, fn, n: int = 5) -> float:
        return time_ms(fn, "wall", n=1, warmup=0) if self.dry else time_ms(fn, "events", n=n)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    pass


def flops(fn) -> float:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def drawn_from_nan(fn, dev: str, *like: tuple[tuple[int, ...], torch.dtype]):
    """fn() with the caching allocator's blocks of these sizes NaN-filled first."""
    nan_blocks(dev, *like)
    out = fn()
    sync()
    return out


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_heads(cfg: dict, s: Setup, add) -> None:
    H, inner, latent = cfg["hidden_size"], cfg.get("patch_embed_hidden_dim", 1024), cfg["vae"]["latent_channels"]
    dt, B, S = torch.bfloat16, 2, 64
    up = UNetUp(H, inner, latent, dtype=dt, device=s.dev)
    down = UNetDown(latent, inner, H, dtype=dt, device=s.dev)
    for m in (up, down):
        for p in m.parameters():
            p.normal_(0, 0.02)
    hidden = torch.randn(B, 1 + S * S, H, device=s.dev, dtype=dt)[:, 1:]     # the step's image rows (a view)
    z = torch.randn(B, latent, S, S, device=s.dev, dtype=dt)
    t_emb = torch.randn(B, H, device=s.dev, dtype=dt)
    for name, fn in (("final_layer", lambda: up(hidden, t_emb, S, S)), ("patch_embed", lambda: down(z, t_emb))):
        ref, f = None, flops(fn)
        for layout in ("nchw", "channels_last"):
            for m in (up, down):
                m.to(memory_format=CL if layout == "channels_last" else torch.contiguous_format)
            for bench_mode in (False, True):
                torch.backends.cudnn.benchmark = bench_mode
                ms = s.ms(fn)
                out = fn().float()
                ref = out if ref is None else ref
                add(name + " bf16", f"{layout} benchmark={bench_mode}", ms, f / ms / 1e9, "TFLOP/s", diff(out, ref))
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


def bench_conv_shape(name: str, cin: int, cout: int, T: int, S: int, g: torch.Generator, s: Setup, add) -> None:
    x = torch.randn(1, cin, T, S, S, generator=g, device=s.dev).to(s.half)
    w = (torch.randn(cout, cin, 3, 3, 3, generator=g, device=s.dev) / (27 * cin) ** 0.5).to(s.half)
    b = (torch.randn(cout, generator=g, device=s.dev) * 0.1).to(s.half)
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
    taps2d = variants.runner("conv3d_same", "taps2d", x, w, b, pad)
    forms = [
        ("conv3d (reference)", lambda: conv.conv3d_same_ref(x, w, b, pad), True),
        ("conv3d channels_last_3d", lambda: F.conv3d(x3, w3, b, padding=pad), True),
        ("taps2d (the variant)", taps2d, True),
        ("  its stacked conv2d alone", lambda: conv.tap_outputs(frames, ws, (1, 1)), False),
        ("  same conv2d, NCHW frames", lambda: F.conv2d(frames_nchw, ws_nchw, None, padding=1), False),
        ("3 conv2d accumulating", lambda: accumulate3(x, taps, b), True),
    ]
    for form, fn, checked in forms:
        if form.startswith("3 conv2d") and cout % 8:
            continue                                  # cuDNN's channels-last path wants Cout % 8 == 0
        d = diff(drawn_from_nan(fn, s.dev, (ref.shape, ref.dtype), (ref.shape, ref.dtype)), ref) if checked else None
        ms = s.ms(fn)
        add(what, form, ms, work / ms / 1e9, "TFLOP/s", d)
    # the variant's two memory passes around its conv2d, as GB/s of the bytes each moves once
    y = conv.tap_outputs(frames, ws, (1, 1))
    out = torch.empty_like(ref)
    for form, fn, moved in (
            ("  its frames copy (channels last)", lambda: conv.frames_channels_last(x), 2 * x.nbytes),
            ("  same copy, PyTorch's permute", lambda: x.permute(0, 2, 3, 4, 1).contiguous(), 2 * x.nbytes),
            ("  its tap sum (Triton)", lambda: conv.sum_taps(y, b, 1, T, cout, cpad, k0 - 1, out),
             y.nbytes + out.nbytes)):
        ms = s.ms(fn)
        add(what, form, ms, moved / ms / 1e6, f"GB/s {moved / ms / 1e6 / FLOOR_GBS:.0%}", None)


def bench_gn(s: Setup, add) -> None:
    g = torch.Generator(s.dev).manual_seed(1)
    C = s.gn_shape[1]
    w = torch.randn(C, generator=g, device=s.dev) * 0.1 + 1
    b = torch.randn(C, generator=g, device=s.dev) * 0.1
    for in_dtype in (torch.float32, s.half):     # the residual stream (fp32 under autocast), a conv output
        x = (torch.randn(s.gn_shape, generator=g, device=s.dev) * 2 + 0.5).to(in_dtype)
        what = f"gn+swish C{C} T{s.gn_shape[2]} {s.gn_shape[3]}^2 {SHORT[in_dtype]}>{SHORT[s.half]}"
        least = x.nbytes + x.numel() * s.half.itemsize      # bytes: x read once, the result written once

        def ref():
            with torch.autocast(s.dev, dtype=s.half):
                return group_norm.group_norm_swish_ref(x, w, b, 32, 1e-6, s.half)
        r = ref()
        fast = variants.runner("group_norm_swish", "triton", x, w, b, 32, 1e-6, s.half)
        checked = diff(drawn_from_nan(fast, s.dev, (r.shape, r.dtype)), r)
        for form, fn, d in (("reference (autocast ops)", ref, None), ("triton", fast, checked)):
            ms = s.ms(fn)
            add(what, form, ms, least / ms / 1e6, f"GB/s {least / ms / 1e6 / FLOOR_GBS:.0%}", d)


def bench_decode(cfg: dict, s: Setup, add, out: Output) -> None:
    with torch.device(s.dev):
        vae = AutoencoderKLConv3D(cfg)
    g = torch.Generator(s.dev).manual_seed(2)
    for name, p in vae.named_parameters():   # O(1) activations: norms ~1, biases ~0.05, kernels ~1/sqrt(fan_in)
        r = torch.randn(p.shape, generator=g, device=s.dev)
        p.copy_(1 + 0.1 * r if ".norm" in name and name.endswith(".weight") else
                0.05 * r if p.ndim == 1 else r / p[0].numel() ** 0.5)
    z = torch.randn(1, cfg["latent_channels"], s.side, s.side, generator=g, device=s.dev)
    what = f"vae decode {16 * s.side}^2"

    def decode():
        with torch.autocast(s.dev, dtype=s.half):
            return vae.decode_latent(z).float()
    with kernels.allowed():
        work = flops(decode)
        ref = decode()
        ms = s.ms(decode, 3)
        add(what, "reference ops", ms, work / ms / 1e9, "TFLOP/s", None)
    top = (1, cfg["block_out_channels"][0], cfg["ffactor_temporal"], 16 * s.side, 16 * s.side)   # top-level activation
    act = [(top, s.half), (top, s.half), (top, torch.float32)]
    if not s.dry:
        first = {op: variants.first(op, s.dev, s.half) for op in ("conv3d_same", "group_norm_swish")}
        out.say(f"the registry's first variants on CUDA: {first}")
    for form, allow, bench_mode in (("conv3d_same: taps2d", ("taps2d",), False),
                                    ("group_norm_swish: triton", ("triton",), False),
                                    ("both", None, False), ("both, cudnn.benchmark", None, True)):
        torch.backends.cudnn.benchmark = bench_mode
        with kernels.allowed(*allow) if allow else contextlib.nullcontext():
            got = drawn_from_nan(decode, s.dev, *act)
            ms = s.ms(decode, 3)
            add(what, form, ms, work / ms / 1e9, "TFLOP/s", diff(got, ref))
    torch.backends.cudnn.benchmark = False


def run(args: argparse.Namespace, out: Output) -> bool:
    s = Setup(args.dry)
    cfg = json.loads(CONFIG.read_text())
    if args.dry:
        cfg["vae"] = {**cfg["vae"], "block_out_channels": [32, 32, 32, 32, 32], "latent_channels": 16,
                      "layers_per_block": 1}
    rows: list[dict] = []

    def add(what: str, form: str, ms: float, rate: float | None, unit: str, d: float | None) -> None:
        rows.append(dict(what=what, variant=form, ms=ms, rate=rate, unit=unit, diff=d))
        out.say(f"{what}: {form} {ms:.2f} ms" + (f", max diff {d:.2e}" if d is not None else ""))
    with torch.no_grad():
        if not args.dry:
            bench_heads(cfg, s, add)
        g = torch.Generator(s.dev).manual_seed(0)
        for shape in s.conv_shapes:
            bench_conv_shape(*shape, g, s, add)
            if not args.dry:
                torch.cuda.empty_cache()
        bench_gn(s, add)
        bench_decode(cfg["vae"], s, add, out)
    out.data["rows"] = rows
    out.table(rows, [Col("what", "what"), Col("variant", "variant"), Col("ms", "ms", ".2f"), Col("rate", "rate", ".0f"),
                     Col("unit", "unit"), Col("max diff", "diff", ".2e")])
    return True
