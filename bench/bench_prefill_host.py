"""Why the T2I prefill (1251 tokens, one hybrid4 rank) is host-bound (issue 16): its CUDA time is ~25 ms,
its wall time 34-62 ms, nearly all of it spent issuing kernels.

    python bench/bench_prefill_host.py

Builds rank 0 of hybrid4 at the real shapes (random bf16 weights, collectives no-ops), runs the prefill,
then prints: wall and host-enqueue ms; the host time of each top-level stage of one layer (timed with
perf_counter around the engine's own calls, the GPU never waited on); the profiler's CPU-side table (the
aten / Triton launch calls that cost host time); and the host cost of launching one tiny Triton kernel and
one tiny aten op, for scale.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels                                                  # noqa: E402
from bench_seed_tables import FakeComm, build, text_positions    # noqa: E402
from engine.model.attention import KVCache                       # noqa: E402
from engine.parallel.layout import PhaseView                     # noqa: E402
from engine.parallel.plan import get_plan                        # noqa: E402
from engine.spec.config import ModelConfig                       # noqa: E402

PREFILL = 1251


def main() -> None:
    cfg = ModelConfig.from_dict(json.loads(Path(__file__).with_name("instruct_config.json").read_text()))
    plan = get_plan("hybrid4")
    model = build(cfg, plan)
    view = PhaseView(plan.micro(0), 1, FakeComm(plan.ar_tp))
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    pos, blocks = text_positions(PREFILL + 8)
    cache = KVCache.allocate(cfg.num_layers, 1, kvr, PREFILL + 8, cfg.head_dim, model.dtype, "cuda")
    ids = torch.randint(0, 120000, (1, PREFILL), device="cuda")
    index = torch.arange(PREFILL, device="cuda")

    def prefill():
        h = model.backbone(model.transformer.embed(ids), index, pos, blocks, cache, PREFILL, view)
        return model.transformer.logits(h[:, -1], view)

    with torch.no_grad():
        for _ in range(3):
            prefill()
        torch.cuda.synchronize()
        for _ in range(3):
            t0 = time.perf_counter()
            prefill()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            print(f"prefill: host enqueue {(t1 - t0) * 1e3:.1f} ms, wall {(time.perf_counter() - t0) * 1e3:.1f} ms")

        # one layer's stages, host time only (queued behind a long GPU job so nothing waits on the GPU)
        layer = model.transformer.layers[1]
        x = torch.randn(1, PREFILL, cfg.hidden_size, device="cuda", dtype=model.dtype)
        batch = model.attn_batch(index, pos, blocks, PREFILL, view)
        stages = {
            "add_rms_norm": lambda: layer._add_norm(x, x, layer.input_layernorm),
            "attention": lambda: layer.self_attn(x, batch, cache, 1, view),
            "moe": lambda: layer.mlp(x, view),
            "whole layer": lambda: layer(x, x, batch, cache, 1, view),
            "attn_batch (once a forward)": lambda: model.attn_batch(index, pos, blocks, PREFILL, view),
        }
        big = torch.randn(8192, 8192, device="cuda", dtype=model.dtype)
        for name, fn in stages.items():
            fn()
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                for _ in range(6):
                    big @ big                     # ~10 ms of GPU work ahead of the timed calls
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
            print(f"host time of {name:<28} {sorted(times)[2]:7.3f} ms")

        from kernels import moe_triton as tk
        small = torch.randn(16, 256, device="cuda", dtype=model.dtype)
        for name, fn in (("a tiny Triton kernel (swiglu)", lambda: tk.swiglu(small)),
                         ("a tiny aten op (add)", lambda: small + small),
                         ("kernels.call rms_norm", lambda: kernels.call("rms_norm", small, small[0], 1e-5))):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            print(f"host time of {name:<28} {(time.perf_counter() - t0) / 200 * 1e6:7.1f} us")
            torch.cuda.synchronize()

        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as p:
            prefill()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
