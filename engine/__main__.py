"""Command line: `python -m engine {text, generate} ...` (see --help of each). A tiny checkpoint to run them on
is a development tool's job: `python -m tools.tiny OUT_DIR`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import EMBEDDED_MODEL
from engine.model.kernel_layouts import MOE_KERNELS
from engine.runtime.events import Done, Error, Image, Ratio, Step, Text
from engine.spec.prompts import BOT_TASKS


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the engine on this machine, as one sentence; None when it can. Asked
    before anything is loaded or spawned, so a wrong --device ends with this, not a traceback."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device: use cpu or cuda"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"--device {device!r} is not supported: use cpu or cuda"
    if not torch.cuda.is_available():
        return (f"--device {device} was asked for, but this machine has no CUDA GPU that PyTorch can use "
                f"(torch {torch.__version__}); run with --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0"
    return None


def _add_common(p: argparse.ArgumentParser) -> None:
    if (EMBEDDED_MODEL / "config.json").exists():
        p.add_argument("--model", default=str(EMBEDDED_MODEL),
                       help="checkpoint folder (official layout; default: the embedded model)")
    else:
        p.add_argument("--model", required=True, help="checkpoint folder (official layout)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], help="reference image (repeat for up to 3)")
    p.add_argument("--bot-task", choices=BOT_TASKS,
                   help="reasoning mode (default: the checkpoint's generation config)")
    p.add_argument("--system-prompt", help="preset: en_unified, en_vanilla, en_recaption, en_think_recaption, "
                                           "dynamic, custom, None (default: generation config)")
    p.add_argument("--custom-system-prompt", help="text used with --system-prompt custom")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding instead of sampling")
    p.add_argument("--size", default="auto", help="auto, HxW (height first), W:H, or <img_ratio_k>")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="bfloat16 (cuda default), float32 (cpu default), float16")
    p.add_argument("--plan", help="parallel plan: tp1, tp2, hybrid4, tp4, tp2sp2, tp2cfg2, tp8, hybrid8, ... "
                                  "(default: from --gpus; on cpu the ranks are gloo processes)")
    p.add_argument("--gpus", type=int, default=None, help="number of ranks (default: the plan's, else 1)")
    p.add_argument("--sp-attn", choices=["ulysses", "kv_gather"], help="sequence-parallel attention kind")
    p.add_argument("--quantize", choices=["fp8"], default=None,
                   help="fp8: quantize a high-precision checkpoint's backbone linears to FP8 at load (one scale per "
                        "output channel; activations per token on CUDA)")
    p.add_argument("--lora", metavar="PATH", help="a LoRA adapter folder as PEFT saves it (adapter_config.json + "
                   "adapter_model.safetensors), applied to this request")
    p.add_argument("--lora-scale", type=float, default=None, metavar="S",
                   help="the adapter's strength: its update times S (default 1)")
    p.add_argument("--lora-merged", action="store_true",
                   help="fold the adapter into the weights at load (no per-step cost; float weights only)")
    p.add_argument("--moe-kernels", choices=MOE_KERNELS, default="auto",
                   help="the kernels of quantized experts: triton, humming, humming-fp8 or auto (see app.py --help)")
    p.add_argument("--cfg-serial", action="store_true", help="run the CFG branches one after the other")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run the AR decode and denoise steps eagerly on CUDA (by default each is a CUDA-graph replay)")


def _add_step_caches(p: argparse.ArgumentParser) -> None:
    """The step caches' options (engine/runtime/step_cache.py): the official Taylor cache's (same names
    and defaults as the official CLI) and the block cache's."""
    from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
    p.add_argument("--use-taylor-cache", action="store_true",
                   help="forecast the backbone's output between full steps (the official Taylor cache)")
    p.add_argument("--use-block-cache", action="store_true",
                   help="skip the backbone's later layers while its first layers' residual barely changes")
    for kind in (TaylorCacheParams, BlockCacheParams):
        for name in kind.names():
            flag = "--" + name.replace("_", "-")
            default = getattr(kind(), name)
            if isinstance(default, bool):
                p.add_argument(flag, action="store_true", help=f"{name} (default off)")
            else:
                p.add_argument(flag, type=type(default), default=default, help=f"{name} (default {default})")


def _step_cache(args: argparse.Namespace, use: str, kind):
    """The request's settings of one step cache from the flags, or None without its --use flag."""
    if not getattr(args, use, False):
        return None
    return kind(**{name: getattr(args, name) for name in kind.names()})


