"""Command line: `python -m engine {text, generate} ...` (see --help of each). A tiny checkpoint to run them on
is a development tool's job: `python -m tools.tiny OUT_DIR`."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from engine.runtime.events import Done, Error, Image, Ratio, Step, Text
from engine.serve.engine_config import EngineConfig
from engine.checkpoint.prompts import BOT_TASKS


def _add_common(p: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineConfig's, the same as `python app.py`'s), then the request's."""
    EngineConfig.add_arguments(p)
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
    p.add_argument("--lora-scale", type=float, default=None, metavar="S",
                   help="the strength of the --lora adapter this request applies: its update times S (default 1)")


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


def request_problem(model: str, req, merged: bool) -> str | None:
    """Why the engine would refuse `req`, judged on the checkpoint's small files before any weight is
    loaded (a bad --steps, --size or --image was reported after the whole model had loaded), naming the
    flag; None when it would run, or when the folder itself is wrong (the loader says what is missing)."""
    from engine.runtime.request import RequestError
    from engine.serve.info import ModelInfo
    try:
        info = ModelInfo.from_folder(model)
    except (ValueError, OSError):
        return None
    adapters = () if req.lora is None else (req.lora,)      # the one the command line loads
    try:
        info.validate(req, adapters, (req.lora, req.lora_scale) if merged and req.lora else None)
    except RequestError as e:
        if e.field is None:
            return str(e)
        return f"--{'image' if e.field == 'images' else e.field.replace('_', '-')}: {e}"
    return None


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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tx = sub.add_parser("text", help="run the text (AR) phase and stream it")
    _add_common(tx)
    gen = sub.add_parser("generate", help="generate an image (T2I, or TI2I with --image)")
    _add_common(gen)
    gen.add_argument("--steps", type=int)
    gen.add_argument("--guidance", type=float)
    gen.add_argument("--stretch", "--infer-align-image-size", action="store_true",
                     help="the official align option: fit reference images by stretching (not cropping) and give "
                          "the output the first one's aspect (/v1: infer_align_image_size)")
    gen.add_argument("--out", required=True, help="output PNG path")
    _add_step_caches(gen)
    return ap


def _request(args: argparse.Namespace, lora: str | None):
    from engine.runtime.request import Request
    from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams
    return Request(prompt=args.prompt, images=args.image, bot_task=args.bot_task, size=args.size,
                   seed=args.seed, system_prompt=args.system_prompt, custom_system_prompt=args.custom_system_prompt,
                   max_new_tokens=args.max_new_tokens, greedy=args.greedy, text_only=args.cmd == "text",
                   steps=getattr(args, "steps", None), guidance=getattr(args, "guidance", None),
                   stretch=getattr(args, "stretch", False),
                   taylor_cache=_step_cache(args, "use_taylor_cache", TaylorCacheParams),
                   block_cache=_step_cache(args, "use_block_cache", BlockCacheParams),
                   lora=lora, lora_scale=1.0 if args.lora_scale is None else args.lora_scale)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if (args.lora_scale is not None or args.lora_merged) and not args.loras:
        print(f"error: {'--lora-scale' if args.lora_scale is not None else '--lora-merged'} needs --lora PATH "
              "(the adapter it applies to)", file=sys.stderr)
        return 2
    try:
        config = EngineConfig.from_args(args).on_this_machine()
        if len(config.loras) > 1:
            raise ValueError("python -m engine applies one LoRA adapter to its request: give one --lora")
    except (ValueError, OSError) as e:          # a bad flag, a device this machine lacks, a plan that does not fit
        print(f"error: {e}", file=sys.stderr)
        return 2
    lora = config.loras[0][0] if config.loras else None
    if config.lora_merged:          # merged at the request's strength (--lora-scale, else --lora-merged-scale)
        args.lora_scale = config.lora_merged_scale if args.lora_scale is None else args.lora_scale
        config = dataclasses.replace(config, lora_merged_scale=args.lora_scale)
    req = _request(args, lora)
    out = Path(args.out) if args.cmd == "generate" else None
    if (problem := request_problem(config.model, req, args.lora_merged)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if config.world_size > 1:
        from engine.serve.server import EngineServer
        try:
            server = EngineServer(config)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with server:
            if not server.wait_ready():
                print(f"error: the engine did not start: {server.health()['last_error']}", file=sys.stderr)
                return 2
            return _print_events(server.stream(req), out)
    return _run_here(config, req, out)


def _run_here(config: EngineConfig, req, out: Path | None) -> int:
    """One rank: the request run in this process, on the engine a worker would build (Engine.from_config)."""
    from engine.model.loader import print_progress
    from engine.model.peft import AdapterError
    from engine.runtime.engine import Engine
    try:
        engine = Engine.from_config(config, progress=print_progress)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: cannot load {config.model}: {e}", file=sys.stderr)
        return 2
    return _print_events(engine.run(req), out)


if __name__ == "__main__":
    sys.exit(main())
