"""The seed article's tables (LightX2V, §9-10) for one rank of each 4-GPU plan, at the real Instruct shapes
(bench/instruct_config.json) with random bf16 weights, on ONE GPU.

    python -m bench tables [--plans hybrid4,tp4,tp2sp2,tp2cfg2] [--steps 3] [--decode 48] [--profile]

Each plan builds rank 0's resident shard and runs that rank's exact work through the engine's own code
(the `PrefillStep` prefill, a CUDA graph per length bucket; `DecodeStep` graph replays + the `sample` op;
`DenoiseRunner.prefill` and its steps, eager and as a graph; the VAE decode), with every collective
replaced by `engine.parallel.fake.FakeComm`: shapes kept, nothing moved. Every figure is therefore
COMPUTE ONLY, FOR ONE RANK, WITHOUT COMMUNICATION.

Workloads (as the article): T2I prefill 1251 tokens, 750 CoT tokens, 1024x1024, 50 steps, CFG; TI2I
prefill 6290 tokens (a 1024x1024 reference: its VAE and ViT tokens one full-attention block), 460 CoT
tokens. ALL = prefill + tokens x ms/token + the uncond prefix + 50 x DiT step + VAE decode: the sum of
the stages measured here, not a timed end-to-end run. Also: the multi-micro vs two-dispatch MoE
ablation (hybrid4; `bench.ablations`), the VAE decode (fp16 autocast vs fp32, its FLOPs and rate), the
ViT encode (bf16), peak memory; --profile: the CUDA kernels of hybrid4's T2I prefill and DiT step.
"""
from __future__ import annotations

import argparse
import time

import torch

import hunyuan_kernels as kernels
from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.parallel.layout import PhaseView
from engine.parallel.plan import ParallelPlan, get_plan
from engine.runtime.decode_step import DecodeStep
from engine.runtime.denoise import StepInputs
from engine.runtime.graphs import Graphs
from engine.runtime.prefill_step import GRAIN, PrefillStep

from .. import ablations, rank
from ..profiling import kernel_table
from ..report import Col, Output
from ..timing import time_ms

DRY = True
VOCAB = 120000                  # token ids drawn below the tokenizer's size
# name: (prefill tokens, CoT tokens, reference tokens inside the prefill)
WORKLOADS = {"T2I": (1251, 750, 0), "TI2I": (6290, 460, 64 * 64 + 1 + 1024)}     # VAE 64x64, <sep>, ViT 32x32
DRY_WORKLOADS = {"T2I": (40, 6, 0), "TI2I": (60, 5, 20)}
STEPS, SIDE = 50, 64            # 1024x1024: 64x64 latent tokens


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--plans", default="hybrid4,tp4,tp2sp2,tp2cfg2")
    ap.add_argument("--steps", type=int, default=3, help="timed DiT steps (median)")
    ap.add_argument("--decode", type=int, default=48, help="timed decode tokens (median after 4)")
    ap.add_argument("--profile", action="store_true", help="kernel tables of hybrid4's T2I prefill and DiT step")


def ar_phase(model: HunyuanImage3, view: PhaseView, prefill: int, cot: int, ref: int, decode_n: int,
             out: Output) -> dict:
    """The prefill through the engine's `PrefillStep` (a CUDA graph per length bucket where the prompt is
    short enough; the plain eager forward timed beside it), then `decode_n` decode tokens (graph replay,
    the sample op, the one host read each)."""
    cfg, dev = model.cfg, model.device
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    n = prefill + max(decode_n, GRAIN) + 8           # room for the prefill's bucket and the decode steps
    pos, blocks = rank.text_positions(n, dev, (8, 8 + ref) if ref else None)
    cache = KVCache.allocate(cfg.num_layers, 1, kvr, n, cfg.head_dim, model.dtype, dev)
    ids = torch.randint(0, min(VOCAB, cfg.vocab_size), (1, prefill), device=dev)
    graphed = PrefillStep(model, cache, view, use_graph=True)
    plain = PrefillStep(model, cache, view, padded=False)

    def run(step: PrefillStep):
        return lambda: step(model.transformer.embed(ids), pos, blocks)
    eager_ms, eager_host = time_ms(run(plain), "wall", n=3), time_ms(run(plain), "host", n=3, warmup=0)
    prefill_ms, host = time_ms(run(graphed), "wall", n=3), time_ms(run(graphed), "host", n=3, warmup=0)
    b = graphed.bucket(prefill)
    how = f"graph of bucket {b}" if ("prefill", b) in graphed.graphs else "eager (no graph for this length)"
    out.say(f"prefill of {prefill} tokens: {prefill_ms:.1f} ms ({how}; host enqueue {host:.1f} ms); the plain "
            f"eager forward {eager_ms:.1f} ms, of which host enqueue {eager_host:.1f} ms")
    # the engine's batched decode step with one row (slot 0 = the prefill's cache row; its last position is scratch)
    step = DecodeStep(model, cache, pos[None], view, Graphs(), (), use_graph=True)
    gen = torch.Generator(dev).manual_seed(0)
    state = {"token": 0, "index": prefill}

    def token() -> None:           # one token: the graph replay, the sample op, the one host read
        logits = step([(0, state["token"], state["index"])])[0]
        state["token"] = int(kernels.call("sample", logits, 0.6, 1024, 0.95, gen, False, None)) % min(VOCAB, cfg.vocab_size)
        state["index"] += 1
    per_token = time_ms(token, "wall", n=max(1, decode_n - 4), warmup=min(4, decode_n))
    return {"prefill_ms": prefill_ms, "prefill_enqueue_ms": host, "prefill_eager_ms": eager_ms,
            "prefill_graph": ("prefill", b) in graphed.graphs, "ms_per_token": per_token,
            "graph": ("decode", 1) in step.graphs,
            "tokens": cot, "decode_s": cot * per_token / 1e3}