def _print_events(events, out_path: Path | None = None) -> int:
    section = None
    for ev in events:
        if isinstance(ev, Text):
            if ev.section != section:
                section = ev.section
                print(f"\n[{section}] ", end="", flush=True)
            print(ev.delta, end="", flush=True)
        elif isinstance(ev, Ratio):
            print(f"\n[size] {ev.width} x {ev.height} (width x height; bucket {ev.bucket})", flush=True)
        elif isinstance(ev, Step):
            print(f"\rstep {ev.i}/{ev.n}", end="" if ev.i < ev.n else "\n", file=sys.stderr, flush=True)
        elif isinstance(ev, Image):
            assert out_path is not None
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_bytes(ev.png)
            print(f"[image] {ev.width} x {ev.height} written to {out_path} (seed {ev.seed})", flush=True)
        elif isinstance(ev, Done):
            print(f"\n[timings] {ev.timings.summary()}", flush=True)
        elif isinstance(ev, Error):
            print(f"\nerror ({ev.kind}): {ev.message}", file=sys.stderr, flush=True)
            return 2 if ev.kind == "invalid" else 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    tx = sub.add_parser("text", help="run the text (AR) phase and stream it")
    _add_common(tx)

    gen = sub.add_parser("generate", help="generate an image (T2I, or TI2I with --image)")
    _add_common(gen)
    gen.add_argument("--steps", type=int)
    gen.add_argument("--guidance", type=float)
    gen.add_argument("--stretch", action="store_true", help="fit reference images by stretching (align option)")
    gen.add_argument("--out", required=True, help="output PNG path")
    _add_step_caches(gen)

    args = ap.parse_args(argv)
    from engine.parallel.plan import PlanError, get_plan
    from engine.runtime.request import Request
    from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
    if (problem := device_problem(args.device)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        name = args.plan
        if args.device.startswith("cuda") and args.plan is None and args.gpus is None:
            from engine.serve.server import fitting_plan     # the fewest GPUs the checkpoint fits
            name = fitting_plan(args.model, args.dtype, args.quantize, verbose=True)
        plan = get_plan(name, args.gpus, args.sp_attn)
    except (PlanError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if (args.lora_scale is not None or args.lora_merged) and args.lora is None:
        print(f"error: {'--lora-scale' if args.lora_scale is not None else '--lora-merged'} needs --lora PATH "
              "(the adapter it applies to)", file=sys.stderr)
        return 2
    lora = None if args.lora is None else Path(args.lora).resolve().name or "adapter"
    req = Request(prompt=args.prompt, images=args.image, bot_task=args.bot_task, size=args.size,
                  seed=args.seed, system_prompt=args.system_prompt, custom_system_prompt=args.custom_system_prompt,
                  max_new_tokens=args.max_new_tokens, greedy=args.greedy, text_only=args.cmd == "text",
                  steps=getattr(args, "steps", None), guidance=getattr(args, "guidance", None),
                  stretch=getattr(args, "stretch", False),
                  taylor_cache=_step_cache(args, "use_taylor_cache", TaylorCacheParams),
                  block_cache=_step_cache(args, "use_block_cache", BlockCacheParams),
                  lora=lora, lora_scale=1.0 if args.lora_scale is None else args.lora_scale)
    out = Path(args.out) if args.cmd == "generate" else None
    if plan.world > 1:
        from engine.serve.server import EngineServer
        try:
            server = EngineServer(args.model, args.device, args.dtype, plan=plan.name, sp_kind=plan.sp_kind,
                                  verbose=True, cfg_serial=args.cfg_serial, cuda_graph=args.cuda_graph,
                                  quantize=args.quantize, loras=[(lora, args.lora)] if lora else [],
                                  lora_merged=args.lora_merged, moe_kernels=args.moe_kernels)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with server:
            if not server.wait_ready():
                print(f"error: the engine did not start: {server.health()['last_error']}", file=sys.stderr)
                return 2
            return _print_events(server.stream(req), out)

    from engine.model.loader import load, parse_dtype, print_progress
    from engine.model.peft import ALL_TARGETS, read_peft
    from engine.runtime.pipeline import Pipeline
    try:
        lm = load(args.model, args.device, parse_dtype(args.dtype, args.device), progress=print_progress,
                  quantize=args.quantize)
    except (ValueError, OSError) as e:
        print(f"error: cannot load {args.model}: {e}", file=sys.stderr)
        return 2
    if lora:
        try:
            adapter = read_peft(args.lora, lm.cfg, targets=ALL_TARGETS)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.lora_merged:
            from engine.model.lora_merge import merge_adapter
            try:
                merge_adapter(lm.model, adapter, req.lora_scale, lora)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        else:
            lm.model.enable_lora(1, adapter.rank, mlp=bool(adapter.adapts_mlp)).install(lora, adapter)
    from engine.model.kernel_layouts import lay_out_experts
    try:
        lay_out_experts(lm.model, args.moe_kernels, lora_mlp=bool(lora) and not args.lora_merged
                        and bool(adapter.adapts_mlp))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return _print_events(Pipeline(lm, cfg_serial=args.cfg_serial, cuda_graph=args.cuda_graph).run(req), out)

if __name__ == "__main__":
    sys.exit(main())
