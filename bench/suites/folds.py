"""What folding a checkpoint's MX block scales rounds, per kind of linear: the fold into FP8 per output channel
(`--mxfp8-kernels fp8` for MXFP8 packs; every MX pack under `train.evaluate --fp8-activations`) and humming's
W4A8 fold of the MXFP4 experts (`--moe-kernels humming-fp8`: per expert, 11 binades).

    python -m bench folds --model DIR [--images 8] [--reference DIR]

Reads the checkpoint with the engine's loader (kept quantized, on the CPU; no kernel runs) and reports for
each kind of pack (the layer index dropped from its name): how many, the format, the share of elements the
per-row fold changes (formats.fold_rounded) and its worst change over the row's largest magnitude, the share of
scale blocks humming's fold rounds (humming.clamped_share, MXFP4 experts), and the spread both depend on: the
binades between a row's largest and smallest block scale (median and max over rows). A value changes only in
blocks far below their row's (or expert's) largest scale: MXFP8 loses codes under E4M3's normal range in a
block d binades down (d >= 1), MXFP4 nothing up to 8 binades, humming nothing up to 11.

Then what that and the FP8 activations do to images: --images T2I requests without reasoning (no sampled
token to drift; the step-cache suite's prompts, seeds 0..) on the weight-only packs (W8A16 / W4A16 through the
reference ops) and with every MX pack folded (`fold_all_to_fp8`: W8A8, the numbers of `--moe-kernels
humming-fp8 --mxfp8-kernels fp8`), each pair's PSNR and SSIM, and both against --reference (the checkpoint
before quantization), on --device (the CPU by default: fp32).
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import torch

from ..report import Col, Output

DRY = False
CUDA = False                   # reads weights on the CPU


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from engine import EMBEDDED_MODEL
    ap.add_argument("--model", default=str(EMBEDDED_MODEL),
                    help="a checkpoint with MXFP8 or MXFP4 weights (the embedded model has none until quantized)")
    ap.add_argument("--images", type=int, default=8, help="T2I requests compared (0: the folds' table only)")
    ap.add_argument("--steps", type=int, default=None, help="their denoise steps (default: the checkpoint's)")
    ap.add_argument("--reference", default=None, help="the checkpoint before quantization (its images: the reference)")
    ap.add_argument("--device", default="cpu")


def _spread(scales: torch.Tensor) -> torch.Tensor:
    """Binades between each row's largest and smallest E8M0 block scale."""
    s = scales.to(torch.int32)
    return (s.amax(-1) - s.amin(-1)).flatten().float()


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine.model.loader import load
    from engine.model.moe import MoE
    from engine.model.packed import QuantPack
    from hunyuan_kernels.quant import humming
    from hunyuan_kernels.quant.formats import fold_rounded

    model = load(Path(args.model), "cpu", resident="quantized").model
    micros = {f"{n}.{w}": m.micros for n, m in model.named_modules() if isinstance(m, MoE) for w in ("w1", "w2")}
    kinds: dict[str, list] = defaultdict(list)
    for name, p in model.named_modules():
        if isinstance(p, QuantPack) and p.format.fmt in ("mxfp8", "mxfp4"):
            kinds[re.sub(r"\.\d+\.", ".N.", name)].append((name, p))
    if not kinds:
        out.say(f"{args.model} keeps no MXFP8 or MXFP4 weights (quantize it first: README, Quantized checkpoints)")
        return False
    rows = []
    for kind, packs in kinds.items():
        fmt = packs[0][1].format.fmt
        changed, worst, clamped, elements, spreads = 0.0, 0.0, 0.0, 0, []
        for name, p in packs:
            w = p.value()
            codes = w.codes.reshape(-1, *w.codes.shape[-2:])
            scales = w.scales.reshape(-1, *w.scales.shape[-2:])
            n = codes.shape[0] * codes.shape[1] * p.shape[-1]
            for c, s in zip(codes, scales):
                share, bad = fold_rounded(c, s, fmt)
                changed += share * c.shape[0] * p.shape[-1]
                worst = max(worst, bad)
            elements += n
            spreads.append(_spread(scales))
            if name in micros and fmt == "mxfp4":
                clamped += humming.clamped_share(w, micros=None if name.endswith("w1") else micros[name]) * n
        spread = torch.cat(spreads)
        experts = fmt == "mxfp4" and packs[0][0] in micros
        rows.append(dict(kind=kind, packs=len(packs), fmt=fmt, elements=elements, fold_changed=changed / elements,
                         fold_worst=worst, humming_clamped=clamped / elements if experts else None,
                         spread_median=spread.median().item(), spread_max=spread.max().item()))
    out.data["model"] = str(args.model)
    out.data["rows"] = rows
    out.table(rows, [Col("pack", "kind"), Col("n", "packs"), Col("format", "fmt"), Col("elements", "elements"),
                     Col("per-row fold: changed", "fold_changed", ".2e"), Col("worst / row max", "fold_worst", ".1e"),
                     Col("humming W4A8: blocks rounded", "humming_clamped", ".2e"),
                     Col("row spread (binades) median", "spread_median", ".0f"), Col("max", "spread_max", ".0f")],
              title=f"the folds of {args.model}")
    if args.images:
        out.data["images"] = images(args, out)
    return True


def _render(folder: str, device: str, fold: bool, prompts: list[str], steps: int | None) -> list:
    import io

    import numpy as np
    from PIL import Image as PILImage

    from engine.model.kernel_layouts import fold_all_to_fp8
    from engine.model.loader import load
    from engine.runtime.engine import Engine
    from engine.runtime.events import Image
    from engine.runtime.options import EngineOptions
    from engine.runtime.request import Request
    lm = load(Path(folder), device, resident="quantized")
    if fold:
        fold_all_to_fp8(lm.model)
    pipe = Engine(lm, options=EngineOptions(preview_every=0))
    got = []
    for seed, prompt in enumerate(prompts):
        ev = list(pipe.run(Request(prompt=prompt, bot_task="image", seed=seed, steps=steps)))
        png = next(e for e in ev if isinstance(e, Image)).png
        got.append(np.asarray(PILImage.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64))
    return got


def images(args: argparse.Namespace, out: Output) -> list[dict]:
    import numpy as np

    from .step_cache import PROMPTS, psnr, ssim
    prompts = list((PROMPTS * (args.images // len(PROMPTS) + 1))[:args.images])
    runs = {"weight-only": _render(args.model, args.device, False, prompts, args.steps),
            "folded (W8A8)": _render(args.model, args.device, True, prompts, args.steps)}
    if args.reference:
        runs["reference"] = _render(args.reference, args.device, False, prompts, args.steps)
    rows = []
    for a, b in (("folded (W8A8)", "weight-only"), ("weight-only", "reference"), ("folded (W8A8)", "reference")):
        if a in runs and b in runs:
            p = [psnr(x, y) for x, y in zip(runs[a], runs[b])]
            s = [ssim(x, y) for x, y in zip(runs[a], runs[b])]
            rows.append(dict(images=a, against=b, n=len(p), psnr_db=float(np.mean(p)), psnr_min_db=min(p),
                             ssim=float(np.mean(s))))
    out.table(rows, [Col("images", "images"), Col("against", "against"), Col("n", "n"),
                     Col("PSNR dB", "psnr_db", ".1f"), Col("min PSNR dB", "psnr_min_db", ".1f"),
                     Col("SSIM", "ssim", ".3f")],
              title=f"T2I without reasoning on {args.device} ({len(prompts)} prompts, seeds 0..)")
    return rows
