"""Open a checkpoint folder: config, tokenizer, system prompts, buckets and the resident model."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.hunyuan import HunyuanImage3
from engine.model.weights import Progress, load_weights, plan_checkpoint, resident_packs
from engine.parallel.layout import ShardLayout
from engine.checkpoint.buckets import Bucket, build_buckets
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.config import CheckpointConfig, GenerationConfig, ModelConfig
from engine.checkpoint.prompts import SystemPrompts
from engine.checkpoint.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    folder: Path
    cfg: ModelConfig
    gen: GenerationConfig
    tok: Tokenizer
    prompts: SystemPrompts
    buckets: tuple[Bucket, ...]
    model: HunyuanImage3
    load_s: float
    bytes_read: int


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def parse_dtype(name: str | None, device: torch.device | str) -> torch.dtype:
    if name in (None, "", "auto"):
        return default_dtype(device)
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose bfloat16, float16 or float32")
    return table[name]


def print_progress(done: int, total: int, what: str, label: str = "loading weights") -> None:
    print(f"\r{label} {done}/{total} ({what})".ljust(60), end="" if done < total else "\n",
          file=sys.stderr, flush=True)


RESIDENT_CHOICES = ("auto", "quantized", "dense")


def keeps_quantized(device: torch.device | str, dtype: torch.dtype, resident: str = "auto") -> bool:
    """Whether quantized weights stay quantized on the device ("auto": on CUDA in bf16, where the
    quantized GEMM kernels run; elsewhere they are dequantized once at load, the reference path)."""
    if resident not in RESIDENT_CHOICES:
        raise ValueError(f"unknown resident {resident!r}; choose {', '.join(RESIDENT_CHOICES)}")
    if resident == "auto":
        return torch.device(device).type == "cuda" and dtype == torch.bfloat16
    return resident == "quantized"


def load(folder: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
         layout: ShardLayout = ShardLayout(), progress: Progress | None = None, quantize: str | None = None,
         resident: str = "auto") -> LoadedModel:
    """Open the folder and load this rank's shard. `quantize` ("fp8"): online FP8 from a high-precision
    checkpoint. `resident`: whether quantized weights stay quantized ("auto", "quantized": also on the
    CPU, through the reference ops; "dense": dequantized at load)."""
    t0 = time.perf_counter()
    folder = Path(folder)
    cc = CheckpointConfig.load(folder)
    buckets = build_buckets(cc.model.image_base_size)
    tok = Tokenizer(folder / "tokenizer.json", cc.model.image_base_size, len(buckets))
    if tok.vocab_size > cc.model.vocab_size:
        raise ValueError(f"tokenizer.json has {tok.vocab_size} tokens but config.json vocab_size is "
                         f"{cc.model.vocab_size}")
    prompts = SystemPrompts.load(folder)
    ckpt = Checkpoint(folder)
    dtype = dtype or default_dtype(device)
    plan = plan_checkpoint(cc.model, ckpt, layout, quantize=quantize)     # before any weight is allocated
    packs = resident_packs(cc.model, plan[1], quantize) if keeps_quantized(device, dtype, resident) else {}
    model = HunyuanImage3(cc.model, layout, dtype, device, resident=packs)
    load_weights(model, ckpt, progress, quantize=quantize, plan=plan)
    model.eval()
    return LoadedModel(folder, cc.model, cc.generation, tok, prompts, buckets, model,
                       time.perf_counter() - t0, ckpt.bytes_read)
