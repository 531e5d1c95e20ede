"""The step cache (issue 27): what each setting saves in the denoise phase and what it costs the image.

    python -m bench step-cache [--speed] [--quality] [--settings none,taylor,taylor-enhance] [--model DIR]

--speed (default on): the whole denoise phase of one image (every step through `runtime.denoise.denoise`,
the uncached prefix not counted), timed wall-clock, at the real shapes with random weights, for
  - one hybrid4 rank (compute only: collectives are FakeComm), Instruct, T2I 1024x1024, CFG batched,
    50 steps, bf16, each step a CUDA graph;
  - the MXFP4 Distil on one H200 (tp1; `one-gpu`'s mxfp4-distil build), 8 steps, one branch.
Per setting: ms per image, steps run in full, the speed-up over no cache. Random weights say nothing of
the image, only of the time; and the block cache skips where the features barely change, which random
weights do not show: its rows say what its probe and its skips cost, the quality part how often it skips.

--quality (default on): the embedded model (assets/model: the only trained weights here) end to end
through the engine (T2I prompts with reasoning, fixed seeds), at its default steps and at 50
steps: per setting, PSNR and SSIM of each image against the same request without a cache, the steps run
in full, the DiT wall time per image.

Settings: `none`; `none-eager` (speed: no cache, the step eager, as the block cache runs it: its skip
decision is data, read on the host); `taylor`: the official defaults (interval 5, order 2, no enhance);
`taylor-enhance`: the same with first enhance (3 steps) and tailing enhance (1 step) on; `taylor-N`:
interval N; `block`: the first-block cache at its defaults (threshold 0.08, 1 probe layer, at most 3
skips in a row, 2 warm-up steps, the last step full); `block-T`: threshold T.
"""
from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
import torch

from engine.runtime.denoise import denoise
from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams, make_step_cache, named_setting

from .. import rank
from ..report import Col, Output
from ..timing import sync

DRY = True
PROMPTS = ("a red circle on the left on a white background", "two blue squares and a green star",
           "a yellow triangle above a purple circle", "three orange stars on a black background")


def setting(name: str) -> tuple[TaylorCacheParams | None, BlockCacheParams | None]:
    """(Taylor settings, block-cache settings) of a setting's name (`none-eager`: none, run eagerly)."""
    try:
        return named_setting("none" if name == "none-eager" else name)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--settings", default="none,none-eager,taylor,taylor-enhance,taylor-3,block,block-0.12,block-0.05")
    ap.add_argument("--speed", action="store_true", help="only the speed part")
    ap.add_argument("--quality", action="store_true", help="only the quality part")
    ap.add_argument("--model", default=None, help="checkpoint of the quality part (default: the embedded model)")
    ap.add_argument("--samples", type=int, default=4, help="quality: prompts (seeds 0..)")
    ap.add_argument("--no-step-graph", action="store_true", help="speed: denoise steps eagerly")
    ap.add_argument("--quality-device", default=None,
                    help="quality: where the embedded model runs (default: cuda, the CPU with --dry)")


def needs_cuda(args: argparse.Namespace) -> bool:
    """The quality part alone on the CPU (`--quality --quality-device cpu`) runs without a GPU."""
    return not (args.quality and not args.speed and args.quality_device == "cpu")


