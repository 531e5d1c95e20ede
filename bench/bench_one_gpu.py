"""Quantized HunyuanImage-3.0 on ONE GPU (issue 17), at the real shapes with random weights:

    python bench/bench_one_gpu.py [--builds mxfp4-distil,mxfp8-distil,nvfp4-distil,fp8-instruct]
                                  [--fp8-speedup] [--cot 750] [--profile-decode]

Builds: `mxfp4-distil` is the AutoRound MXFP4-mixed Instruct-Distil as it is resident (experts MXFP4,
attention and shared-MLP linears MXFP8, router fp32, everything else bf16), `fp8-instruct` the Instruct
with `--quantize fp8` (every backbone linear FP8 per output channel, W8A8), both at tp1: the whole
model on this GPU, AR and denoise sharing it. Quantized packs are filled with random codes and block
scales at a realistic level (no checkpoint is read: the loader's path is the tests'), floats with
N(0, 0.02). For each: resident GiB, the T2I prefill (1251 tokens), decode ms/token (CUDA graph + the
`sample` op + the one host read), the DiT step at 1024x1024 (Distil: one branch; Instruct: CFG batched),
the VAE decode, and for the Distil the WHOLE T2I request chained on the engine's modules and timed
wall-clock once: prefill, --cot decode tokens forced through the graph, the image prefix, 8 denoise
steps (`runtime.denoise.denoise`), the VAE decode. The server / queue / tokenizer are not in it.

`--fp8-speedup`: one rank of hybrid4 (compute only, collectives are no-ops), its T2I DiT step in bf16
vs with `--quantize fp8` (and FP8 fast accumulation), as graphs.
Details go to $OUT/one_gpu.json when $OUT is set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                                   # noqa: E402
import kernels.quant as kq                                       # noqa: E402
import bench_seed_tables as seed_tables                          # noqa: E402
from bench_seed_tables import FakeComm, image_sequence, median_ms, text_positions   # noqa: E402
from engine.model.attention import KVCache                       # noqa: E402
from engine.model.hunyuan import HunyuanImage3                   # noqa: E402
from engine.model.packed import PackFormat, QuantPack            # noqa: E402
from engine.parallel.layout import PhaseView                     # noqa: E402
from engine.parallel.plan import ParallelPlan, get_plan          # noqa: E402
from engine.runtime.decode_step import DecodeStep                # noqa: E402
from engine.runtime.prefill_step import PrefillStep              # noqa: E402
from engine.runtime.denoise import DenoiseRunner, denoise        # noqa: E402
from engine.runtime.handoff import cache_heads                   # noqa: E402
from engine.spec.config import ModelConfig                       # noqa: E402

DEV = "cuda"
STEP_GRAPH = True            # denoise steps as CUDA graphs (the engine's default on CUDA)
PREFILL, SIDE, VOCAB = 1251, 64, 120000
STD = 0.02
PROFILE_DECODE = False
# build: (Distil?, expert format, dense-linear format, whole-request denoise steps (0: not chained))
BUILDS = {
    "mxfp4-distil": (True, "mxfp4", "mxfp8", 8),     # AutoRound MXFP4-mixed Instruct-Distil
    "mxfp8-distil": (True, "mxfp8", "mxfp8", 8),     # AutoRound / compressed-tensors MXFP8 Distil
    "nvfp4-distil": (True, "nvfp4", "fp8", 8),       # ModelOpt mixed: FP8 dense, NVFP4 experts
    "fp8-instruct": (False, "fp8", "fp8", 0),        # online --quantize fp8 of the BF16 Instruct
}
FP8_MAX = 448.0


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def resident_formats(cfg: ModelConfig, experts: str, dense: str) -> dict[str, PackFormat]:
    """Pack name -> format, as `engine.model.weights.resident_packs` makes it from a checkpoint."""
    out = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_mlp.gate_and_up_proj",
                     "mlp.shared_mlp.down_proj"):
            out[p + name] = PackFormat(dense)
        for name in ("mlp.experts.gate_and_up_proj", "mlp.experts.down_proj"):
            out[p + name] = PackFormat(experts)
    return out


@torch.no_grad()
def fill_pack(pack: QuantPack, gen: torch.Generator) -> None:
    """Random codes (every code value) and block scales near the level of weights of std STD."""
    f = pack.format.fmt
    codes = pack.codes.view(-1, pack.codes.shape[-1])
    scales = pack.scales.view(-1, pack.scales.shape[-1])
    step = 8192
    for r in range(0, codes.shape[0], step):
        c = codes[r:r + step]
        if f in ("mxfp4", "nvfp4"):
            c.copy_(torch.randint(0, 256, c.shape, device=DEV, dtype=torch.uint8, generator=gen))
        else:
            c.copy_((torch.randn(c.shape, device=DEV, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX))
    jitter = torch.randint(-1, 2, scales.shape, device=DEV, generator=gen)
    if f == "fp8":
        scales.copy_(STD / 64 * 2.0 ** jitter.float())
    elif f == "nvfp4":
        scales.copy_(4.0 * 2.0 ** jitter.float())
        pack.gscale.fill_(STD / 2.9 / 4)
    else:
        level = STD / (64 if f == "mxfp8" else 2.9)
        scales.copy_((round(math.log2(level)) + 127 + jitter).clamp(1, 254).to(torch.uint8))


def build(cfg: ModelConfig, plan: ParallelPlan, resident: dict[str, PackFormat] | None) -> HunyuanImage3:
    model = HunyuanImage3(cfg, plan.layout(0), torch.bfloat16, DEV, resident=resident)
    gen = torch.Generator(DEV).manual_seed(0)
    with torch.no_grad():
        packs = [m for m in model.modules() if isinstance(m, QuantPack)]
        in_packs = {id(p) for m in packs for p in m.parameters()}
        for m in packs:
            fill_pack(m, gen)
        for p in model.parameters():
            if id(p) not in in_packs:
                p.normal_(0, STD, generator=gen)
    return model.eval()


def gib(model: HunyuanImage3) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2 ** 30


class Request:
    """The stages of one T2I request on one rank, on the engine's own modules."""

    def __init__(self, model: HunyuanImage3, plan: ParallelPlan, cot: int, distil: bool):
        cfg = model.cfg
        self.model, self.plan, self.cot, self.distil = model, plan, cot, distil
        self.view = PhaseView(plan.micro(0), 1, FakeComm(plan.ar_tp))
        kvr = model.transformer.layers[0].self_attn.kv_per_micro
        self.n = PREFILL + max(cot, 64) + 16
        self.pos, self.blocks = text_positions(self.n)
        self.cache = KVCache.allocate(cfg.num_layers, 1, kvr, self.n, cfg.head_dim, model.dtype, DEV)
        self.ids = torch.randint(0, VOCAB, (1, PREFILL), device=DEV)
        self.step = DecodeStep(model, self.pos, self.blocks, self.cache, self.view, use_graph=True)
        self.prefill_step = PrefillStep(model, self.cache, self.view, use_graph=True)
        self.gen = torch.Generator(DEV).manual_seed(0)

    def prefill(self) -> torch.Tensor:
        return self.prefill_step(self.model.transformer.embed(self.ids), self.pos, self.blocks)

    def decode(self, tokens: int) -> list[float]:
        """`tokens` forced decode steps (graph replay, sample op, one host read each): ms per token."""
        token, times = 0, []
        for s in range(tokens):
            t0 = time.perf_counter()
            logits = self.step(token, PREFILL + s)
            token = int(kernels.call("sample", logits, 0.6, 1024, 0.95, self.gen, False, None)) % VOCAB
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def runner(self, graph: bool) -> DenoiseRunner:
        model, plan, cfg = self.model, self.plan, self.model.cfg
        seq = image_sequence(PREFILL + self.cot, meta_tokens=3 if self.distil else 1)
        dn = PhaseView(0, plan.micros, FakeComm(plan.storage_tp), FakeComm(plan.sp), plan.sp_kind)
        branches = [0] if self.distil else [0, 1]
        heads = cache_heads(plan, 0, 0, model.transformer.layers[0].self_attn.kv_per_micro)
        cache = KVCache.allocate(cfg.num_layers, len(branches), heads.alloc.stop, len(seq) + 1, cfg.head_dim,
                                 model.dtype, DEV)
        starts = [PREFILL + self.cot if b == 0 else 0 for b in branches]
        ids = torch.full((2, len(seq)), 5, device=DEV)
        return DenoiseRunner(model, seq, [], ids, cache.heads(heads.denoise), dn, branches, starts, len(seq),
                             FakeComm(1), use_graph=graph)

    def noise(self) -> torch.Tensor:
        return torch.randn(1, int(self.model.cfg.vae["latent_channels"]), SIDE, SIDE, device=DEV)

    def step_ms(self, graph: bool, steps: int = 3) -> float:
        r = self.runner(graph)
        r.prefill()
        x, t = self.noise(), torch.full((1,), 500.0, device=DEV)
        g = torch.full((1,), 2500.0, device=DEV) if self.distil else None
        rr = torch.full((1,), 400.0, device=DEV) if self.distil and self.model.timestep_r_emb is not None else None
        return median_ms(lambda: r.velocity(1, x, t, rr, g), steps)

    def whole(self, steps: int) -> dict:
        """The request end to end, timed once, as a request after the engine's first runs: the decode graph
        replayed (the engine keeps it with its KV pool), the denoise step graph captured inside."""
        sync()
        marks = {"start": time.perf_counter()}
        self.prefill()
        sync()
        marks["prefill"] = time.perf_counter()
        self.decode(self.cot)                     # the engine's decode graph: captured once, at its first request
        marks["decode"] = time.perf_counter()
        r = self.runner(graph=STEP_GRAPH)
        r.prefill()
        x = self.noise()
        for _, x, _ in denoise(r, x, steps, 3.0, 2.5, cfg=not self.distil, distil=self.distil):
            pass
        sync()
        marks["denoise"] = time.perf_counter()
        self.model.decode_image(x)
        sync()
        marks["vae"] = time.perf_counter()
        keys = list(marks)
        out = {f"{b}_s": marks[b] - marks[a] for a, b in zip(keys, keys[1:])}
        out["total_s"] = marks["vae"] - marks["start"]
        return out


