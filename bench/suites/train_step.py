"""Where a training step of the embedded model goes (one replica's work), for the next training run.

    python -m bench train-step [--model assets/model] [--device cuda] [--scales 1 2] [--steps 10]

For each batch scale: the step time (forward + backward + AdamW, data already on the host; the median
of --steps steps after 3 warm-up ones) and tokens/s; then, for the first scale, the frozen VAE encode of
the targets timed on its own and a torch.profiler table of the top operators by device time (by CPU
time without CUDA). Answers "is the step launch-bound (a larger batch is nearly free) or compute-bound",
and what to fuse first. Runs on the CPU too (--device cpu, small --scales: a check, not a training figure).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ..profiling import op_table
from ..report import Col, Output
from ..timing import Stages, time_ms

DRY = False
CUDA = False                   # --device cpu runs on the CPU


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from engine import EMBEDDED_MODEL
    ap.add_argument("--model", default=str(EMBEDDED_MODEL))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per scale (after 3 warm-up steps)")


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine.model.loader import load
    from train.train import RouterAux, SeqBatches, _pixels, transformer_losses

    dev = torch.device(args.device)
    amp = dev.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
    model = load(Path(args.model), dev, torch.float32).model
    model.vae.eval().requires_grad_(False)
    params = [p for n, p in model.named_parameters() if not n.startswith("vae.")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-5, fused=amp)
    aux = RouterAux(model)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    model.train()

    def step(batch: dict) -> None:
        with torch.autocast("cuda", torch.bfloat16, enabled=amp):
            L = transformer_losses(model, batch, dev, aux, 4.0)
            loss = L["ce"] + 3.0 * L["fm"] + 0.01 * L["aux"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    rows = []
    for scale in args.scales:
        ds = SeqBatches(str(Path(args.model) / "tokenizer.json"), cfg, seed=0, scale=scale)
        # group 1 (one reference): the most common mix of text, target and reference tokens
        batches = [b for b in (ds[i] for i in range(64)) if b.get("vit") is not None][:args.steps + 3]
        it = iter(batches)
        ms = time_ms(lambda: step(next(it)), "wall", n=len(batches) - 3, warmup=3)
        tokens = statistics.mean(b["ids"].numel() for b in batches[3:])
        rows.append(dict(scale=scale, ms=ms, tokens=tokens, tokens_s=tokens / ms * 1e3, device=args.device))
        out.say(f"batch scale {scale:g}: {ms:.1f} ms/step, {tokens:.0f} tokens/step, {tokens / ms * 1e3:.0f} tokens/s")
        if scale == args.scales[0]:
            clock = Stages()
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=amp), clock("vae encode"):
                for g in batches[3]["gen"].values():
                    model.vae.encode_moments(_pixels(g["img"], dev))
            rows[-1]["vae_encode_ms"] = clock.seconds["vae encode"] * 1e3
            out.say(f"  of which the frozen VAE encode of the targets: {rows[-1]['vae_encode_ms']:.1f} ms")
            for line in op_table(lambda: [step(b) for b in batches[3:6]], "cuda_time_total" if amp else "cpu_time_total",
                                 rows=20, cuda=amp):
                out.say(line)
    for h in aux.handles:
        h.remove()
    out.data["rows"] = rows
    out.table(rows, [Col("batch scale", "scale", "g"), Col("ms/step", "ms", ".1f"), Col("tokens/step", "tokens", ".0f"),
                     Col("tokens/s", "tokens_s", ".0f"), Col("VAE encode ms", "vae_encode_ms", ".1f"),
                     Col("device", "device")])
    return True
