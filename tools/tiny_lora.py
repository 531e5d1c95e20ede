"""`python -m tools.tiny_lora CHECKPOINT OUT_DIR [--rank R] [--alpha A] [--seed N] [--targets qkv_proj,o_proj]`:
a random LoRA adapter for a checkpoint, written by the real `peft` library (`pip install peft`) the way a
trainer's `save_pretrained` writes one: PEFT wraps a module tree with the checkpoint's layer names and
shapes (`model.layers.{i}.self_attn.qkv_proj`, ...), its lora_B drawn non-zero (a freshly initialised
adapter would have B = 0 and change nothing). For tests, the README's example and the benchmarks."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.checkpoint.config import CheckpointConfig, ModelConfig

if TYPE_CHECKING:
    from engine.model.peft import PeftAdapter


class _Linears(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, int]]):
        super().__init__()
        for name, (n, k) in shapes.items():
            self.add_module(name, nn.Linear(k, n, bias=False, device="meta"))


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        D = cfg.head_dim
        self.self_attn = _Linears({"qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, cfg.hidden_size),
                                   "o_proj": (cfg.hidden_size, cfg.num_heads * D)})
        self.mlp = nn.Module()
        self.mlp.shared_mlp = _Linears({"gate_and_up_proj": (2 * cfg.shared_intermediate(i), cfg.hidden_size),
                                        "down_proj": (cfg.hidden_size, cfg.shared_intermediate(i))})
        inter = cfg.moe_intermediate_size[i]
        self.mlp.experts = nn.ModuleList(_Linears({"gate_and_up_proj": (2 * inter, cfg.hidden_size),
                                                   "down_proj": (cfg.hidden_size, inter)})
                                         for _ in range(cfg.num_experts[i]))


class TrainedTree(nn.Module):
    """What a trainer's PEFT sees of HunyuanImage-3.0: `model.layers.{i}` with the attention projections, the
    shared MLP and the experts under their checkpoint names and shapes (no weights: PEFT adds its own A and B;
    `gate_and_up_proj` matches the shared MLP's and every expert's, as it does in the trainers)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_Layer(cfg, i) for i in range(cfg.num_layers))


def make_adapter(out: str | Path, cfg: ModelConfig, seed: int = 0, std: float = 0.3, **config) -> Path:
    """Write a PEFT adapter for `cfg` to `out`; `config`: LoraConfig fields (default r 8, alpha 16 on
    qkv_proj and o_proj), its lora_B drawn N(0, std) from `seed`."""
    import peft
    torch.manual_seed(seed)
    kw = dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj"]) | config
    tree = TrainedTree(cfg).to_empty(device="cpu")
    model = peft.get_peft_model(tree, peft.LoraConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    model.save_pretrained(str(out))
    return Path(out)


def random_adapter(cfg: ModelConfig, r: int, seed: int = 0, scale: float = 2.0, mlp: bool = False) -> "PeftAdapter":
    """A rank-r adapter on every layer's qkv_proj and o_proj (with `mlp`: and on the shared MLP's and every
    expert's gate_and_up_proj and down_proj) as the reader returns one (in memory, no peft needed: the GPU test
    and the benchmark), A ~ N(0, 1/in), B ~ N(0, 0.05^2)."""
    from engine.model.peft import ALL_TARGETS, TARGETS, LoraWeights, PeftAdapter
    from engine.checkpoint.shapes import backbone_linears
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for layer, (n, k, _) in backbone_linears(cfg).items():
        if layer.endswith(ALL_TARGETS if mlp else TARGETS):
            layers[layer] = LoraWeights(torch.randn(r, k, generator=g) * k ** -0.5, torch.randn(n, r, generator=g) * 0.05,
                                        scale)
    return PeftAdapter(Path(f"random-rank{r}-seed{seed}{'-mlp' if mlp else ''}"), layers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.tiny_lora", description="Write a random PEFT LoRA adapter "
                                 "for a checkpoint (as a trainer's save_pretrained writes one).")
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="qkv_proj,o_proj", help="comma-separated module names (PEFT target_modules)")
    args = ap.parse_args(argv)
    cfg = CheckpointConfig.load(Path(args.checkpoint)).model
    out = make_adapter(args.out, cfg, args.seed, r=args.rank, lora_alpha=args.alpha,
                       target_modules=args.targets.split(","))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
