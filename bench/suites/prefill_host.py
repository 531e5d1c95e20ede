"""Why the eager T2I prefill (1251 tokens, one hybrid4 rank) is host-bound (issue 16; the engine now replays
it from a CUDA graph per length bucket, `tables` times both): its CUDA time is ~25 ms, its eager wall time
was 34-62 ms, nearly all of it spent issuing kernels.

    python -m bench prefill-host

Builds rank 0 of hybrid4 at the real shapes (random bf16 weights, collectives no-ops), runs the eager
prefill, then prints: wall and host-enqueue ms; the host time of each top-level stage of one layer
(timed around the engine's own calls, with ~10 ms of GPU work queued ahead so that the GPU is never
waited on); the host cost of launching one tiny Triton kernel, one tiny aten op and one `kernels.call`,
for scale; the profiler's CPU-side table (the aten / Triton launch calls that cost host time).
"""
from __future__ import annotations

import argparse

import torch

import hunyuan_kernels as kernels
from engine.model.attention import KVCache
from engine.parallel.plan import get_plan
from hunyuan_kernels.moe import triton_kernels as tk

from .. import rank
from ..profiling import op_table
from ..report import Col, Output
from ..timing import time_ms

DRY = False
PREFILL = 1251


def add_arguments(ap: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace, out: Output) -> bool:
    cfg = rank.config(dry=False)
    plan = get_plan("hybrid4")
    model = rank.build(cfg, plan, torch.bfloat16, "cuda")
    view = rank.ar_view(plan)
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    pos, blocks = rank.text_positions(PREFILL + 8, "cuda")
    cache = KVCache.allocate(cfg.num_layers, 1, kvr, PREFILL + 8, cfg.head_dim, model.dtype, "cuda")
    ids = torch.randint(0, 120000, (1, PREFILL), device="cuda")
    index = torch.arange(PREFILL, device="cuda")

    def prefill():
        batch = model.attn_batch(index, pos, blocks, PREFILL, view)
        h = model.backbone(model.transformer.embed(ids), batch, cache, view)
        return model.transformer.logits(h[:, -1], view)

    rows = []
    with torch.no_grad():
        wall = time_ms(prefill, "wall", n=3, warmup=3)
        host = time_ms(prefill, "host", n=3, warmup=0)
        out.say(f"eager prefill of {PREFILL} tokens: wall {wall:.1f} ms, host enqueue {host:.1f} ms")
        layer = model.transformer.layers[1]
        x = torch.randn(1, PREFILL, cfg.hidden_size, device="cuda", dtype=model.dtype)
        batch = model.attn_batch(index, pos, blocks, PREFILL, view)
        big = torch.randn(8192, 8192, device="cuda", dtype=model.dtype)
        ahead = lambda: [big @ big for _ in range(6)]          # noqa: E731  ~10 ms of GPU work queued first
        stages = {"add_rms_norm": lambda: layer._add_norm(x, x, layer.input_layernorm),
                  "attention": lambda: layer.self_attn(x, batch, cache, 1, view),
                  "moe": lambda: layer.mlp(x, view),
                  "whole layer": lambda: layer(x, x, batch, cache, 1, view),
                  "attn_batch (once a forward)": lambda: model.attn_batch(index, pos, blocks, PREFILL, view)}
        for name, fn in stages.items():
            rows.append(dict(what=f"one layer's {name}", host_us=time_ms(fn, "host", n=5, setup=ahead) * 1e3))
        small = torch.randn(16, 256, device="cuda", dtype=model.dtype)
        for name, fn in (("a tiny Triton kernel (swiglu)", lambda: tk.swiglu(small)),
                         ("a tiny aten op (add)", lambda: small + small),
                         ("kernels.call rms_norm", lambda: kernels.call("rms_norm", small, small[0], 1e-5))):
            rows.append(dict(what=name, host_us=time_ms(lambda fn=fn: [fn() for _ in range(200)], "host", n=3,
                                                        per=200) * 1e3))
        out.table(rows, [Col("host time of", "what"), Col("us", "host_us", ".1f")])
        for line in op_table(prefill, "self_cpu_time_total", rows=30, cuda=False):
            out.say(line)
    out.data.update(prefill_wall_ms=wall, prefill_host_ms=host, rows=rows)
    return True
