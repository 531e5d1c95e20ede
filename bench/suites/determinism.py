"""Where a run stops repeating itself: the same request run several times on fresh pipelines, every module's
output fingerprinted at every call, and the first (call, module) at which a run differs from the first run.

    python -m bench determinism [--model tiny|embedded] [--runs 4] [--steps 12] [--ar] [--graphs]
    python -m bench determinism --dry          # CPU fp32, 2 runs, 3 steps: the probe itself

Why: on 2026-12-02 (one H200) the tiny checkpoint's bf16 runs of one request (256x256, 12 steps, no AR)
differed from one another from step 9 on, eager or graph, while the embedded model's were bitwise equal
(issue 31's rule: results reproducible). This names the first module whose output differs, and lists the
ops PyTorch itself calls non-deterministic on the way (`torch.use_deterministic_algorithms(True,
warn_only=True)`: their warnings, one run).

Each run: a fresh Engine over the same loaded weights (graphs off unless --graphs: a replayed graph runs no
module hooks), the request `a green square on black`, 256x256, --steps, seed 5, reasoning off (or on with
--ar, 24 greedy tokens). Forward hooks on every module below the model record, per call in call order, the
module's name and a fingerprint of its first tensor output (fp64 sum and sum of squares, shape); a run
matches the first where every fingerprint is bitwise equal. The report: per run, the calls made, the first
differing call (module, its call index, both fingerprints), and the image bytes equal or not.
"""
from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch

from engine.model.loader import load
from engine.runtime.events import Error, Image
from engine.runtime.engine import Engine
from engine.runtime.options import EngineOptions
from engine.runtime.request import Request

from ..report import Col, Output

DRY = True


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", choices=["tiny", "embedded"], default="tiny", help="which checkpoint (default tiny)")
    ap.add_argument("--runs", type=int, default=4, help="runs of the request (default 4)")
    ap.add_argument("--steps", type=int, default=12, help="denoise steps (default 12)")
    ap.add_argument("--ar", action="store_true", help="reasoning on (think, 24 greedy tokens) before the image")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on (only the calls outside graphs are seen)")


class Fingerprints:
    """Forward hooks on every submodule of `model`: (name, fp64 sum, fp64 sum of squares, shape) of each
    call's first tensor output, in call order."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[tuple[str, float, float, tuple]] = []
        self._hooks = [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if name]

    def _hook(self, name: str):
        def record(module, inputs, output):
            t = output if isinstance(output, torch.Tensor) else next(
                (o for o in (output if isinstance(output, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None)
            if t is None or not t.is_floating_point() or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
                return          # a graph being captured: no host read (its replays run no hooks anyway)
            d = t.detach().double()
            self.calls.append((name, d.sum().item(), (d * d).sum().item(), tuple(t.shape)))
        return record

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def first_difference(a: list, b: list) -> tuple[int, tuple | None, tuple | None] | None:
    """(index, a's call, b's call) of the first call that differs, None when every call is equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        n = min(len(a), len(b))
        return n, a[n] if n < len(a) else None, b[n] if n < len(b) else None
    return None


def run_once(lm, req: Request, graphs: bool) -> tuple[list, bytes]:
    probe = Fingerprints(lm.model)
    try:
        events = list(Engine(lm, options=EngineOptions(preview_every=0, cuda_graph=graphs)).run(req))
    finally:
        probe.close()
    errors = [e for e in events if isinstance(e, Error)]
    if errors:
        raise RuntimeError(f"the request failed: {errors[0].message}")
    return probe.calls, next(e for e in events if isinstance(e, Image)).png


def run(args: argparse.Namespace, out: Output) -> bool:
    dev, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    runs, steps = (2, 3) if args.dry else (args.runs, args.steps)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        if args.model == "tiny":
            from tools.tiny import make_tiny
            folder = make_tiny(Path(tmp) / "tiny", seed=0)
        else:
            from engine import EMBEDDED_MODEL
            folder = EMBEDDED_MODEL
        lm = load(folder, dev, dtype)
        req = Request(prompt="a green square on black", bot_task="think" if args.ar else "image",
                      max_new_tokens=24, greedy=True, steps=steps, seed=5, size="256x256")
        # one run under PyTorch's own flag: the ops it knows to be non-deterministic warn, by name
        flagged: set[str] = set()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                first, png0 = run_once(lm, req, args.graphs)
            flagged = {str(w.message).split("\n")[0][:200] for w in seen if "deterministic" in str(w.message)}
        finally:
            torch.use_deterministic_algorithms(False)
        rows = [dict(run=0, calls=len(first), first_diff="-", module="-", ours="-", theirs="-", image_equal=True)]
        for r in range(1, runs):
            calls, png = run_once(lm, req, args.graphs)
            diff = first_difference(first, calls)
            row = dict(run=r, calls=len(calls), image_equal=png == png0, first_diff="-", module="-", ours="-",
                       theirs="-")
            if diff is not None:
                i, a, b = diff
                name = (a or b)[0]
                row.update(first_diff=i, module=name, ours=str(a[1:3] if a else None), theirs=str(b[1:3] if b else None),
                           nth=sum(1 for c in first[:i] if c[0] == name))
            rows.append(row)
    out.data.update(rows=rows, flagged=sorted(flagged), model=args.model, steps=steps, ar=args.ar, graphs=args.graphs)
    for f in sorted(flagged):
        out.say(f"non-deterministic per PyTorch: {f}")
    if not flagged:
        out.say("PyTorch flagged no non-deterministic op in the first run")
    out.table(rows, [Col("run", "run"), Col("calls", "calls"), Col("first differing call", "first_diff"),
                     Col("module", "module"), Col("run 0 (sum, sum sq)", "ours"), Col("this run", "theirs"),
                     Col("image equal", "image_equal")],
              title=f"{args.model}, {dtype}, {steps} steps, reasoning {'on' if args.ar else 'off'}, "
                    f"graphs {'on' if args.graphs else 'off'}" + (" (dry run)" if args.dry else ""))
    # the probe's own check: in a dry run (CPU fp32) every run repeats the first, call for call
    return all(r["first_diff"] == "-" and r["image_equal"] for r in rows) if args.dry else True
