"""The engine's configuration: fixed once where the engine is made (the command line's flags, or
`EngineServer`'s arguments), validated there, and shipped whole to every worker process, which starts
from it alone. A new engine option is one field here and its use; nothing in between passes it along."""
from __future__ import annotations

from dataclasses import dataclass

from engine.model.kernel_layouts import MOE_KERNELS
from engine.runtime.lru import ENCODING_CACHE_MB, PREFIX_CACHE_MB


@dataclass(frozen=True)
class EngineConfig:
    model: str                      # the checkpoint folder, absolute
    device: str                     # cpu, cuda (the workers pick their GPU by rank)
    dtype: str | None               # bfloat16, float16, float32; None: the device's default
    plan: str                       # the parallel plan preset (engine.parallel.plan), resolved
    world_size: int                 # ranks: one worker process each
    sp_kind: str                    # the plan's SP attention: ulysses or kv_gather
    quantize: str | None = None     # quantize a high-precision checkpoint's backbone linears at load ("fp8")
    max_batch: int = 1              # requests the engine runs at once (its AR slots)
    preview_every: int = 1          # a preview every this many denoise steps (0: none)
    verbose: bool = False           # loading progress on stderr
    cfg_serial: bool = False        # CFG branches one after the other (less activation memory)
    cuda_graph: bool = True         # steps as CUDA graphs where they can be captured
    max_denoise_batch: int = 1      # requests of one denoise step key whose steps share a forward
    loras: tuple[tuple[str, str], ...] = ()   # LoRA adapters loaded at start: (name, PEFT folder)
    max_loras: int = 0              # adapter slots (at least len(loras); 0 and no loras: no adapter tables)
    max_lora_rank: int = 64         # the highest adapter rank the slots hold (the trainers use 32)
    prefix_cache_mb: int = PREFIX_CACHE_MB       # conversations' K/V prefixes per rank (prefix_cache.py; 0: off)
    encoding_cache_mb: int = ENCODING_CACHE_MB   # their image encodings per rank (conditioning.py; 0: none kept)
    lora_merged: bool = False       # the one adapter of `loras` folded into the weights (engine/model/lora_merge.py)
    lora_mlp: bool = False          # the adapter tables hold the MLPs too (engine/model/lora.py; --lora-mlp)
    warmup: tuple[str, ...] = ()    # sizes whose graphs are captured before "ready" ("default": the square
                                    # bucket; engine/runtime/warmup.py); empty: none, the first requests capture
    moe_kernels: str = "auto"       # the kernels of the quantized experts (engine/model/kernel_layouts.py)

    def __post_init__(self) -> None:
        if self.moe_kernels not in MOE_KERNELS:
            raise ValueError(f"moe_kernels {self.moe_kernels!r}: one of {', '.join(MOE_KERNELS)}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1 (got {self.max_batch})")
        if self.max_denoise_batch < 1:
            raise ValueError(f"max_denoise_batch must be >= 1 (got {self.max_denoise_batch})")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1 (got {self.world_size})")
        if self.preview_every < 0:
            raise ValueError(f"preview_every must be >= 0 (got {self.preview_every})")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1 (got {self.max_loras}, "
                             f"{self.max_lora_rank})")
        if self.prefix_cache_mb < 0 or self.encoding_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb and encoding_cache_mb must be >= 0 (0: off; got "
                             f"{self.prefix_cache_mb}, {self.encoding_cache_mb})")
        if any(not isinstance(s, str) or not s for s in self.warmup):
            raise ValueError(f"warmup takes sizes such as 1024x1024 or 'default' (got {self.warmup!r})")
        if len({n for n, _ in self.loras}) < len(self.loras):
            raise ValueError(f"two LoRA adapters share a name: {', '.join(n for n, _ in self.loras)}")
        if self.lora_merged and (len(self.loras) != 1 or self.max_loras > 1):
            raise ValueError(f"--lora-merged folds one LoRA adapter into the weights: it needs exactly one --lora "
                             f"and no other adapter slots (got {len(self.loras)} adapters, {self.max_loras} slots)")

    @property
    def lora_slots(self) -> int:
        """Adapter slots the engine allocates (0: none, the base model's forwards unchanged; merged: none)."""
        return 0 if self.lora_merged else max(self.max_loras, len(self.loras))

    def pipeline_options(self) -> dict:
        """What every rank's Pipeline takes from it (besides the model and its groups)."""
        return {"preview_every": self.preview_every, "slots": self.max_batch, "cfg_serial": self.cfg_serial,
                "cuda_graph": self.cuda_graph, "max_denoise_batch": self.max_denoise_batch,
                "prefix_cache_bytes": self.prefix_cache_mb << 20, "encoding_cache_bytes": self.encoding_cache_mb << 20}
