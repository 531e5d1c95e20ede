"""Will a plan fit the GPUs? Memory per rank estimated from the checkpoint's headers and config alone,
before anything is loaded, and the smallest plan that fits chosen when the user named none.

Per rank: the resident weights (tensor-parallel tensors split over the plan's storage shards, the rest
replicated; quantized tensors as stored, codes and scales, since CUDA keeps them so; float tensors in
the compute dtype; `--quantize fp8` backbone linears at one byte a weight), the KV cache of the
longest request (a TI2I prefill of 6290 tokens, the generation config's reasoning budget and the
largest image, both CFG branches), the working memory of a 1024x1024 step and VAE decode: 16 GiB,
the peak above the resident weights measured on one H200 for a hybrid4 rank (14.2 GiB,
docs/benchmarks.md) plus room for the allocator, and the server's caches of conversations (the prefix
cache's K/V and the image encodings, each bounded per rank by its flag; they fill up to that bound).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.parallel.plan import DEFAULT_FOR_WORLD, PRESETS, ParallelPlan, PlanError
from engine.checkpoint import names
from engine.checkpoint.shards import Checkpoint
from engine.checkpoint.config import CheckpointConfig

GIB = 2 ** 30
WORKING_BYTES = 16 * GIB
QUANT_DTYPES = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1}
LONGEST_PREFILL = 6290                     # TI2I with a 1024x1024 reference (the seed article's)
LM_HEAD = names.weight(names.LM_HEAD)


@dataclass(frozen=True)
class Estimate:
    plan: str
    weights: int
    kv_cache: int
    working: int
    caches: int = 0          # the conversation caches' bounds (prefix K/V + image encodings)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.working + self.caches

    def describe(self) -> str:
        caches = f", {self.caches / GIB:.0f} GiB conversation caches" if self.caches else ""
        return (f"{self.plan}: {self.total / GIB:.0f} GiB per GPU ({self.weights / GIB:.0f} GiB weights, "
                f"{self.kv_cache / GIB:.1f} GiB KV cache, {self.working / GIB:.0f} GiB working memory{caches})")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def estimate(ckpt: Checkpoint, cc: CheckpointConfig, plan: ParallelPlan, dtype_bytes: int = 2,
             quantize: str | None = None, working: int = WORKING_BYTES, caches: int = 0) -> Estimate:
    cfg = cc.model
    weights = 0
    for name, info in ckpt.tensors.items():
        if name.startswith(names.SKIPPED_PREFIXES):
            continue                                             # skipped at load
        # tensor-parallel: the LM head and every tensor of a backbone linear (whatever its format)
        split = name == LM_HEAD or names.pack_of(name.rpartition(".")[0]) is not None
        if info.dtype in QUANT_DTYPES:
            nbytes = _numel(info.shape) * QUANT_DTYPES[info.dtype]
        elif quantize == "fp8" and split and name != LM_HEAD and info.shape and len(info.shape) == 2:
            nbytes = _numel(info.shape) + info.shape[0] * 4      # fp8 codes + one fp32 scale a row
        else:
            nbytes = _numel(info.shape) * dtype_bytes
        weights += nbytes // plan.storage_tp if split else nbytes
    f = cfg.vae_downsample_factor
    image_tokens = (cfg.image_base_size // f[0]) * (cfg.image_base_size // f[1])     # every bucket ~ base^2
    tokens = LONGEST_PREFILL + cc.generation.max_new_tokens + image_tokens + 32
    heads = max(1, cfg.num_kv_heads // plan.storage_tp)
    kv = cfg.num_layers * 2 * 2 * heads * tokens * cfg.head_dim * dtype_bytes        # k, v; two CFG rows
    return Estimate(plan.name, weights, kv, working, caches)


def choose_plan(ckpt: Checkpoint, cc: CheckpointConfig, gpus: int, gpu_bytes: int,
                quantize: str | None = None, working: int = WORKING_BYTES,
                dtype_bytes: int = 2, caches: int = 0) -> tuple[ParallelPlan, Estimate]:
    """The plan of the fewest GPUs (1, 2, 4, 8, at most `gpus`) whose per-rank estimate fits `gpu_bytes`;
    PlanError saying what each would need when none does."""
    tried = []
    for world in sorted(DEFAULT_FOR_WORLD):
        if world > gpus:
            break
        plan = PRESETS[DEFAULT_FOR_WORLD[world]]
        try:
            plan.check_model(cc.model)
        except PlanError:
            continue
        est = estimate(ckpt, cc, plan, dtype_bytes, quantize, working, caches)
        if est.total <= gpu_bytes:
            return plan, est
        tried.append(est)
    needs = "; ".join(e.describe() for e in tried) or "no plan splits this model"
    raise PlanError(f"the model does not fit {gpus} GPU(s) of {gpu_bytes / GIB:.0f} GiB: {needs}. Use more GPUs, "
                    "a quantized checkpoint (MXFP4, MXFP8, NVFP4) or --quantize fp8")