def dit(model: HunyuanImage3, plan: ParallelPlan, prefix: int, steps: int, side: int, graph: bool = False) -> dict:
    """The uncond prefix's prefill and the DiT step (CFG batched; CFG-parallel: the cond branch)."""
    cfg_par = plan.replica_mode == "cfg"
    branches = [0] if cfg_par else [0, 1]
    runner = rank.denoise_runner(model, plan, rank.image_sequence(prefix, side), prefix, branches, graph)
    prefill_ms = time_ms(runner.prefill, "wall", n=1, warmup=1)
    x, t = rank.latent(model, side), torch.full((1,), 500.0, device=model.device)
    step_ms = time_ms(lambda: runner.velocity(1, StepInputs(x, t)), "wall", n=steps)
    return {"uncond_prefill_ms": prefill_ms, "step_ms": step_ms, "rows": len(branches),
            "local_tokens": -(-(1 + side * side) // plan.sp),
            "step_graph": runner.graphs is not None and runner.graph_key in runner.graphs}


def profile_stages(model: HunyuanImage3, plan: ParallelPlan, view: PhaseView, workload: tuple, side: int,
                   out: Output) -> None:
    """The CUDA kernels of the eager T2I prefill and of one eager DiT step (CFG batched)."""
    cfg, dev = model.cfg, model.device
    prefill, cot, _ = workload
    pos, blocks = rank.text_positions(prefill + 8, dev)
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    cache = KVCache.allocate(cfg.num_layers, 1, kvr, prefill + 8, cfg.head_dim, model.dtype, dev)
    ids = torch.randint(0, min(VOCAB, cfg.vocab_size), (1, prefill), device=dev)
    index = torch.arange(prefill, device=dev)
    for line in kernel_table(lambda: model.backbone(model.transformer.embed(ids), model.attn_batch(
            index, pos, blocks, prefill, view), cache, view), f"{plan.name} AR prefill of {prefill} tokens"):
        out.say(line)
    runner = rank.denoise_runner(model, plan, rank.image_sequence(prefill + cot, side), prefill + cot, [0, 1], False)
    x, t = rank.latent(model, side), torch.full((1,), 500.0, device=dev)
    for line in kernel_table(lambda: runner.velocity(1, StepInputs(x, t)), f"{plan.name} DiT step (CFG batched)"):
        out.say(line)


def vae_vit(model: HunyuanImage3, side: int) -> dict:
    """The VAE decode of one image (fp16 autocast, as the engine; fp32) and the ViT encode of one 1024x1024
    reference (bf16)."""
    from PIL import Image
    from torch.utils.flop_counter import FlopCounterMode

    from engine.model.vit import vit_preprocess
    z = rank.latent(model, side)
    with FlopCounterMode(display=False) as fc:
        model.decode_image(z)
    flops = fc.get_total_flops()
    res = {"vae_fp16_ms": time_ms(lambda: model.decode_image(z), "wall", n=3),
           "vae_fp32_ms": time_ms(lambda: model.vae.decode_latent(z), "wall", n=2), "vae_gflop": flops / 1e9}
    res["vae_tflops"] = flops / res["vae_fp16_ms"] / 1e9
    img = Image.fromarray(torch.randint(0, 255, (1024, 1024, 3), dtype=torch.uint8).numpy())
    v = vit_preprocess(img, model.cfg.vit_processor)
    pv, pm = v.pixel_values[None].to(model.device), v.pixel_attention_mask[None].to(model.device)
    res["vit_ms"] = time_ms(lambda: model.vision_aligner(model.vision_model(pv, pm, [v.spatial_shapes])), "wall", n=5)
    return res


def run(args: argparse.Namespace, out: Output) -> bool:
    dev = "cpu" if args.dry else "cuda"
    workloads, side, steps = (DRY_WORKLOADS, 4, 2) if args.dry else (WORKLOADS, SIDE, STEPS)
    cfg = rank.config(args.dry)
    ablations.register()
    plans = args.plans.split(",")
    rows, extra = [], {}
    with torch.no_grad():
        for name in plans:
            plan = get_plan(name)
            if dev == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            model = rank.build(cfg, plan, torch.bfloat16 if dev == "cuda" else torch.float32, dev)
            resident = rank.resident_gib(model)
            view = rank.ar_view(plan)
            for wl, (prefill, cot, ref) in workloads.items():
                a = ar_phase(model, view, prefill, cot, ref, args.decode, out)
                d = dit(model, plan, prefill + cot, args.steps, side)
                d["step_ms_graph"] = dit(model, plan, prefill + cot, args.steps, side, graph=True)["step_ms"]
                row = dict(plan=name, workload=wl, resident_gib=resident, **a, **d)
                if name == "hybrid4":
                    with ablations.instead("moe", "two_dispatch"):
                        row["step_ms_two_dispatch"] = dit(model, plan, prefill + cot, args.steps, side)["step_ms"]
                rows.append(row)
                out.say(f"{name} {wl}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                     for k, v in row.items()))
            if args.profile and name == "hybrid4" and dev == "cuda":
                profile_stages(model, plan, view, workloads["T2I"], side, out)
            if name == plans[0] and not args.dry:
                extra = vae_vit(model, side)
                out.say("VAE/ViT: " + ", ".join(f"{k} {v:.2f}" for k, v in extra.items()))
            peak = torch.cuda.max_memory_allocated() / 2 ** 30 if dev == "cuda" else None
            for r in rows:
                if r["plan"] == name:
                    r["peak_gib"] = peak
            out.say(f"{name}: built and measured in {time.perf_counter() - t0:.0f} s")
            del model
    vae = extra.get("vae_fp16_ms", 0.0)
    for r in rows:
        r["all_s"] = (r["prefill_ms"] + r["tokens"] * r["ms_per_token"] + r["uncond_prefill_ms"]
                      + steps * min(r["step_ms"], r["step_ms_graph"]) + vae) / 1e3
    out.data.update(rows=rows, vae_vit=extra, workloads=workloads, steps=steps)
    out.say(f"\nOne rank of each 4-GPU plan, compute only (collectives are no-ops), "
            f"{'bf16' if dev == 'cuda' else 'fp32 (dry run)'}, random weights")
    cols = [Col("plan", "plan"), Col("AR prefill ms", "prefill_ms", ".1f"), Col("AR decode s", "decode_s", ".2f"),
            Col("ms/token", "ms_per_token", ".2f"), Col("tokens", "tokens"), Col("DiT step ms", "step_ms", ".1f"),
            Col("graph step", "step_ms_graph", ".1f"), Col("uncond pre ms", "uncond_prefill_ms", ".1f"),
            Col("ALL s", "all_s", ".2f"), Col("peak GiB", "peak_gib", ".1f")]
    for wl, (prefill, cot, _) in workloads.items():
        out.table([r for r in rows if r["workload"] == wl], cols,
                  f"{wl} (prefill {prefill}, {cot} CoT tokens, {16 * side}x{16 * side}, {steps} steps, CFG)")
    for r in rows:
        if "step_ms_two_dispatch" in r:
            out.say(f"ablation {r['workload']} hybrid4 DiT step (eager): multi-micro {r['step_ms']:.1f} ms, "
                    f"two-dispatch {r['step_ms_two_dispatch']:.1f} ms")
    if extra:
        out.say(f"VAE decode {16 * side}x{16 * side}: fp16 autocast {extra['vae_fp16_ms']:.0f} ms "
                f"({extra['vae_gflop']:.0f} GFLOP, {extra['vae_tflops']:.0f} TFLOP/s), fp32 {extra['vae_fp32_ms']:.0f} ms; "
                f"ViT encode of one 1024x1024 reference (bf16) {extra['vit_ms']:.1f} ms")
    return True
