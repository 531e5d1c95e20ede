"""Quantized HunyuanImage-3.0 on ONE GPU (issue 17), at the real shapes with random weights:

    python -m bench one-gpu [--builds mxfp4-distil,mxfp8-distil,nvfp4-distil,fp8-instruct] [--fp8-speedup]
                            [--cot 750] [--profile-decode] [--no-step-graph] [--tiny]

Builds: `mxfp4-distil` is the AutoRound MXFP4-mixed Instruct-Distil as it is resident (experts MXFP4,
attention and shared-MLP linears MXFP8, router fp32, everything else bf16), `mxfp8-distil` the AutoRound /
compressed-tensors MXFP8 Distil, `nvfp4-distil` the ModelOpt mixed layout (experts NVFP4, other linears
FP8), `fp8-instruct` the Instruct with `--quantize fp8` (every backbone linear FP8 per output channel,
W8A8), all at tp1: the whole model on this GPU, AR and denoise sharing it (a real one-GPU run, no
communication needed). Quantized packs are filled with random codes and block scales at a realistic level
(no checkpoint is read: the loader's path is the tests'), floats with N(0, 0.02). For each: resident GiB,
the T2I prefill (1251 tokens), decode ms/token (CUDA graph + the `sample` op + the one host read), the
DiT step at 1024x1024 (Distil: one branch; Instruct: CFG batched), the VAE decode, and for the Distil
builds the WHOLE T2I request chained on the engine's modules and timed wall-clock once: prefill, --cot
decode tokens forced through the graph, the image prefix, 8 denoise steps (`runtime.denoise.denoise`),
the VAE decode. The server, queue and tokenizer are not in it.

--fp8-speedup: one rank of hybrid4 (compute only, collectives are no-ops), its T2I DiT step in bf16 vs
with `--quantize fp8`, as graphs. --profile-decode: where one decode token's time goes.
"""
from __future__ import annotations

import argparse
import time

import torch

import hunyuan_kernels as kernels
from hunyuan_kernels.quant.formats import fold_rounded
from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.model.kernel_layouts import fold_mxfp8_weights, lay_out_experts
from engine.model.packed import PackFormat, QuantPack
from engine.parallel.layout import Comm
from engine.parallel.plan import ParallelPlan, get_plan
from engine.runtime.agreement import Agreement
from engine.runtime.decode_step import DecodeStep
from engine.runtime.graphs import Graphs
from engine.runtime.denoise import DenoiseRunner, StepInputs, denoise
from engine.runtime.prefill_step import PrefillStep
from engine.checkpoint.config import ModelConfig

from .. import rank
from ..profiling import kernel_table
from ..report import Col, Output
from ..timing import Stages, time_ms

DRY = True
# build: (Distil?, expert format, dense-linear format, whole-request denoise steps (0: not chained))
BUILDS = {
    "mxfp4-distil": (True, "mxfp4", "mxfp8", 8),     # AutoRound MXFP4-mixed Instruct-Distil
    "mxfp8-distil": (True, "mxfp8", "mxfp8", 8),     # AutoRound / compressed-tensors MXFP8 Distil
    "nvfp4-distil": (True, "nvfp4", "fp8", 8),       # ModelOpt mixed: FP8 dense, NVFP4 experts
    "fp8-instruct": (False, "fp8", "fp8", 0),        # online --quantize fp8 of the BF16 Instruct
}


class Shapes:
    """The request's sizes: the article's T2I (prefill 1251, 1024x1024), or tiny ones (--dry, --tiny)."""

    def __init__(self, tiny: bool, cot: int):
        self.prefill, self.side, self.vocab = (40, 4, 500) if tiny else (1251, 64, 120000)
        self.cot = 6 if tiny else cot
        self.timed_tokens = 4 if tiny else 60          # decode tokens timed (after 4 untimed)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--builds", default="mxfp4-distil,fp8-instruct", help=f"of {', '.join(BUILDS)}")
    ap.add_argument("--cot", type=int, default=750, help="decode tokens of the whole request")
    ap.add_argument("--fp8-speedup", action="store_true", help="a hybrid4 rank's DiT step, bf16 vs online FP8")
    ap.add_argument("--tiny", action="store_true", help="the tiny config and workloads on the GPU (debugging)")
    ap.add_argument("--no-step-graph", action="store_true", help="denoise steps eagerly")
    ap.add_argument("--profile-decode", action="store_true", help="kernel tables of one decode step")
    ap.add_argument("--profile-step", action="store_true", help="the kernel table of one DiT step (eager)")
    ap.add_argument("--moe-kernels", default="triton",
                    help="comma-separated kernels of the quantized experts, a row each: triton, humming, humming-fp8 "
                         "(engine/model/kernel_layouts.py; default triton). Every row's DiT-step velocity is compared "
                         "with its build's first row's (same seeded weights and input): put triton first")
    ap.add_argument("--mxfp8-kernels", default="triton",
                    help="comma-separated kernels of the MXFP8 weights, a row each with every --moe-kernels: triton, "
                         "fp8 (folded at load, W8A8), auto (fp8 with humming-fp8); default triton")


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


