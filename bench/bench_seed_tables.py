"""The seed article's tables (LightX2V, §9-10) for one rank of each 4-GPU plan, at the real Instruct
shapes (`bench/instruct_config.json`) with random bf16 weights, on ONE GPU.

    python bench/bench_seed_tables.py [--plans hybrid4,tp4,tp2sp2,tp2cfg2] [--steps 3] [--decode 48]

Each plan builds rank 0's resident shard and runs that rank's exact work through the engine's own code
(the `PrefillStep` prefill, a CUDA graph per length bucket, `DecodeStep` graph replays + the `sample` op, `DenoiseRunner.prefill` and its
steps, the VAE decode), with every collective replaced by `FakeComm`: shapes kept, nothing moved.
Every figure is therefore COMPUTE ONLY, FOR ONE RANK, WITHOUT COMMUNICATION.

Workloads (as the article): T2I prefill 1251 tokens, 750 CoT tokens, 1024x1024, 50 steps, CFG; TI2I
prefill 6290 tokens (a 1024x1024 reference: its VAE and ViT tokens one full-attention block), 460 CoT
tokens. ALL = prefill + tokens x ms/token + the uncond prefix + 50 x DiT step + VAE decode: the sum of
the stages measured here. Also: the multi-micro vs two-dispatch MoE ablation (hybrid4), the VAE decode
(fp16 autocast vs fp32, with its FLOP count and rate), the ViT encode (bf16), peak memory.
Details go to $OUT/seed_tables.json when $OUT is set; the tables are printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                                  # noqa: E402
from engine.model.attention import KVCache                      # noqa: E402
from engine.model.hunyuan import HunyuanImage3                  # noqa: E402
from engine.parallel.layout import Comm, PhaseView              # noqa: E402
from engine.parallel.plan import ParallelPlan, get_plan          # noqa: E402
from engine.runtime.decode_step import DecodeStep                # noqa: E402
from engine.runtime.prefill_step import GRAIN, PrefillStep       # noqa: E402
from engine.runtime.denoise import DenoiseRunner                 # noqa: E402
from engine.runtime.handoff import cache_heads                   # noqa: E402
from engine.runtime.sequence import GenImageSpan, Sequence       # noqa: E402
from engine.spec.config import ModelConfig                       # noqa: E402

WORKLOADS = {  # name: (prefill tokens, CoT tokens, reference tokens inside the prefill)
    "T2I": (1251, 750, 0),
    "TI2I": (6290, 460, 64 * 64 + 1 + 1024),      # VAE 64x64, <joint_img_sep>, ViT 32x32 patches
}
STEPS, SIDE = 50, 64                               # 1024x1024 image: 64x64 latent tokens


class FakeComm(Comm):
    """A group of `size` ranks whose collectives return the right shapes and move nothing. What the real
    group does on the rank itself stays: the all-to-all makes its send buffer contiguous first, as NCCL
    needs it (engine/parallel/groups.py), and returns a contiguous result, as NCCL writes it."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def all_gather(self, t, dim):
        return torch.cat([t] * self.size, dim=dim) if self.size > 1 else t

    def all_to_all(self, t):
        return t.contiguous() if self.size > 1 else t


DEV = "cuda"


