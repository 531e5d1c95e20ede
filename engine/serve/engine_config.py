"""The engine's configuration, from the command line's flag to every rank's KV pool: one frozen value,
checked when it is made and shipped whole to every worker process, which starts from it alone.

A new engine option is one field here and its use. The field's `option(...)` carries its default, its
help and how its flag reads: `add_arguments` puts every field's flag on a command line (`python app.py`,
`python -m engine`), `from_args` reads them back, and `__post_init__` refuses a bad value naming it,
whichever way it came (a flag, a caller of `EngineServer`, a test). Nothing in between passes it along.

A config is made in three steps, each a new value: what was asked for (`EngineConfig(...)`,
`from_args`); `on_this_machine()`: the device and the parallel plan chosen (on CUDA without --plan or
--gpus, the fewest GPUs that fit); `for_checkpoint(info)`: checked against the checkpoint (the plan splits
it, it takes the warm-up sizes and serves the adapters), the adapter folders absolute and the adapter
slots and their MLP tables as the adapters at start need.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import KW_ONLY, MISSING, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from engine import EMBEDDED_MODEL
from engine.model.kernel_layouts import MOE_KERNELS, MXFP8_KERNELS
from engine.runtime.lru import ENCODING_CACHE_MB, PREFIX_CACHE_MB

if TYPE_CHECKING:
    from engine.serve.info import ModelInfo

DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")
# `python app.py`'s --max-batch default (the one-shot `python -m engine` keeps the field's 1). CUDA: up to 8
# rows each decode MoE computes every token on its own (bf16: hunyuan_kernels/moe/cuda.py's decode variant;
# quantized: the GEMVs of hunyuan_kernels/quant/moe_cuda.py), so a request's tokens do not depend on its
# neighbours; 16 would serve more at once (docs/benchmarks.md, moe-decode) once the serving bench measures it.
# CPU: as many as the default --max-queue lets wait; a CPU decode step of the embedded model costs mostly its
# Python and launch overhead, which 8 rows share.
SERVING_MAX_BATCH = 8


def option(default: Any = MISSING, help: str = "", *, flag: str | None = "",
           parse: Callable[[Any], Any] | None = None, **argparse_kw: Any) -> Any:
    """A field with its command-line flag: `flag` (""; --the-field-name; None: no flag), its `help`, how
    argparse reads it (`type`, `choices`, `action`, ...) and `parse`, which turns the flag's value into the
    field's (argparse's default, None, stays the field's default)."""
    return field(default=default, metadata={"flag": flag, "help": help, "parse": parse, "argparse": argparse_kw})


