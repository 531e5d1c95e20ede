"""A 3-turn edit conversation (issue 29): what each turn's prompt costs under each history policy.

    python -m bench conversation           # one GPU: the embedded model end to end, then one hybrid4 rank
    python -m bench conversation --dry     # CPU, the embedded model and the tiny config: the suite runs

1. The embedded model (bf16 on CUDA, as served): turn 1 edits a reference image; turns 2 and 3 continue
   the conversation under each policy (engine/runtime/history.py), with the prefix cache
   (engine/runtime/prefix_cache.py) off and on. Per turn: the input tokens of its sequence (as the engine
   counts them: engine/serve/usage.py), the tokens taken from the cache, the AR prefill and the denoise
   prefill ms (the engine's Timings), the request's wall time; medians of --repeat runs of the whole conversation
   after a warm-up, each run from an empty cache (the requests are fixed by a first run).
2. Real shapes: rank 0 of hybrid4 (random bf16 weights, collectives no-ops) prefills each turn's
   sequence at a 1024x1024 reference, laid out by the engine's sequence builder (the embedded model's
   tokenizer and system prompt, the reasoning part 1 wrote, every image at the real config's 1024x1024
   grid: 64x64 VAE tokens + 1024 ViT slots): the whole prompt (cache off), and the suffix after what the
   turn shares with the previous turn's sequence through its reasoning (cache on: that K/V copied in,
   the rest prefilled by the plain forward, as ARRow.prefill does). ms are CUDA-event medians.
"""
from __future__ import annotations

import argparse
import io
import statistics
from pathlib import Path

import torch

from .. import rank
from ..report import Col, Output
from ..timing import time_ms

DRY = True
CUDA = True
PROMPTS = ("make the circle blue", "move the square to the right", "add a small red star at the top")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each turn (median)")


def _reference() -> bytes:
    from PIL import Image as PILImage, ImageDraw
    img = PILImage.new("RGB", (256, 256), (235, 235, 235))
    d = ImageDraw.Draw(img)
    d.ellipse((30, 90, 100, 160), fill=(220, 38, 38))
    d.rectangle((150, 90, 220, 160), fill=(40, 160, 60))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def embedded(args: argparse.Namespace, out: Output) -> tuple[list[dict], dict]:
    """Part 1; also what part 2 lays out: each (policy, turn)'s request and the reasoning of each turn."""
    import time

    from engine import EMBEDDED_MODEL
    from engine.runtime.engine import Engine
    from engine.runtime.events import Done, Error, Image, Started
    from engine.runtime.history import POLICIES, Turn, reasoning_of
    from engine.runtime.options import EngineOptions
    from engine.runtime.request import Request
    from engine.serve.engine_config import EngineConfig
    from engine.serve.usage import InputTokens
    dev = "cpu" if args.dry else "cuda"
    folder = Path(args.model or EMBEDDED_MODEL)
    on = Engine.from_config(EngineConfig(model=str(folder), device=dev, dtype=None, plan="tp1", world_size=1,
                                         sp_kind="ulysses", preview_every=0))
    lm = on.loaded
    pipes = {"off": Engine(lm, options=EngineOptions(preview_every=0, prefix_cache_bytes=0)), "on": on}
    repeat = 1 if args.dry else args.repeat

    def once(pipe: Engine, req: Request) -> tuple[Done, bytes, InputTokens]:
        t0 = time.perf_counter()
        ev = list(pipe.run(req))
        errs = [e for e in ev if isinstance(e, Error)]
        if errs:
            raise RuntimeError(f"{req.prompt!r}: {errs[0].message}")
        done = next(e for e in ev if isinstance(e, Done))
        done.timings.total_s = time.perf_counter() - t0
        inputs = InputTokens.of(next(e for e in ev if isinstance(e, Started)))     # as the engine counted them
        return done, next(e for e in ev if isinstance(e, Image)).png, inputs

    ref = _reference()
    common = dict(seed=1, steps=4 if args.dry else None, max_new_tokens=16 if args.dry else None)
    first = Request(prompt=PROMPTS[0], images=[ref], **common)
    for pipe in pipes.values():
        once(pipe, first)                                   # warm-up: first-call allocations, graphs
    bot_task = lm.gen.bot_task
    # the requests of each policy's conversation, fixed by one run (each turn's history: what the turns
    # before it gave), then timed with the cache off and on
    plan: dict = {("-", 1): first}
    done, png, _ = once(pipes["on"], first)
    base = Turn(PROMPTS[0], (ref,), reasoning_of(bot_task, done.cot_text), png)
    for policy in POLICIES:
        history = (base,)
        for k, prompt in enumerate(PROMPTS[1:], start=2):
            req = plan[(policy, k)] = Request(prompt=prompt, history=history, history_policy=policy, **common)
            done, png, _ = once(pipes["on"], req)
            history += (Turn(prompt, (), reasoning_of(bot_task, done.cot_text), png),)
    rows = []
    for policy in POLICIES:
        reqs = [first] + [plan[(policy, k)] for k in range(2, len(PROMPTS) + 1)]
        for cache, pipe in pipes.items():
            runs = []
            for _ in range(repeat):
                pipe.prefix.clear()
                pipe.encodings.lru.clear()
                runs.append([once(pipe, req) for req in reqs])
            for k, req in enumerate(reqs, start=1):
                med = lambda f: statistics.median(f(r[k - 1][0].timings) for r in runs)     # noqa: E731
                tokens = runs[0][k - 1][2]
                rows.append(dict(policy=policy, cache=cache, turn=k, input_tokens=tokens.total,
                                 image_tokens=tokens.image, cached_tokens=int(med(lambda t: t.ar_cached_tokens)),
                                 ar_prefill_ms=med(lambda t: t.ar_prefill_ms),
                                 dit_prefill_ms=med(lambda t: t.dit_prefill_ms), total_s=med(lambda t: t.total_s)))
    for r in rows:
        out.say(", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    out.table(rows, [Col("policy", "policy"), Col("prefix cache", "cache"), Col("turn", "turn"),
                     Col("input tokens", "input_tokens"), Col("of them image", "image_tokens"),
                     Col("cached", "cached_tokens"), Col("AR prefill ms", "ar_prefill_ms", ".1f"),
                     Col("DiT prefill ms", "dit_prefill_ms", ".1f"), Col("request s", "total_s", ".2f")],
              f"The embedded model ({dev}), a 3-turn edit conversation, median of {repeat}")
    return rows, plan


