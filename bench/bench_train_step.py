"""Where a training step of the embedded model goes (one replica's work), for the next training run.

    python bench/bench_train_step.py [--model assets/model] [--device cuda] [--scales 1 2] [--steps 10]

For each batch scale: step time (forward + backward + AdamW, data already on the host) and tokens/s,
then, for the first scale, a torch.profiler table of the top operators by device time (by CPU time
without CUDA), with the frozen VAE encode of the targets timed on its own. Answers "is the step
launch-bound (a larger batch is nearly free) or compute-bound", and what to fuse first.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import EMBEDDED_MODEL  # noqa: E402
from engine.model.loader import load  # noqa: E402
from engine.runtime.pipeline import synchronize  # noqa: E402
from train.train import (RouterAux, SeqBatches, _pixels,  # noqa: E402
                         transformer_losses)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(EMBEDDED_MODEL))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--steps", type=int, default=10, help="timed steps per scale (after 3 warm-up steps)")
    args = ap.parse_args(argv)
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

    for scale in args.scales:
        ds = SeqBatches(str(Path(args.model) / "tokenizer.json"), cfg, seed=0, scale=scale)
        # group 1 (one reference): the most common mix of text, target and reference tokens
        batches = [b for b in (ds[i] for i in range(64)) if b.get("vit") is not None][:args.steps + 3]
        for b in batches[:3]:
            step(b)
        synchronize(dev)
        t0, ntok = time.perf_counter(), 0
        for b in batches[3:]:
            step(b)
            ntok += b["ids"].numel()
        synchronize(dev)
        dt = (time.perf_counter() - t0) / max(1, len(batches) - 3)
        print(f"batch scale {scale:g}: {dt * 1e3:.1f} ms/step, {ntok / max(1, len(batches) - 3):.0f} tokens/step, "
              f"{ntok / (dt * max(1, len(batches) - 3)):.0f} tokens/s ({args.device})")
        if scale == args.scales[0]:
            b = batches[3]
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=amp):
                synchronize(dev)
                t = time.perf_counter()
                for g in b["gen"].values():
                    model.vae.encode_moments(_pixels(g["img"], dev))
                synchronize(dev)
            print(f"  of which the frozen VAE encode of the targets: {(time.perf_counter() - t) * 1e3:.1f} ms")
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if amp else [])
            with torch.profiler.profile(activities=acts) as prof:
                for b in batches[3:6]:
                    step(b)
                synchronize(dev)
            key = "cuda_time_total" if amp else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=20))
    for h in aux.handles:
        h.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