class Request:
    """The stages of one T2I request on one rank, on the engine's own modules."""

    def __init__(self, model: HunyuanImage3, plan: ParallelPlan, shapes: Shapes, distil: bool, step_graph: bool):
        cfg, dev = model.cfg, model.device
        self.model, self.plan, self.s, self.distil, self.step_graph = model, plan, shapes, distil, step_graph
        self.view = rank.ar_view(plan)
        kvr = model.transformer.layers[0].self_attn.kv_per_micro
        n = shapes.prefill + max(shapes.cot, 64) + 16
        self.pos, self.blocks = rank.text_positions(n, dev)
        self.cache = KVCache.allocate(cfg.num_layers, 1, kvr, n, cfg.head_dim, model.dtype, dev)
        self.ids = torch.randint(0, shapes.vocab, (1, shapes.prefill), device=dev)
        # the engine's batched decode step with one row (slot 0 = the prefill's cache row)
        self.graphs = Graphs()
        self.step = DecodeStep(model, self.cache, self.pos[None], self.view, self.graphs, (), use_graph=True)
        self.prefill_step = PrefillStep(model, self.cache, self.view, use_graph=True, graphs=self.graphs)
        self.gen = torch.Generator(dev).manual_seed(0)
        self.agree = Agreement(Comm(), dev)
        self.token, self.index = 0, shapes.prefill
        self._denoise_cache: KVCache | None = None

    def prefill(self) -> torch.Tensor:
        return self.prefill_step(self.model.transformer.embed(self.ids), self.pos, self.blocks)

    def decode_token(self) -> None:
        """One forced decode step: the graph replay, the sample op, its one host read."""
        logits = self.step([(0, self.token, self.index)])[0]
        self.token = int(kernels.call("sample", logits, 0.6, 1024, 0.95, self.gen, False, None)) % self.s.vocab
        self.index += 1

    def decode_ahead(self, n: int) -> None:
        """`n` decode tokens as the engine's scheduler runs them with `lookahead` (engine/runtime/scheduler.py,
        3.): each step's successor launched (`DecodeStep.ahead`, the token copied on the device) before the
        token's host read (`Agreement.tokens_later`: through pinned memory, waiting for that copy only)."""
        logits = self.step([(0, self.token, self.index)])[0]
        for i in range(n):
            token = kernels.call("sample", logits, 0.6, 1024, 0.95, self.gen, False, None).reshape(1) % self.s.vocab
            read = self.agree.tokens_later(token)
            if i + 1 < n:
                logits = self.step.ahead([(0, self.index + 1)], token)[0]
            self.token, self.index = read()[0], self.index + 1

    def runner(self, graph: bool, keep: bool = False) -> DenoiseRunner:
        """A denoise runner of the request's image. `keep`: on the KV storage and graphs this Request keeps,
        so every runner after the first replays the step graph the first captured (the engine's serving
        pool: one capture per key); else fresh ones (a request of the one-request runtime, captured inside)."""
        prefix = self.s.prefill + self.s.cot
        seq = rank.image_sequence(prefix, self.s.side, meta_tokens=3 if self.distil else 1)
        branches = [0] if self.distil else [0, 1]
        if not keep:
            return rank.denoise_runner(self.model, self.plan, seq, prefix, branches, graph)
        if self._denoise_cache is None:
            self._denoise_cache = rank.denoise_cache(self.model, self.plan, seq, branches)
        return rank.denoise_runner(self.model, self.plan, seq, prefix, branches, graph, self._denoise_cache,
                                   self.graphs)

    def step_fn(self, graph: bool):
        """One DiT step of the request's image (its runner prefilled), as a call."""
        r = self.runner(graph)
        r.prefill()
        dev = self.model.device
        # a seeded latent: every row of a run steps the same input (its velocity is compared with the first's)
        x, t = rank.latent(self.model, self.s.side, seed=1), torch.full((1,), 500.0, device=dev)
        g = torch.full((1,), 2500.0, device=dev) if self.distil else None
        rr = torch.full((1,), 400.0, device=dev) if self.distil and self.model.timestep_r_emb is not None else None
        return lambda: r.velocity(1, StepInputs(x, t, rr, g))

    def step_ms(self, graph: bool, steps: int = 3) -> float:
        return time_ms(self.step_fn(graph), "wall", n=steps)

    def whole(self, steps: int) -> dict:
        """The request end to end, timed once, as a request after the engine's warm-up: the decode graph
        replayed (the engine keeps it with its KV pool), each step launched before the last one's token is
        read (as the engine does on a GPU), the denoise step graph replayed on the storage it was captured on
        (the engine's pool captures it once, in its warm-up: engine/runtime/warmup.py; here an untimed image
        first). Until 2026-12-05 the capture was inside the timed denoise (a fresh runner each request)."""
        if self.step_graph:
            self._image(steps)
        self.index = self.s.prefill
        clock = Stages()
        with clock("prefill"):
            self.prefill()
        with clock("decode"):
            self.decode_ahead(self.s.cot)
        with clock("denoise"):
            x = self._image(steps)
        with clock("vae"):
            self.model.decode_image(x)
        return {f"{k}_s": v for k, v in clock.seconds.items()} | {"total_s": clock.total}

    def _image(self, steps: int) -> torch.Tensor:
        """The image phase's denoise of a fresh latent on the kept runner storage -> its final latent."""
        r = self.runner(graph=self.step_graph, keep=True)
        r.prefill()
        x = None
        for _, x, _ in denoise(r, rank.latent(self.model, self.s.side), steps, 3.0, 2.5, cfg=not self.distil,
                               distil=self.distil):
            pass
        return x