def real_shapes(args: argparse.Namespace, out: Output, plan: dict) -> list[dict]:
    """Part 2: each turn's sequence at the real grid, prefilled by one hybrid4 rank."""
    from engine import EMBEDDED_MODEL
    from engine.model.attention import KVCache
    from engine.parallel.plan import get_plan
    from engine.runtime.history import select
    from engine.runtime.handoff import reusable_prefix
    from engine.runtime.sequence import CondImageLayout, PastTurnLayout, user_turn
    from engine.serve.info import ModelInfo
    from engine.checkpoint.prompts import SystemPrompts
    from engine.checkpoint.tokenizer import Tokenizer
    dev = "cpu" if args.dry else "cuda"
    cfg = rank.config(dry=args.dry)
    info = ModelInfo.from_folder(Path(args.model or EMBEDDED_MODEL))
    tok = Tokenizer(info.folder / "tokenizer.json", info.cfg.image_base_size, len(info.buckets))
    system = SystemPrompts.load(info.folder).resolve(info.gen.use_system_prompt, info.gen.bot_task)
    side = 4 if args.dry else 64                   # 1024x1024: 64x64 VAE tokens
    vit = (4, 4) if args.dry else (32, 32)
    image = CondImageLayout((side, side), 16, vit, vit[0] * vit[1])
    p = get_plan("hybrid4")
    model = rank.build(cfg, p, torch.bfloat16, dev)
    view = rank.ar_view(p)
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    rows = []

    def layout(req):
        shown, carried = select(req.history, len(req.images), req.history_policy)
        seen = [req.history[i] for i in shown]
        past = [PastTurnLayout(t.prompt, tuple(image for _ in t.images), t.reasoning,
                               None if t.image is None else image) for t in seen]
        return past, [image] * ((carried is not None) + len(req.images))

    for (policy, k), req in plan.items():
        past, own = layout(req)
        seq = user_turn(tok, system, req.prompt, own, past, cfg.cond_token_attn_type).text("Assistant: <think>").build()
        cached = 0
        if past:     # a turn that shows earlier turns reads the cache: what the previous turn's sequence
            # shares with it through the previous turn's reasoning (prefix_cache.py)
            before = plan[(policy, k - 1) if k > 2 else ("-", 1)]
            before_past, before_own = layout(before)
            b = user_turn(tok, system, before.prompt, before_own, before_past, cfg.cond_token_attn_type)
            b.text("Assistant: ")
            prev = (b.assistant_text(req.history[-1].reasoning) if req.history[-1].reasoning else b).build()
            cached = min(reusable_prefix(seq.ids, prev.ids, len(prev)), len(seq) - 1)
        T = seq.tensors(dev)
        L = len(seq)
        ids = T["ids"].clamp(max=cfg.vocab_size - 1)[None]
        cache = KVCache.allocate(cfg.num_layers, 1, kvr, L + 8, cfg.head_dim, model.dtype, dev)

        def prefill(start: int):
            index = torch.arange(start, L, device=dev)
            h = model.backbone(model.transformer.embed(ids[:, start:]),
                               model.attn_batch(index, T["pos"], T["blocks"], L, view), cache, view)
            return model.transformer.logits(h[:, -1], view)

        with torch.no_grad():
            ms = {n: time_ms(lambda: prefill(n), "wall", n=1, warmup=0) if args.dry else
                  time_ms(lambda: prefill(n), "events", n=5) for n in {0, cached}}
        rows.append(dict(policy=policy, turn=k, tokens=L, images=len(seq.cond_images), cached=cached,
                         prefill_ms=ms[0], cached_prefill_ms=ms[cached]))
        out.say(f"{policy} turn {k}: {L} tokens, {len(seq.cond_images)} images, prefill {ms[0]:.1f} ms; "
                f"{cached} cached: {ms[cached]:.1f} ms")
        del cache
    t1 = next(r["prefill_ms"] for r in rows if r["turn"] == 1)
    for r in rows:
        r["vs_turn1"] = r["prefill_ms"] / t1
        r["cached_vs_turn1"] = r["cached_prefill_ms"] / t1
    out.table(rows, [Col("policy", "policy"), Col("turn", "turn"), Col("tokens", "tokens"), Col("images", "images"),
                     Col("prefill ms", "prefill_ms", ".1f"), Col("x turn 1", "vs_turn1", ".2f"),
                     Col("cached", "cached"), Col("with the cache ms", "cached_prefill_ms", ".1f"),
                     Col("x turn 1 ", "cached_vs_turn1", ".2f")],
              "One hybrid4 rank (AR TP4 view) at the real shapes: each turn's AR prefill, 1024x1024 images, "
              "without and with the prefix cache")
    return rows


def run(args: argparse.Namespace, out: Output) -> bool:
    rows, plan = embedded(args, out)
    out.data["embedded"] = rows
    out.data["real_shapes"] = real_shapes(args, out, plan)
    return True
