"""The convolutions outside the transformer at 1024x1024, in each layout and cuDNN mode, to pick the
fast path: the image heads (`patch_embed`, `final_layer`: 3x3 convs over 64x64 x 4096 channels, CFG
batch 2) in bf16, and the VAE decode under fp16 autocast. Random weights at the real config.

    python bench/bench_convs.py

Prints ms (median), the FLOP rate, and the max difference to the first variant (they must agree).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.image_heads import UNetDown, UNetUp      # noqa: E402
from engine.model.vae import AutoencoderKLConv3D            # noqa: E402


def median_ms(fn, n=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out)[n // 2]


def flops(fn) -> float:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def main() -> None:
    cfg = json.loads(Path(__file__).with_name("instruct_config.json").read_text())
    H, inner, latent = cfg["hidden_size"], cfg.get("patch_embed_hidden_dim", 1024), cfg["vae"]["latent_channels"]
    dev, dt, B, S = "cuda", torch.bfloat16, 2, 64
    rows = []
    with torch.no_grad():
        up = UNetUp(H, inner, latent, dtype=dt, device=dev)
        down = UNetDown(latent, inner, H, dtype=dt, device=dev)
        for m in (up, down):
            for p in m.parameters():
                p.normal_(0, 0.02)
        hidden = torch.randn(B, 1 + S * S, H, device=dev, dtype=dt)[:, 1:]     # the step's image rows (a view)
        z = torch.randn(B, latent, S, S, device=dev, dtype=dt)
        t_emb = torch.randn(B, H, device=dev, dtype=dt)
        for name, fn in (("final_layer", lambda: up(hidden, t_emb, S, S)), ("patch_embed", lambda: down(z, t_emb))):
            ref = None
            f = flops(fn)
            for layout in ("nchw", "channels_last"):
                for m in (up, down):
                    m.to(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)
                for bench_mode in (False, True):
                    torch.backends.cudnn.benchmark = bench_mode
                    ms = median_ms(fn)
                    out = fn().float()
                    ref = out if ref is None else ref
                    rows.append((name, layout, bench_mode, ms, f / ms / 1e9, (out - ref).abs().max().item()))
                    print(rows[-1], flush=True)
        torch.backends.cudnn.benchmark = False
        vae = AutoencoderKLConv3D(cfg["vae"]).to(dev)
        for p in vae.parameters():
            p.normal_(0, 0.02)
        zl = torch.randn(1, latent, S, S, device=dev)

        def decode():
            with torch.autocast("cuda", dtype=torch.float16):
                return vae.decode_latent(zl).float()
        f = flops(decode)
        ref = None
        for layout in ("ncdhw", "channels_last_3d"):
            vae.to(memory_format=torch.channels_last_3d if layout == "channels_last_3d" else torch.contiguous_format)
            for bench_mode in (False, True):
                torch.backends.cudnn.benchmark = bench_mode
                ms = median_ms(decode, 3)
                out = decode()
                ref = out if ref is None else ref
                rows.append(("vae_decode fp16", layout, bench_mode, ms, f / ms / 1e9, (out - ref).abs().max().item()))
                print(rows[-1], flush=True)
    print(f"\n{'what':<18}{'layout':<18}{'cudnn.benchmark':>16}{'ms':>9}{'TFLOP/s':>9}{'max diff':>10}")
    for r in rows:
        print(f"{r[0]:<18}{r[1]:<18}{str(r[2]):>16}{r[3]:>9.2f}{r[4]:>9.0f}{r[5]:>10.2e}")


if __name__ == "__main__":
    main()