# ---------------------------------------------------------------------------------------- speed
def denoise_ms(req, steps: int, name: str, graph: bool, dry: bool) -> tuple[float, int]:
    """(wall ms of `steps` denoise steps of one image, steps run in full); a warm-up run first (the
    graphs' capture), then the median of 3 (dry: one)."""
    model, distil = req.model, req.distil
    times, full = [], 0
    for k in range(2 if dry else 4):
        taylor, block = setting(name)
        r = req.runner(graph and name != "none-eager", keep=True)
        r.step_cache = make_step_cache(taylor, steps, block, model.cfg.num_layers)
        r.prefill()
        x = rank.latent(model, req.s.side)
        sync()
        t0 = time.perf_counter()
        for _ in denoise(r, x, steps, 3.0, 2.5, cfg=not distil, distil=distil):
            pass
        sync()
        if k:
            times.append((time.perf_counter() - t0) * 1e3)
        full = r.step_cache.full_steps
        del r
    return sorted(times)[len(times) // 2], full


def speed(args: argparse.Namespace, out: Output, names: list[str]) -> list[dict]:
    from engine.parallel.plan import get_plan

    from .one_gpu import Request, Shapes, resident_formats
    dry = args.dry
    dev = "cpu" if dry else "cuda"
    shapes = Shapes(dry, 0)
    rows = []
    # (what, plan, distil, resident formats, steps)
    cases = [("hybrid4 rank, Instruct bf16, CFG", "hybrid4", False, None, 4 if dry else 50),
             ("one H200, MXFP4 Distil", "tp1", True, ("mxfp4", "mxfp8"), 3 if dry else 8)]
    for what, plan_name, distil, fmt, steps in cases:
        if dev == "cuda":
            torch.cuda.empty_cache()
        cfg = rank.config(dry, distil)
        plan = get_plan(plan_name)
        model = rank.build(cfg, plan, torch.bfloat16, dev, resident_formats(cfg, *fmt) if fmt else None)
        req = Request(model, plan, shapes, distil, not args.no_step_graph)
        base = None
        with torch.no_grad():
            for name in names:
                ms, full = denoise_ms(req, steps, name, not args.no_step_graph and not dry, dry)
                base = ms if name == "none" else base
                row = dict(case=what, setting=name, steps=steps, full_steps=full, ms_per_image=ms,
                           speedup=base / ms if base else None)
                rows.append(row)
                out.say(f"{what}, {name}: {ms:.0f} ms per image, {full}/{steps} steps in full"
                        + (f", {row['speedup']:.2f}x" if row["speedup"] else ""))
        del model, req
    out.table(rows, [Col("case", "case"), Col("setting", "setting"), Col("steps", "steps"),
                     Col("in full", "full_steps"), Col("DiT ms / image", "ms_per_image", ".0f"),
                     Col("speed-up", "speedup", ".2f")],
              "Denoise phase of one image, random weights, real shapes (compute only)")
    return rows


# ---------------------------------------------------------------------------------------- quality
def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM over the channels of two HxWxC uint8-range images (8x8 windows, the usual constants)."""
    import torch.nn.functional as F
    x = torch.tensor(a, dtype=torch.float64).permute(2, 0, 1)[None]
    y = torch.tensor(b, dtype=torch.float64).permute(2, 0, 1)[None]
    mean = lambda t: F.avg_pool2d(t, 8, 1)      # noqa: E731
    mx, my = mean(x), mean(y)
    vx, vy, cxy = mean(x * x) - mx ** 2, mean(y * y) - my ** 2, mean(x * y) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
    return float(s.mean())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255 ** 2 / max(((a - b) ** 2).mean(), 1e-12)))


def quality(args: argparse.Namespace, out: Output, names: list[str]) -> list[dict]:
    from PIL import Image as PILImage

    from engine import EMBEDDED_MODEL
    from engine.runtime.engine import Engine
    from engine.runtime.events import Done, Image
    from engine.runtime.request import Request
    from engine.serve.engine_config import EngineConfig
    dev = args.quality_device or ("cpu" if args.dry else "cuda")
    pipe = Engine.from_config(EngineConfig(model=str(args.model or EMBEDDED_MODEL), device=dev, dtype=None, plan="tp1",
                                           world_size=1, sp_kind="ulysses", preview_every=0))     # as served
    lm = pipe.loaded
    samples = PROMPTS[:1] if args.dry else (PROMPTS * 8)[:args.samples]
    rows = []
    for steps in [4] if args.dry else sorted({lm.gen.diff_infer_steps, 50}):
        base: dict[int, np.ndarray] = {}
        for name in names:
            p, s, full, dit = [], [], 0, 0.0
            for seed, prompt in enumerate(samples):
                taylor, block = setting(name)
                ev = list(pipe.run(Request(prompt=prompt, seed=seed, steps=steps, taylor_cache=taylor,
                                           block_cache=block)))
                png = next(e for e in ev if isinstance(e, Image)).png
                img = np.asarray(PILImage.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)
                t = next(e for e in ev if isinstance(e, Done)).timings
                full += t.dit_full_steps
                dit += t.dit_ms_per_step * t.dit_steps
                if name == "none":
                    base[seed] = img
                elif seed in base:
                    p.append(psnr(img, base[seed]))
                    s.append(ssim(img, base[seed]))
            row = dict(steps=steps, setting=name, images=len(samples), full_steps=full / len(samples),
                       dit_ms_per_image=dit / len(samples), psnr_db=float(np.mean(p)) if p else None,
                       psnr_min_db=min(p) if p else None, ssim=float(np.mean(s)) if s else None)
            rows.append(row)
            out.say(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    out.table(rows, [Col("steps", "steps"), Col("setting", "setting"), Col("in full", "full_steps", ".1f"),
                     Col("DiT ms / image", "dit_ms_per_image", ".0f"), Col("PSNR dB", "psnr_db", ".1f"),
                     Col("min PSNR dB", "psnr_min_db", ".1f"), Col("SSIM", "ssim", ".3f")],
              f"The embedded model end to end ({len(samples)} T2I prompts, seeds 0..): each image vs no cache")
    return rows


def run(args: argparse.Namespace, out: Output) -> bool:
    names = [n for n in args.settings.split(",") if n]
    if names[0] != "none":
        names.insert(0, "none")        # the reference of every comparison
    both = not args.speed and not args.quality
    if args.speed or both:
        out.data["speed"] = speed(args, out, names)
    if args.quality or both:
        out.data["quality"] = quality(args, out, [n for n in names if n != "none-eager"])
    return True