def measure(name: str, cfg: ModelConfig, resident, cot: int, distil: bool, whole_steps: int) -> dict:
    cuda = DEV == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    plan = get_plan("tp1")
    model = build(cfg, plan, resident)
    row = dict(build=name, resident_gib=gib(model), build_s=time.perf_counter() - t0,
               allocated_gib=torch.cuda.memory_allocated() / 2 ** 30 if cuda else 0.0)
    print(f"{name}: built in {row['build_s']:.0f} s, resident {row['resident_gib']:.1f} GiB", flush=True)
    with torch.no_grad():
        req = Request(model, plan, cot, distil)
        row["prefill_ms"] = median_ms(req.prefill, 3)
        times = req.decode(64)
        row["ms_per_token"] = sorted(times[4:])[len(times[4:]) // 2]
        row["graph"] = req.step.graph is not None
        if PROFILE_DECODE and cuda:       # where a token's time goes: the graph vs sampling + the host read
            split = {"graph": [], "sample": []}
            for s in range(16):
                sync()
                t0 = time.perf_counter()
                logits = req.step(s % 100, PREFILL + 64 + s)
                sync()
                t1 = time.perf_counter()
                int(kernels.call("sample", logits, 0.6, 1024, 0.95, req.gen, False, None))
                split["graph"].append((t1 - t0) * 1e3)
                split["sample"].append((time.perf_counter() - t1) * 1e3)
            row |= {f"split_{k}_ms": sorted(v)[len(v) // 2] for k, v in split.items()}
            print(f"{name}: one token = step {row['split_graph_ms']:.3f} ms (graph replay + the slot copy) + "
                  f"sample and the host read {row['split_sample_ms']:.3f} ms", flush=True)
            seed_tables.profile(lambda: req.step.graph.replay(), f"{name} decode step (graph replay)", rows=32)
            seed_tables.profile(lambda: req.step._static_forward(),
                                f"{name} decode step (eager: the graph's kernels)", rows=32)
        row["step_ms"] = req.step_ms(graph=False)
        row["step_ms_graph"] = req.step_ms(graph=True) if STEP_GRAPH else float("nan")
        z = req.noise()
        row["vae_ms"] = median_ms(lambda: model.decode_image(z), 2)
        if whole_steps:
            row |= {f"whole_{k}": v for k, v in req.whole(whole_steps).items()}
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0
    print(f"{name}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})}", flush=True)
    del model, req
    return row


def fp8_speedup(cfg: ModelConfig) -> dict:
    """One hybrid4 rank's T2I DiT step (CFG batched, graph) in bf16 vs online FP8."""
    plan = get_plan("hybrid4")
    out = {}
    for name, resident, fast in (("bf16", None, False), ("fp8", resident_formats(cfg, "fp8", "fp8"), False),
                                 ("fp8 fast-accum", "same", True)):
        if resident != "same":
            model = None
            torch.cuda.empty_cache()
            model = build(cfg, plan, resident)
        kq.FP8_FAST_ACCUM = fast
        with torch.no_grad():
            req = Request(model, plan, 750, distil=False)
            out[name] = req.step_ms(graph=STEP_GRAPH)
        kq.FP8_FAST_ACCUM = False
        print(f"hybrid4 rank DiT step {name}: {out[name]:.1f} ms", flush=True)
        del req
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--builds", default="mxfp4-distil,fp8-instruct")
    ap.add_argument("--config", default=str(Path(__file__).with_name("instruct_config.json")))
    ap.add_argument("--cot", type=int, default=750)
    ap.add_argument("--fp8-speedup", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny config, tiny workloads: checks the script")
    ap.add_argument("--tiny", action="store_true", help="the tiny config and workloads on the GPU (debugging)")
    ap.add_argument("--no-step-graph", action="store_true", help="denoise steps eagerly")
    ap.add_argument("--profile-decode", action="store_true", help="kernel tables of one decode step")
    args = ap.parse_args()
    global STEP_GRAPH, PROFILE_DECODE
    STEP_GRAPH = not args.no_step_graph
    PROFILE_DECODE = args.profile_decode
    base = json.loads(Path(args.config).read_text())
    if args.smoke or args.tiny:
        global DEV, PREFILL, SIDE, VOCAB
        from tools.tiny import tiny_config
        if args.smoke:
            DEV = seed_tables.DEV = "cpu"
        PREFILL, SIDE, VOCAB, args.cot = 40, 4, 500, 6
        seed_tables.SIDE = SIDE
        base = tiny_config(512, distil=False)
    rows, speed = [], {}
    for b in filter(None, args.builds.split(",")):
        if b not in BUILDS:
            raise SystemExit(f"unknown build {b!r} ({', '.join(BUILDS)})")
        distil, experts, dense, whole = BUILDS[b]
        cfg = ModelConfig.from_dict(dict(base, cfg_distilled=True, use_meanflow=True) if distil else base)
        rows.append(measure(b, cfg, resident_formats(cfg, experts, dense), args.cot, distil, whole))
    if args.fp8_speedup:
        speed = fp8_speedup(ModelConfig.from_dict(base))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "one_gpu.json").write_text(json.dumps(dict(rows=rows, fp8_speedup=speed), indent=1))
    where = torch.cuda.get_device_name() if DEV == "cuda" else "CPU smoke run"
    print(f"\nOne GPU ({where}), tp1, real shapes, random weights, T2I 1024x1024, "
          f"prefill {PREFILL}, {args.cot} CoT tokens")
    print(f"{'build':<14}{'resident GiB':>13}{'peak GiB':>9}{'prefill ms':>11}{'ms/token':>9}{'DiT step ms':>12}"
          f"{'graph step':>11}{'VAE ms':>8}{'whole T2I s':>12}")
    for r in rows:
        whole = f"{r['whole_total_s']:.2f}" if "whole_total_s" in r else "-"
        print(f"{r['build']:<14}{r['resident_gib']:>13.1f}{r['peak_gib']:>9.1f}{r['prefill_ms']:>11.1f}"
              f"{r['ms_per_token']:>9.2f}{r['step_ms']:>12.1f}{r['step_ms_graph']:>11.1f}{r['vae_ms']:>8.0f}{whole:>12}")
    for r in rows:
        if "whole_total_s" in r:
            print(f"{r['build']} whole request: " + ", ".join(f"{k[6:]} {v:.2f}" for k, v in r.items()
                                                               if k.startswith("whole_")))
    if speed:
        print(f"hybrid4 rank DiT step (compute only): bf16 {speed['bf16']:.1f} ms, fp8 {speed['fp8']:.1f} ms "
              f"({speed['bf16'] / speed['fp8']:.2f}x), fp8 fast-accum {speed['fp8 fast-accum']:.1f} ms "
              f"({speed['bf16'] / speed['fp8 fast-accum']:.2f}x)")


if __name__ == "__main__":
    main()