def median_ms(fn, n: int, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        if DEV == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if DEV == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def build(cfg: ModelConfig, plan: ParallelPlan) -> HunyuanImage3:
    model = HunyuanImage3(cfg, plan.layout(0), torch.bfloat16 if DEV == "cuda" else torch.float32, DEV)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval()


def text_positions(n: int, block: tuple[int, int] | None = None):
    pos = torch.arange(n, device=DEV).unsqueeze(1).repeat(1, 2)
    blocks = torch.full((n,), -1, device=DEV)
    if block:
        blocks[block[0]:block[1]] = 0
    return pos, blocks


def ar_phase(model: HunyuanImage3, view: PhaseView, prefill: int, cot: int, ref: int, decode_n: int) -> dict:
    """The prefill through the engine's `PrefillStep` (a CUDA graph per length bucket where the prompt is
    short enough; the plain forward's eager time printed beside it), then `decode_n` graph decode steps."""
    cfg = model.cfg
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    n = prefill + max(decode_n, GRAIN) + 8           # room for the prefill's bucket and the decode steps
    pos, blocks = text_positions(n, (8, 8 + ref) if ref else None)
    cache = KVCache.allocate(cfg.num_layers, 1, kvr, n, cfg.head_dim, model.dtype, DEV)
    ids = torch.randint(0, min(120000, model.cfg.vocab_size), (1, prefill), device=DEV)
    graphed = PrefillStep(model, cache, view, use_graph=True)
    plain = PrefillStep(model, cache, view, padded=False)

    def timed(step: PrefillStep) -> tuple[float, float]:
        """(median wall ms, median host ms to issue it) of the prefill through `step`."""
        def run():
            return step(model.transformer.embed(ids), pos, blocks)
        wall = median_ms(run, 3)
        enqueue = []
        for _ in range(3):
            if DEV == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            enqueue.append((time.perf_counter() - t0) * 1e3)
        if DEV == "cuda":
            torch.cuda.synchronize()
        return wall, sorted(enqueue)[1]
    eager_ms, eager_enqueue = timed(plain)
    prefill_ms, enqueue = timed(graphed)
    b = graphed.bucket(prefill)
    how = f"graph of bucket {b}" if b in graphed.graphs else "eager (no graph for this length)"
    print(f"prefill of {prefill} tokens: {prefill_ms:.1f} ms ({how}; host enqueue {enqueue:.1f} ms); the plain "
          f"eager forward {eager_ms:.1f} ms, of which host enqueue {eager_enqueue:.1f} ms", flush=True)
    step = DecodeStep(model, pos, blocks, cache, view, use_graph=True)
    gen = torch.Generator(DEV).manual_seed(0)
    token = 0
    times = []
    for s in range(decode_n):      # one token: the graph replay, the sample op, the one host read
        t0 = time.perf_counter()
        logits = step(token, prefill + s)
        token = int(kernels.call("sample", logits, 0.6, 1024, 0.95, gen, False, None)) % min(120000, cfg.vocab_size)
        times.append((time.perf_counter() - t0) * 1e3)
    per_token = sorted(times[4:])[len(times[4:]) // 2]
    return {"prefill_ms": prefill_ms, "prefill_enqueue_ms": enqueue, "prefill_eager_ms": eager_ms,
            "prefill_graph": b in graphed.graphs, "ms_per_token": per_token, "graph": step.graph is not None,
            "tokens": cot, "decode_s": cot * per_token / 1e3}


def image_sequence(prefix: int, meta_tokens: int = 1) -> Sequence:
    """A stand-in image-stage sequence: `prefix` text tokens, <timestep> (Distil: and <guidance>
    <timestep_r>: meta_tokens 3), the 64x64 image, <eoi>."""
    meta, start, hw = prefix, prefix + meta_tokens, SIDE * SIDE
    n = start + hw + 1
    pos = [(i, i) for i in range(n)]
    for r in range(SIDE):
        for c in range(SIDE):
            pos[start + r * SIDE + c] = (start + (hw - SIDE) // 2 + r, start + (hw - SIDE) // 2 + c)
    blocks = [-1] * n
    blocks[start:start + hw] = [0] * hw
    return Sequence(ids=[5] * n, uncondable=[False] * n, pos=pos, blocks=blocks,
                    gen_image=GenImageSpan(meta, start, SIDE, SIDE))


def dit(model: HunyuanImage3, plan: ParallelPlan, prefix: int, steps: int, graph: bool = False) -> dict:
    cfg = model.cfg
    seq = image_sequence(prefix)
    dn = PhaseView(0, plan.micros, FakeComm(plan.storage_tp), FakeComm(plan.sp), plan.sp_kind)
    cfg_par = plan.replica_mode == "cfg"
    branches = [0] if cfg_par else [0, 1]
    heads = cache_heads(plan, 0, 0, model.transformer.layers[0].self_attn.kv_per_micro)
    L = len(seq)
    cache = KVCache.allocate(cfg.num_layers, len(branches), heads.alloc.stop, L + 1, cfg.head_dim,
                             model.dtype, DEV)
    ids = torch.full((2, L), 5, device=DEV)
    # cond: the AR cache holds the prefix (the hand-off); uncond: prefilled (CFG-parallel rank 0: cond only)
    starts = [prefix if b == 0 else 0 for b in branches]
    runner = DenoiseRunner(model, seq, [], ids, cache.heads(heads.denoise), dn, branches, starts, L,
                           FakeComm(2 if cfg_par else 1), use_graph=graph)
    prefill_ms = median_ms(runner.prefill, 1, warm=1)
    x = torch.randn(1, int(cfg.vae["latent_channels"]), SIDE, SIDE, device=DEV)
    t = torch.full((1,), 500.0, device=DEV)
    step_ms = median_ms(lambda: runner.velocity(1, x, t, None, None), steps)
    local = -(-(1 + SIDE * SIDE) // plan.sp)
    return {"uncond_prefill_ms": prefill_ms, "step_ms": step_ms, "rows": len(branches), "local_tokens": local,
            "step_graph": runner._graph is not None}


def profile_stages(model: HunyuanImage3, plan: ParallelPlan, view: PhaseView) -> None:
    cfg = model.cfg
    prefill, cot, _ = WORKLOADS["T2I"]
    pos, blocks = text_positions(prefill + 8)
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    cache = KVCache.allocate(cfg.num_layers, 1, kvr, prefill + 8, cfg.head_dim, model.dtype, DEV)
    ids = torch.randint(0, min(120000, model.cfg.vocab_size), (1, prefill), device=DEV)
    index = torch.arange(prefill, device=DEV)
    profile(lambda: model.backbone(model.transformer.embed(ids), index, pos, blocks, cache, prefill, view),
            f"{plan.name} AR prefill of {prefill} tokens")
    seq = image_sequence(prefill + cot)
    dn = PhaseView(0, plan.micros, FakeComm(plan.storage_tp), FakeComm(plan.sp), plan.sp_kind)
    heads = cache_heads(plan, 0, 0, kvr)
    dcache = KVCache.allocate(cfg.num_layers, 2, heads.alloc.stop, len(seq) + 1, cfg.head_dim, model.dtype, DEV)
    runner = DenoiseRunner(model, seq, [], torch.full((2, len(seq)), 5, device=DEV), dcache.heads(heads.denoise),
                           dn, [0, 1], [prefill + cot, 0], len(seq), FakeComm(1))
    x = torch.randn(1, int(cfg.vae["latent_channels"]), SIDE, SIDE, device=DEV)
    t = torch.full((1,), 500.0, device=DEV)
    profile(lambda: runner.velocity(1, x, t, None, None), f"{plan.name} DiT step (CFG batched)")


def vae_vit(model: HunyuanImage3) -> dict:
    from torch.utils.flop_counter import FlopCounterMode
    z = torch.randn(1, int(model.cfg.vae["latent_channels"]), SIDE, SIDE, device=DEV)
    out = {}
    with FlopCounterMode(display=False) as fc:
        model.decode_image(z)
    flops = fc.get_total_flops()
    out["vae_fp16_ms"] = median_ms(lambda: model.decode_image(z), 3)
    out["vae_fp32_ms"] = median_ms(lambda: model.vae.decode_latent(z), 2)
    out["vae_gflop"] = flops / 1e9
    out["vae_tflops"] = flops / out["vae_fp16_ms"] / 1e9
    from PIL import Image
    from engine.model.vit import vit_preprocess
    img = Image.fromarray(torch.randint(0, 255, (1024, 1024, 3), dtype=torch.uint8).numpy())
    v = vit_preprocess(img, model.cfg.vit_processor)
    pv, pm = v.pixel_values[None].to(DEV), v.pixel_attention_mask[None].to(DEV)
    out["vit_ms"] = median_ms(lambda: model.vision_aligner(model.vision_model(pv, pm, [v.spatial_shapes])), 5)
    return out


def profile(fn, label: str, rows: int = 24) -> None:
    """The CUDA kernels of one call of `fn`, by total time (where a stage's time goes), then the
    operators that launched them, by the CUDA time of their own kernels (which op an elementwise
    kernel belongs to)."""
    from torch.profiler import ProfilerActivity, profile as prof
    fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    events = p.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = [e for e in events if e.device_type != torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    print(f"\nprofile: {label}")
    for title, evs, key in (("kernels", kernels, "device_time_total"), ("operators (self CUDA time)", ops,
                                                                       "self_device_time_total")):
        evs = sorted(evs, key=lambda e: getattr(e, key), reverse=True)[:rows]
        total = sum(getattr(e, key) for e in (kernels if title == "kernels" else ops)) / 1e3
        print(f"{title}: {total:.1f} ms in all")
        for e in evs:
            print(f"  {getattr(e, key) / 1e3:9.3f} ms {e.count:5d}x  {e.key[:90]}")


def register_two_dispatch() -> None:
    from kernels import moe_fast

    @kernels.registry.backend("moe", "two_dispatch", dtypes=(torch.bfloat16,))
    def two_dispatch(*args):
        return moe_fast.moe_cuda(*args, two_dispatch=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", default="hybrid4,tp4,tp2sp2,tp2cfg2")
    ap.add_argument("--config", default=str(Path(__file__).with_name("instruct_config.json")))
    ap.add_argument("--steps", type=int, default=3, help="timed DiT steps (median)")
    ap.add_argument("--decode", type=int, default=48, help="timed decode tokens (median after 4)")
    ap.add_argument("--profile", action="store_true", help="kernel tables of hybrid4's T2I prefill and DiT step")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny config and workloads: checks the script runs")
    args = ap.parse_args()
    if args.smoke:
        global DEV, SIDE, STEPS
        DEV, SIDE, STEPS = "cpu", 4, 2
        WORKLOADS.update({"T2I": (40, 6, 0), "TI2I": (60, 5, 20)})
    base = json.loads(Path(args.config).read_text())
    if args.smoke:                     # the tiny config: the real one does not fit a CPU run
        from tools.tiny import tiny_config
        base = tiny_config(512, distil=False)
    cfg = ModelConfig.from_dict(base)
    register_two_dispatch()
    rows, extra = [], {}
    with torch.no_grad():
        for name in args.plans.split(","):
            plan = get_plan(name)
            if DEV == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            model = build(cfg, plan)
            resident = sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30
            ar_view = PhaseView(plan.micro(0), 1, FakeComm(plan.ar_tp))
            for wl, (prefill, cot, ref) in WORKLOADS.items():
                with kernels.allowed("triton"):
                    a = ar_phase(model, ar_view, prefill, cot, ref, args.decode)
                    d = dit(model, plan, prefill + cot, args.steps)
                    d["step_ms_graph"] = dit(model, plan, prefill + cot, args.steps, graph=True)["step_ms"]
                row = dict(plan=name, workload=wl, resident_gib=resident, **a, **d)
                if name == "hybrid4":
                    with kernels.allowed("two_dispatch"):
                        row["step_ms_two_dispatch"] = dit(model, plan, prefill + cot, args.steps)["step_ms"]
                rows.append(row)
                print(f"{name} {wl}: {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})}",
                      flush=True)
            if args.profile and name == "hybrid4":
                with kernels.allowed("triton"):
                    profile_stages(model, plan, ar_view)
            if name == args.plans.split(",")[0] and not args.smoke:
                extra = vae_vit(model)
                print(f"VAE/ViT: {json.dumps({k: round(v, 2) for k, v in extra.items()})}", flush=True)
            for r in rows:
                if r["plan"] == name:
                    r["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if DEV == "cuda" else 0.0
            print(f"{name}: built and measured in {time.perf_counter() - t0:.0f} s", flush=True)
            del model
    vae = extra.get("vae_fp16_ms", 0.0)
    for r in rows:
        r["all_s"] = (r["prefill_ms"] + r["tokens"] * r["ms_per_token"] + r["uncond_prefill_ms"]
                      + STEPS * min(r["step_ms"], r["step_ms_graph"]) + vae) / 1e3
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "seed_tables.json").write_text(json.dumps(dict(rows=rows, vae_vit=extra), indent=1))
    print("\nOne rank of each 4-GPU plan, compute only (collectives are no-ops), one H200, bf16, random weights")
    for wl in WORKLOADS:
        print(f"\n{wl} (prefill {WORKLOADS[wl][0]}, {WORKLOADS[wl][1]} CoT tokens, 1024x1024, {STEPS} steps, CFG)")
        print(f"{'plan':<9}{'AR prefill ms':>14}{'AR decode s':>12}{'ms/token':>10}{'tokens':>8}"
              f"{'DiT step ms':>12}{'graph step':>11}{'uncond pre ms':>14}{'ALL s':>8}{'peak GiB':>9}")
        for r in (r for r in rows if r["workload"] == wl):
            print(f"{r['plan']:<9}{r['prefill_ms']:>14.1f}{r['decode_s']:>12.2f}{r['ms_per_token']:>10.2f}"
                  f"{r['tokens']:>8}{r['step_ms']:>12.1f}{r['step_ms_graph']:>11.1f}{r['uncond_prefill_ms']:>14.1f}"
                  f"{r['all_s']:>8.2f}"
                  f"{r['peak_gib']:>9.1f}")
    for r in rows:
        if "step_ms_two_dispatch" in r:
            print(f"ablation {r['workload']} hybrid4 DiT step: multi-micro {r['step_ms']:.1f} ms, "
                  f"two-dispatch {r['step_ms_two_dispatch']:.1f} ms")
    if extra:
        print(f"VAE decode 1024x1024: fp16 autocast {extra['vae_fp16_ms']:.0f} ms ({extra['vae_gflop']:.0f} GFLOP, "
              f"{extra['vae_tflops']:.0f} TFLOP/s), fp32 {extra['vae_fp32_ms']:.0f} ms; ViT encode of one "
              f"1024x1024 reference (bf16) {extra['vit_ms']:.1f} ms")


if __name__ == "__main__":
    main()