def parse_loras(items: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora [NAME=]PATH, repeated: (name, folder) each; without NAME= the adapter is named after its folder."""
    loras = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or "/" in name:                     # a plain path (a folder whose name has a '=' too)
            name, path = Path(item).resolve().name or "adapter", item
        if not name.strip() or not path.strip():
            raise ValueError(f"--lora takes NAME=PATH or PATH (got {item!r})")
        loras.append((name.strip(), path.strip()))
    return tuple(loras)


def parse_warmup(value: str) -> tuple[str, ...]:
    sizes = tuple(s.strip() for s in value.split(",") if s.strip())
    if not sizes:
        raise ValueError("--warmup takes sizes (HxW, comma-separated), or nothing for the square bucket")
    return sizes


@dataclass(frozen=True)
class EngineConfig:
    model: str | Path = option(
        help="checkpoint folder in the official layout (default: the embedded model under assets/model)")
    _: KW_ONLY
    device: str = option("auto", "cpu, cuda or auto (default: cuda when available)")
    dtype: str | None = option(None, "bfloat16, float16, float32 or auto (default: bf16 on GPU, fp32 on CPU)",
                               choices=DTYPES)
    plan: str | None = option(None, "parallel plan: tp1, tp2, tp4, hybrid4, tp2sp2, tp2cfg2, tp8, hybrid8, ... "
                                    "(default: from --gpus; on CUDA without either, the fewest GPUs that fit)")
    world_size: int | None = option(None, "number of GPUs = engine ranks, one process each (default: the plan's, "
                                          "else 1; on cpu: gloo processes)", flag="--gpus", type=int)
    sp_kind: str | None = option(None, "sequence-parallel attention of the denoise phase (default ulysses)",
                                 flag="--sp-attn", choices=["ulysses", "kv_gather"])
    quantize: str | None = option(None, "fp8: quantize a high-precision (BF16) checkpoint's backbone linears to FP8 "
                                        "at load, one scale per output channel, activations per token on CUDA "
                                        "(router, embeddings, heads, ViT, VAE untouched); about half the weight memory",
                                  choices=["fp8"])
    max_batch: int = option(1, "requests the engine runs at once, their decode steps batched: its AR slots "
                               f"(default 1; python app.py: {SERVING_MAX_BATCH}, engine_config.SERVING_MAX_BATCH "
                               "says why)", type=int)
    max_denoise_batch: int = option(1, "requests of one resolution bucket whose denoise steps share one forward",
                                    type=int)
    step_policy: str = option("auto", "how decode and denoise steps share the GPU: interleave (a denoise "
                                       "step after every 8 decode steps), waves (the admitted requests' "
                                       "reasoning decoded together, then their images), overlap (interleave "
                                       "with the image work on a second CUDA stream; one GPU); auto: overlap on "
                                       "one GPU, interleave elsewhere (the fastest measured, docs/benchmarks.md)",
                              choices=["auto", "interleave", "waves", "overlap"])
    decode_lookahead: str = option("auto", "each AR decode step launches the next before its tokens reach the host, "
                                           "so the GPU runs it while the host reads them (auto: on a GPU)",
                                   choices=["auto", "on", "off"])
    preview_every: int = option(1, "a preview every this many denoise steps (0: none)", type=int)
    cfg_serial: bool = option(False, "run the CFG branches one after the other (less activation memory)",
                              action="store_true")
    cuda_graph: bool = option(True, "run the AR decode and denoise steps eagerly on CUDA (by default each is a "
                                    "CUDA-graph replay where it can be captured)",
                              flag="--no-cuda-graph", action="store_false")
    loras: tuple[tuple[str, str], ...] = option(
        (), "serve a LoRA adapter folder (as PEFT saves it) as the model NAME (repeatable; without NAME=, named "
            "after its folder)", flag="--lora", parse=parse_loras, action="append", metavar="[NAME=]PATH")
    max_loras: int = option(0, "adapter slots, for adapters loaded at run time too (default: as many as --lora)",
                            type=int)
    max_lora_rank: int = option(64, "the highest adapter rank the slots hold (the trainers use 32)", type=int)
    lora_merged: bool = option(False, "fold the one --lora adapter into the weights at load: every request uses "
                                      "it, with no per-step cost (float weights only; no adapters loaded at run "
                                      "time; engine/model/lora_merge.py)", action="store_true")
    lora_merged_scale: float = option(1.0, "the strength --lora-merged folds its adapter in at: every request names "
                                           "the adapter at this lora_scale (python -m engine: its --lora-scale)",
                                      type=float, metavar="S")
    lora_mlp: bool = option(False, "adapter slots for adapters of the MLPs too (gate_and_up_proj / down_proj: the "
                                   "shared MLP and every expert), loaded at run time; on by itself when a --lora "
                                   "adapter adapts them. Each slot (and one of zeros) costs 1.7 GB per GPU under "
                                   "hybrid4, 2.4 GB on one GPU, at --max-lora-rank 32 on the full model",
                            action="store_true")
    prefix_cache_mb: int = option(PREFIX_CACHE_MB, "K/V of conversations' earlier turns kept per GPU for the next "
                                                   f"turn, in MiB (0: off; engine/runtime/prefix_cache.py)", type=int)
    encoding_cache_mb: int = option(ENCODING_CACHE_MB, "image encodings of conversations' earlier turns kept per "
                                                       "GPU, in MiB (0: none kept; engine/runtime/conditioning.py)",
                                    type=int)
    warmup: tuple[str, ...] = option(
        (), "capture the CUDA graphs of default requests before the engine says ready, so the first users do not "
            "wait for them: decode and prefill buckets, and the denoise steps of SIZES (comma-separated HxW; "
            "default: the square bucket); takes seconds at start", parse=parse_warmup, nargs="?", const="default",
        metavar="SIZES")
    moe_kernels: str = option("auto", "the kernels of quantized (MXFP4, NVFP4, MXFP8, FP8) experts: triton (ours), "
                                      "humming (humming-kernels W4A16: pip install '.[humming]', a Hopper GPU), "
                                      "humming-fp8 (its W4A8: FP8 activations), auto (humming-fp8 where humming can "
                                      "take the experts and they are MXFP4, else triton; default; "
                                      "engine/model/kernel_layouts.py)",
                              choices=MOE_KERNELS)
    # default triton: the fold has not run on a GPU yet (issue 41); auto is meant to become the default then
    mxfp8_kernels: str = option("triton", "the kernels of MXFP8 weights (the mixed builds' attention and shared MLP): "
                                          "triton (weight-only, bf16 activations), fp8 (folded at load into FP8 per "
                                          "output channel, W8A8 on FP8 tensor cores), auto (fp8 where the experts run "
                                          "humming-fp8, else triton)", choices=MXFP8_KERNELS)
    verbose: bool = option(False, flag=None)      # loading progress on stderr (a command line's from_args: on)

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_denoise_batch", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        for name in ("preview_every", "max_loras", "prefix_cache_mb", "encoding_cache_mb"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (got {getattr(self, name)})")
        if self.world_size is not None and self.world_size < 1:
            raise ValueError(f"world_size (--gpus) must be >= 1 (got {self.world_size})")
        if self.moe_kernels not in MOE_KERNELS:
            raise ValueError(f"moe_kernels {self.moe_kernels!r}: one of {', '.join(MOE_KERNELS)}")
        if self.mxfp8_kernels not in MXFP8_KERNELS:
            raise ValueError(f"mxfp8_kernels {self.mxfp8_kernels!r}: one of {', '.join(MXFP8_KERNELS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose bfloat16, float16 or float32")
        if self.quantize is not None:
            from engine.model.weights import ONLINE_FORMATS
            if self.quantize not in ONLINE_FORMATS:
                raise ValueError(f"unknown quantize {self.quantize!r} (supported: {', '.join(ONLINE_FORMATS)})")
        if any(not isinstance(s, str) or not s for s in self.warmup):
            raise ValueError(f"warmup takes sizes such as 1024x1024 or 'default' (got {self.warmup!r})")
        self._check_loras()

    def _check_kernels_on_the_cpu(self) -> None:
        """The CPU engine dequantizes quantized weights at load (engine/model/loader.py keeps_quantized): a named
        kernel family of quantized packs has nothing to run there, said before anything is spawned."""
        if self.device != "cpu":
            return
        if self.moe_kernels in ("humming", "humming-fp8"):
            raise ValueError(f"--moe-kernels {self.moe_kernels} runs on a Hopper GPU; the CPU engine keeps no "
                             "quantized experts (use auto or triton)")
        if self.mxfp8_kernels == "fp8":
            raise ValueError("--mxfp8-kernels fp8 runs on a CUDA GPU with FP8 tensor cores; the CPU engine keeps no "
                             "MXFP8 weights (use auto or triton)")

    def _check_loras(self) -> None:
        if len({n for n, _ in self.loras}) < len(self.loras):
            raise ValueError(f"two LoRA adapters share a name: {', '.join(n for n, _ in self.loras)}")
        if self.lora_merged and (len(self.loras) != 1 or self.max_loras > 1):
            raise ValueError(f"--lora-merged folds one LoRA adapter into the weights: it needs exactly one --lora "
                             f"and no other adapter slots (got {len(self.loras)} adapters, {self.max_loras} slots)")
        if self.lora_mlp and not (self.loras or self.max_loras):
            raise ValueError("--lora-mlp sizes adapter slots: give --lora NAME=PATH or --max-loras N too")

    @property
    def lora_slots(self) -> int:
        """Adapter slots the engine allocates (0: none, the base model's forwards unchanged; merged: none)."""
        return 0 if self.lora_merged else max(self.max_loras, len(self.loras))

    # ------------------------------------------------------------------ the command line
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Every option's flag, its help ending with its default."""
        for f in dataclasses.fields(cls):
            if f.metadata.get("flag") is None:
                continue
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            kw = {"help": f.metadata["help"], **f.metadata["argparse"]}
            if kw.get("action") not in ("store_true", "store_false"):
                kw.update(default=None)       # absent: the field's own default (from_args leaves it out)
                if "choices" not in kw:
                    kw.setdefault("metavar", flag.lstrip("-").upper().replace("-", "_"))
                if "(default" not in kw["help"] and f.default not in (MISSING, None, ()):
                    kw["help"] += f" (default {f.default})"
            parser.add_argument(flag, dest=f.name, **kw)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **fixed: Any) -> EngineConfig:
        """The config the flags of `add_arguments` ask for (ValueError naming a bad one), with `fixed`
        fields a command line sets itself; a command line shows its loading progress (verbose)."""
        values: dict[str, Any] = {"model": EMBEDDED_MODEL, "verbose": True}
        for f in dataclasses.fields(cls):
            value = getattr(args, f.name, None)
            if f.metadata.get("flag") is None or value is None:
                continue
            parse = f.metadata["parse"]
            values[f.name] = parse(value) if parse is not None else value
        return cls(**{**values, **fixed})

    # ------------------------------------------------------------------ resolved for a machine, a checkpoint
    def with_plan(self) -> EngineConfig:
        """The parallel plan named, its world size and SP attention fixed (PlanError: a plan that does not exist
        or does not have --gpus ranks)."""
        from engine.parallel.plan import get_plan
        plan = get_plan(self.plan, self.world_size, self.sp_kind)
        return dataclasses.replace(self, plan=plan.name, world_size=plan.world, sp_kind=plan.sp_kind)

    def on_this_machine(self) -> EngineConfig:
        """The device (`auto`: cuda when there is a GPU) and the plan chosen here; ValueError in one sentence when
        this machine cannot run it (engine/serve/placement.py)."""
        from engine.serve.placement import default_device, device_problem, fitting_plan
        device = default_device() if self.device == "auto" else self.device
        if (problem := device_problem(device)) is not None:
            raise ValueError(problem)
        plan = self.plan
        if device.startswith("cuda") and plan is None and self.world_size is None:    # the fewest GPUs that fit
            plan = fitting_plan(self.model, self.dtype, self.quantize, self.verbose,
                                (self.prefix_cache_mb + self.encoding_cache_mb) << 20)
        return dataclasses.replace(self, device=device, plan=plan).with_plan()

    def for_checkpoint(self, info: ModelInfo) -> EngineConfig:
        """Checked against the checkpoint `info` reads (ValueError naming what it cannot do: split by the plan,
        take a warm-up size, serve an adapter, each adapter read here as every rank will), with the folders
        absolute, the adapter slots at least the adapters at start (they stay when one is unloaded) and MLP
        tables when one of them adapts the MLPs."""
        from engine.parallel.plan import check_step_policy, get_plan
        from engine.serve.adapters import check_adapter, needs_mlp
        from engine.checkpoint.buckets import parse_size
        plan = get_plan(self.plan, self.world_size, self.sp_kind)
        plan.check_model(info.cfg)
        check_step_policy(self.step_policy, plan.world, self.device.split(":")[0])
        self._check_kernels_on_the_cpu()
        for size in self.warmup:
            if size != "default" and parse_size(size, info.buckets) is None:
                raise ValueError(f"a warm-up size names a size (HxW), not {size!r}")
        loras = tuple((n, str(Path(f).resolve())) for n, f in self.loras)
        config = dataclasses.replace(self, model=str(Path(self.model).resolve()), loras=loras,
                                     max_loras=max(self.max_loras, len(loras)),
                                     lora_mlp=self.lora_mlp or needs_mlp(loras, self.lora_merged))
        for name, folder in config.loras:
            check_adapter(info, name, folder, config.max_lora_rank, config.lora_merged, config.lora_mlp)
        return config