def profile_decode(name: str, req: Request, row: dict, out: Output) -> None:
    """One token split into the graph replay and the sampling with its host read, and the kernels of
    one decode step (its graph replayed; its eager form, the same kernels with launches)."""
    split: dict[str, list[float]] = {"graph": [], "sample": []}
    for s in range(16):
        clock = Stages()
        with clock("graph"):
            logits = req.step([(0, s % 100, req.s.prefill + 64 + s)])[0]
        with clock("sample"):
            int(kernels.call("sample", logits, 0.6, 1024, 0.95, req.gen, False, None))
        for k, v in clock.seconds.items():
            split[k].append(v * 1e3)
    row |= {f"split_{k}_ms": sorted(v)[len(v) // 2] for k, v in split.items()}
    out.say(f"{name}: one token = step {row['split_graph_ms']:.3f} ms (graph replay + the slot copy) + "
            f"sample and the host read {row['split_sample_ms']:.3f} ms")
    for line in kernel_table(lambda: req.graphs.graph(("decode", 1)).replay(), f"{name} decode step (graph replay)", rows=32):
        out.say(line)
    for line in kernel_table(lambda: req.step._forward(1), f"{name} decode step (eager: the graph's kernels)",
                             rows=32):
        out.say(line)


def velocity_errors(rows: list[dict]) -> None:
    """Each row's DiT-step velocity against its build's first row's (the reference path: `triton` on the
    plain packs, where it comes first), relative L2: what another kernel family costs a whole step."""
    first: dict[str, torch.Tensor] = {}
    for r in rows:
        v = r.pop("_velocity")
        ref = first.setdefault(r["build"], v)
        r["velocity_err"] = ((v.double() - ref.double()).norm() / ref.double().norm()).item()


def measure(name: str, cfg: ModelConfig, resident, shapes: Shapes, distil: bool, whole_steps: int,
            args: argparse.Namespace, out: Output, moe_kernels: str = "triton", mxfp8_kernels: str = "triton") -> dict:
    cuda = torch.cuda.is_available() and not args.dry
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    plan = get_plan("tp1")
    model = rank.build(cfg, plan, torch.bfloat16, "cuda" if cuda else "cpu", resident)
    t1 = time.perf_counter()
    ran = lay_out_experts(model, moe_kernels)
    # what the fold rounds, on the first MXFP8 pack (issue 41 item 5: the share of values a fold changes)
    first = next((m for m in model.modules() if isinstance(m, QuantPack) and m.format.fmt == "mxfp8"), None)
    share, worst = fold_rounded(first.codes, first.scales) if first is not None and mxfp8_kernels != "triton" \
        else (None, None)
    ran8 = fold_mxfp8_weights(model, mxfp8_kernels, ran)
    row = dict(build=name, moe_kernels=ran, mxfp8_kernels=ran8, fold_share=share, fold_worst=worst,
               layout_s=time.perf_counter() - t1, resident_gib=rank.resident_gib(model),
               build_s=time.perf_counter() - t0, allocated_gib=torch.cuda.memory_allocated() / 2 ** 30 if cuda else None)
    out.say(f"{name}: built in {row['build_s']:.0f} s, resident {row['resident_gib']:.1f} GiB")
    with torch.no_grad():
        req = Request(model, plan, shapes, distil, not args.no_step_graph)
        row["prefill_ms"] = time_ms(req.prefill, "wall", n=3)
        row["ms_per_token"] = time_ms(req.decode_token, "wall", n=shapes.timed_tokens, warmup=4)
        # the same tokens with each step launched ahead of the last one's host read (the engine's default)
        row["ms_per_token_ahead"] = time_ms(lambda: req.decode_ahead(shapes.timed_tokens), "wall", n=3,
                                            warmup=1) / shapes.timed_tokens
        row["graph"] = ("decode", 1) in req.graphs
        if args.profile_decode and cuda:
            profile_decode(name, req, row, out)
        row["step_ms"] = req.step_ms(graph=False)
        row["_velocity"] = req.step_fn(graph=False)().float().cpu()     # the same seeded model and input per row
        if args.profile_step and cuda:
            for line in kernel_table(req.step_fn(graph=False), f"{name} ({ran}, mxfp8 {ran8}) DiT step (eager)", rows=32):
                out.say(line)
        row["step_ms_graph"] = req.step_ms(graph=True) if not args.no_step_graph else None
        z = rank.latent(model, shapes.side)
        row["vae_ms"] = time_ms(lambda: model.decode_image(z), "wall", n=2)
        if whole_steps:
            row |= {f"whole_{k}": v for k, v in req.whole(whole_steps).items()}
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
    out.say(f"{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if not k.startswith("_")))
    del model, req
    return row


def fp8_speedup(cfg: ModelConfig, shapes: Shapes, args: argparse.Namespace, out: Output) -> dict:
    """One hybrid4 rank's T2I DiT step (CFG batched, graph) in bf16 vs online FP8 (W8A8, cuBLAS's FP8
    fast accumulation: hunyuan_kernels/quant/cuda.py FP8_FAST_ACCUM)."""
    plan = get_plan("hybrid4")
    dev = "cpu" if args.dry else "cuda"
    res = {}
    for name, resident in (("bf16", None), ("fp8", resident_formats(cfg, "fp8", "fp8"))):
        if dev == "cuda":
            torch.cuda.empty_cache()
        model = rank.build(cfg, plan, torch.bfloat16, dev, resident)
        with torch.no_grad():
            res[name] = Request(model, plan, shapes, False, not args.no_step_graph).step_ms(graph=not args.no_step_graph)
        out.say(f"hybrid4 rank DiT step {name}: {res[name]:.1f} ms")
        del model
    return res


def run(args: argparse.Namespace, out: Output) -> bool:
    shapes = Shapes(args.dry or args.tiny, args.cot)
    rows, speed = [], {}
    for b in filter(None, args.builds.split(",")):
        if b not in BUILDS:
            raise SystemExit(f"unknown build {b!r} ({', '.join(BUILDS)})")
        distil, experts, dense, whole = BUILDS[b]
        cfg = rank.config(args.dry or args.tiny, distil)
        for k in filter(None, args.moe_kernels.split(",")):
            for k8 in filter(None, args.mxfp8_kernels.split(",")):
                rows.append(measure(b, cfg, resident_formats(cfg, experts, dense), shapes, distil, whole, args, out,
                                    k, k8))
    velocity_errors(rows)
    if args.fp8_speedup:
        speed = fp8_speedup(rank.config(args.dry or args.tiny), shapes, args, out)
    out.data.update(rows=rows, fp8_speedup=speed, prefill=shapes.prefill, cot=shapes.cot)
    out.table(rows, [Col("build", "build"), Col("experts on", "moe_kernels"), Col("MXFP8 on", "mxfp8_kernels"), Col("resident GiB", "resident_gib", ".1f"), Col("peak GiB", "peak_gib", ".1f"),
                     Col("prefill ms", "prefill_ms", ".1f"), Col("ms/token", "ms_per_token", ".2f"),
                     Col("ms/token ahead", "ms_per_token_ahead", ".2f"),
                     Col("DiT step ms", "step_ms", ".1f"), Col("graph step", "step_ms_graph", ".1f"),
                     Col("VAE ms", "vae_ms", ".0f"), Col("whole T2I s", "whole_total_s", ".2f"),
                     Col("step velocity err", "velocity_err", ".1e"),
                     Col("fold: share rounded", "fold_share", ".1e")],
              f"One GPU, tp1, random weights, T2I {16 * shapes.side}x{16 * shapes.side}, prefill {shapes.prefill}, "
              f"{shapes.cot} CoT tokens")
    for r in rows:
        if "whole_total_s" in r:
            out.say(f"{r['build']} ({r['moe_kernels']}, mxfp8 {r['mxfp8_kernels']}) whole request: " + ", ".join(f"{k[6:]} {v:.2f}" for k, v in r.items()
                                                              if k.startswith("whole_")))
    if speed:
        out.say(f"hybrid4 rank DiT step (compute only, graph): bf16 {speed['bf16']:.1f} ms, fp8 {speed['fp8']:.1f} ms "
                f"({speed['bf16'] / speed['fp8']:.2f}x)")
    return True
