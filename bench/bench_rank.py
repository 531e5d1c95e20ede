"""One rank's compute at the real HunyuanImage-3.0 shapes, with random weights and a fake process group
(collectives keep their shapes but move nothing), so one GPU can time what each rank of a plan does.

    python bench/bench_rank.py --plan hybrid4 [--prompt-tokens 1024] [--decode 64] [--steps 4]

Prints AR prefill ms, AR ms/token and DiT ms/step for the rank's share of the work. Communication is
NOT included: these are compute-only figures for one rank.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.attention import KVCache                      # noqa: E402
from engine.spec.config import ModelConfig                     # noqa: E402
from engine.runtime.decode_step import DecodeStep                 # noqa: E402
from engine.runtime.denoise import tail_embeddings, velocity     # noqa: E402
from engine.model.hunyuan import HunyuanImage3                    # noqa: E402
from engine.parallel.layout import Comm, PhaseView               # noqa: E402
from engine.parallel.plan import get_plan                          # noqa: E402


class FakeComm(Comm):
    """A group of `size` ranks whose collectives return the right shapes and cost nothing."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0

    def all_gather(self, t, dim):
        return torch.cat([t] * self.size, dim=dim) if self.size > 1 else t


def timed(fn, sync=True):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", default="hybrid4")
    ap.add_argument("--config", default=str(Path(__file__).with_name("instruct_config.json")))
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--image", type=int, default=1024, help="image side (square bucket)")
    ap.add_argument("--text-tokens", type=int, default=1500, help="text tokens before the image in denoise")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cfg", type=int, default=2, help="CFG branches batched per rank (2, or 1 for Distil/CFG-par)")
    args = ap.parse_args()
    plan = get_plan(args.plan)
    cfg = ModelConfig.from_dict(json.loads(Path(args.config).read_text()))
    dev, dt = torch.device("cuda"), torch.bfloat16
    t0 = time.perf_counter()
    model = HunyuanImage3(cfg, plan.layout(0), dt, dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    torch.cuda.synchronize()
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"plan {plan.name}: rank 0 resident weights {resident / 2**30:.1f} GiB, built in {time.perf_counter() - t0:.1f} s")
    ar = PhaseView(0, 1, FakeComm(plan.ar_tp))
    dn = PhaseView(0, plan.micros, FakeComm(plan.storage_tp), FakeComm(plan.sp), plan.sp_kind)
    kvr = model.transformer.layers[0].self_attn.kv_per_micro
    L = args.prompt_tokens
    n = L + args.decode + 8
    pos = torch.arange(n, device=dev).unsqueeze(1).repeat(1, 2)
    blocks = torch.full((n,), -1, device=dev)
    with torch.no_grad():
        # ---------------------------------------------------------------- AR
        cache = KVCache.allocate(cfg.num_layers, 1, kvr, n, cfg.head_dim, dt, dev)
        ids = torch.randint(0, 120000, (1, L), device=dev)
        for _ in range(2):   # warm-up (first call allocates)
            h, prefill_ms = timed(lambda: model.backbone(model.transformer.embed(ids), torch.arange(L, device=dev),
                                                         pos, blocks, cache, L, ar))
        for graph in (False, True):
            step = DecodeStep(model, pos, blocks, cache, ar, use_graph=graph)
            times = [timed(lambda s=s: step(0, L + s).argmax())[1] for s in range(args.decode)]
            dec = sorted(times[4:])[len(times[4:]) // 2]
            print(f"AR (TP{plan.ar_tp} micro view): prefill {L} tokens {prefill_ms:.1f} ms; decode "
                  f"{'CUDA graph' if graph else 'eager'} median {dec:.2f} ms/token")
        del cache
        # ---------------------------------------------------------------- denoise
        hw = (args.image // 16) ** 2
        S = args.text_tokens + 4 + hw
        B = args.cfg
        sp = plan.sp
        heads = kvr * plan.micros // (sp if plan.sp_kind == "ulysses" else 1)
        dcache = KVCache.allocate(cfg.num_layers, B, heads, S + 1, cfg.head_dim, dt, dev)
        pos = torch.arange(S + 1, device=dev).unsqueeze(1).repeat(1, 2)
        blocks = torch.full((S + 1,), -1, device=dev)
        blocks[S - hw:S] = 0
        side = args.image // 16
        x = torch.randn(B, cfg.vae["latent_channels"], side, side, device=dev)
        t = torch.full((B,), 500.0, device=dev)
        tail_n = 1 + hw
        local = -(-tail_n // sp)
        gathered = torch.arange(S - tail_n, S - tail_n + local * sp, device=dev).clamp_max(S)
        index = gathered[:local]

        def dit_step():
            tail = tail_embeddings(model, x, t, None, None)[:, :local]
            hidden = model.backbone(tail, index, pos, blocks, dcache, S, dn, gathered=gathered if sp > 1 else None)
            full = dn.sp.all_gather(hidden, dim=1)[:, :tail_n]
            return velocity(model, full[:, -hw:], t, type("S", (), {"h": side, "w": side})())
        step_times = [timed(dit_step)[1] for _ in range(args.steps + 1)][1:]
        print(f"denoise (TP{plan.storage_tp} x {plan.replica_mode.upper()}{plan.replicas}, {plan.sp_kind}): "
              f"{B} branch(es) x {local} local tokens of {tail_n}; median {sorted(step_times)[len(step_times)//2]:.1f} ms/step")
        print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
