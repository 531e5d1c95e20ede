"""One rank's engine: the loaded model and what every request shares on this rank (the KV pool, the CUDA
graphs, the ranks' agreement, the conversations' caches), the LoRA adapters it serves, and its steps.

`Engine.from_config` is the one builder of an engine from its configuration (the worker processes, the
command line and the benchmarks that load a checkpoint use it): load this rank's shard, merge or load the
LoRA adapters, then the engine's resources. `step(news)` runs one engine step of the requests admitted
(the adapter changes first, then the scheduler: engine/runtime/scheduler.py); `run(req)` runs one request
on its own through a scheduler of its own (the command line, tests, tools). A request's own work is its
program (engine/runtime/program.py), which the scheduler asks for by the factory `program`: the
scheduler never reaches back into the engine.

The warm-up (engine/runtime/warmup.py) runs on a built engine, before it serves anything.
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Iterator, Protocol

import torch

from engine.model.kernel_layouts import fold_mxfp8_weights, humming_hint, kernels_text, lay_out_experts
from engine.parallel.plan import check_step_policy, default_step_policy
from engine.model.loader import LoadedModel, load, parse_dtype
from engine.model.lora import load_adapter
from engine.model.lora_merge import merge_adapter
from engine.model.peft import ALL_TARGETS, read_peft
from engine.parallel.groups import RankGroups
from engine.runtime.agreement import Agreement
from engine.runtime.conditioning import EncodingCache
from engine.runtime.denoise_batch import DenoiseBatch
from engine.runtime.events import Error, Event
from engine.runtime.graphs import Graphs
from engine.runtime.handoff import cache_heads
from engine.runtime.kv_pool import KVPool
from engine.runtime.options import EngineOptions
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.program import Context, program
from engine.runtime.request import Prepared, Request, RequestError, prepare, with_seed
from engine.runtime.request_state import Program
from engine.runtime.scheduler import DECODE_STEPS_PER_DENOISE, Scheduler, StepNews
from engine.checkpoint.prompts import PromptError

Progress = Callable[[int, int, str], None]


class EngineSettings(Protocol):
    """What `Engine.from_config` reads of an engine's configuration (engine/serve/engine_config.py's
    EngineConfig), by the same names."""
    model: str
    device: str
    dtype: str | None
    quantize: str | None
    max_batch: int
    max_denoise_batch: int
    preview_every: int
    cfg_serial: bool
    cuda_graph: bool
    prefix_cache_mb: int
    encoding_cache_mb: int
    loras: tuple[tuple[str, str], ...]
    lora_merged: bool
    lora_merged_scale: float
    lora_slots: int
    max_lora_rank: int
    lora_mlp: bool
    moe_kernels: str
    mxfp8_kernels: str
    step_policy: str
    decode_lookahead: str


class Engine:
    def __init__(self, loaded: LoadedModel, groups: RankGroups | None = None,
                 options: EngineOptions = EngineOptions(), graphs: Graphs | None = None):
        """The engine of `loaded` on this rank of its plan (`groups`; default: one rank on the model's
        device). `graphs`: the owner of its CUDA graphs (default: a new one)."""
        model = loaded.model
        groups = groups or RankGroups.single(model.device)
        graphs = graphs or Graphs()
        heads = cache_heads(groups.plan, groups.rank, groups.denoise.sp.rank,
                            model.transformer.layers[0].self_attn.kv_per_micro)
        # AR prefill, decode and denoise steps as CUDA-graph replays where every kernel of a step can be
        # captured (Graphs.capturable: CUDA in bf16), decided here, not by a failed capture
        cuda_graph = options.cuda_graph and graphs.capturable(model)
        # the requests' KV caches, with the AR prefill and batched decode steps (graphs) over them
        pool = KVPool(model, heads.alloc.stop, heads.ar, loaded.cfg.max_position_embeddings + 1, options.max_batch,
                      groups.ar, graphs, cuda_graph, options.max_denoise_batch)
        f = loaded.cfg.vae_downsample_factor
        self.ctx = Context(loaded, groups, options, cuda_graph, heads, pool, graphs,
                           Agreement(groups.world, model.device),
                           PrefixCache(options.prefix_cache_bytes),          # the AR phase's cond K/V prefixes
                           EncodingCache(options.encoding_cache_bytes),     # history images' encodings, by content
                           max((b.height // f[0]) * (b.width // f[1]) for b in loaded.buckets))
        self.loaded, self.groups, self.options = loaded, groups, options
        self.pool, self.graphs, self.agree = pool, graphs, self.ctx.agree
        self.prefix, self.encodings = self.ctx.prefix, self.ctx.encodings
        self.moe_kernels: str | None = None        # what `from_config` laid the quantized experts out for
        self.mxfp8_kernels: str | None = None      # ... and what runs its MXFP8 weights ("fp8": folded at load)
        self.kernels_hint: str | None = None       # a faster choice `auto` could not make here (start-up log)
        self.scheduler = self.new_scheduler(policy=options.step_policy)     # the requests `step` advances

    @classmethod
    def from_config(cls, config: EngineSettings, groups: RankGroups | None = None,
                    progress: Progress | None = None) -> "Engine":
        """The engine `config` describes, on this rank of its plan (`groups`; default: one rank on
        `config.device`): this rank's shard loaded (`progress(done, total, what)` as it goes), checked
        against the plan, its LoRA adapters merged or loaded, its quantized experts laid out for their
        kernels (engine/model/kernel_layouts.py), its resources made. Raises what the load raises
        (ValueError, OSError: the message names the file, the adapter or the kernels refused)."""
        groups = groups or RankGroups.single(torch.device(config.device))
        dev = groups.device
        check_step_policy(config.step_policy, groups.plan.world, dev.type)
        loaded = load(config.model, dev, parse_dtype(config.dtype, dev), groups.layout, progress=progress,
                      quantize=config.quantize)
        groups.plan.check_model(loaded.cfg)
        _start_adapters(loaded, config)
        lora = loaded.model.lora                  # the experts' kernels, after any merge (MLP tables need triton)
        notes: list[str] = []
        moe_kernels = lay_out_experts(loaded.model, config.moe_kernels, lora is not None and lora.mlp is not None,
                                      notes)
        mxfp8_kernels = fold_mxfp8_weights(loaded.model, config.mxfp8_kernels, moe_kernels)
        options = EngineOptions(max_batch=config.max_batch, max_denoise_batch=config.max_denoise_batch,
                                preview_every=config.preview_every, cfg_serial=config.cfg_serial,
                                cuda_graph=config.cuda_graph,
                                step_policy=None if config.step_policy == "auto" else config.step_policy,
                                decode_lookahead={"on": True, "off": False}.get(config.decode_lookahead),
                                prefix_cache_bytes=config.prefix_cache_mb << 20,
                                encoding_cache_bytes=config.encoding_cache_mb << 20)
        engine = cls(loaded, groups, options)
        engine.moe_kernels, engine.mxfp8_kernels = moe_kernels, mxfp8_kernels
        engine.ctx.kernels = kernels_text(moe_kernels, mxfp8_kernels)      # every request's Started says it
        if config.moe_kernels == "auto" and moe_kernels == "triton" and dev.type == "cuda":
            engine.kernels_hint = "; ".join(notes) or humming_hint(loaded.model, torch.cuda.get_device_capability(dev))
        return engine

    def new_scheduler(self, decode_steps_per_denoise: int = DECODE_STEPS_PER_DENOISE,
                      policy: str | None = None, lookahead: bool | None = None) -> Scheduler:
        """A scheduler over this engine's shared resources (one at a time holds requests: it owns their
        order in the KV pool and the denoise batch), with its step `policy` (engine/runtime/scheduler.py;
        None: the engine's option, whose None is plan.default_step_policy) and decode `lookahead` (None: the
        engine's option, whose None is on a GPU)."""
        ctx = self.ctx
        denoising = DenoiseBatch(self.loaded.model, ctx.pool, ctx.heads.denoise, self.groups.denoise, ctx.graphs,
                                 self.options.max_denoise_batch)
        device = self.loaded.model.device.type
        policy = policy or self.options.step_policy or default_step_policy(self.groups.plan.world, device)
        if lookahead is None:
            lookahead = self.options.decode_lookahead
        if lookahead is None:
            lookahead = device == "cuda"
        return Scheduler(self.program, ctx.pool, denoising, ctx.agree, self.loaded.tok.vocab_size,
                         decode_steps_per_denoise, policy, lookahead)

    def program(self, p: Prepared) -> Program:
        """The phase program of the prepared request `p` (engine/runtime/program.py)."""
        return program(self.ctx, p)

    # ------------------------------------------------------------------ steps
    def step(self, news: StepNews = StepNews()) -> None:
        """One engine step: the adapter changes of `news` first (between steps, on every rank alike), then
        the scheduler's step over the requests admitted (`news`' joins and cancels)."""
        with torch.no_grad():
            if news.adapters:
                self.scheduler.lanes.merge()     # the image lane's forwards read the adapter tables
            for change in news.adapters:
                self.change_adapter(*change)
        self.scheduler.step(news)

    def run(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Event]:
        """One request on its own (the CLI, tests, tools): validated here, then the engine's steps with
        this one request in them; `cancelled()` is polled between steps (rank 0's answer is every rank's)."""
        try:
            p = prepare(self._agreed_seed(req), self.loaded, self.adapters(), self.merged())
        except (RequestError, PromptError, ValueError) as e:
            yield Error("invalid", str(e), getattr(e, "field", None))
            return
        yield from self.run_prepared(p, cancelled)

    def run_prepared(self, p: Prepared, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Event]:
        """The prepared request `p` alone through a scheduler of its own, to its end (`run`, the warm-up):
        interleave's, whatever the engine's policy, since one request has no other work to overlap with."""
        scheduler = self.new_scheduler(policy="interleave")
        news = StepNews(join=((0, p),))
        while True:
            scheduler.step(news)
            events, _ = scheduler.drain()
            for _, ev in events:
                yield ev
            if not scheduler.busy:
                return
            news = StepNews(cancel=frozenset({0}) if self.agree.flag(cancelled()) else frozenset())

    def _agreed_seed(self, req: Request) -> Request:
        """A request given to the engine directly (the CLI, tests) may come without a seed: rank 0 draws
        it and every rank takes rank 0's (the server fixes it before the request gets here)."""
        if req.seed is not None:
            return req
        req = with_seed(req)
        if self.groups.world.size > 1:
            seed = torch.tensor([req.seed], dtype=torch.long, device=self.loaded.model.device)
            req = dataclasses.replace(req, seed=int(self.groups.world.broadcast_(seed, 0)[0]))
        return req

    # ------------------------------------------------------------------ LoRA adapters
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters loaded (what a request's `lora` may name), or the one merged."""
        model = self.loaded.model
        if model.merged_lora is not None:
            return [model.merged_lora]
        return [] if model.lora is None else model.lora.loaded()

    def merged(self) -> tuple[str, float] | None:
        """(name, strength) of the LoRA adapter merged into the weights, if any (the only one then served)."""
        model = self.loaded.model
        return None if model.merged_lora is None else (model.merged_lora, model.merged_strength)

    def change_adapter(self, op: str, name: str, folder: str | None = None) -> None:
        """Load ("load", name, folder) or unload ("unload", name) a LoRA adapter between steps, on every rank
        alike (the server checked it first: a failure here is printed, the engine runs on without it)."""
        tables = self.loaded.model.lora
        self.prefix.clear()             # cached K/V was computed with the adapters as they were
        try:
            if tables is None:
                raise ValueError("the engine was started without LoRA adapter slots")
            if op == "load":
                load_adapter(tables, name, folder)
            else:
                tables.remove(name)
        except (ValueError, KeyError, OSError) as e:
            print(f"engine: LoRA adapter {name!r} not {op}ed: {e}", file=sys.stderr, flush=True)


def _start_adapters(loaded: LoadedModel, config: EngineSettings) -> None:
    """The LoRA adapters the engine starts with, this rank's slices: the one folded into the weights at
    `lora_merged_scale` (engine/model/lora_merge.py), or each in a slot of the adapter tables (allocated
    before the engine's forwards bind to them; rank and MLP tables as the adapters need, at least the
    configured ones)."""
    model = loaded.model
    adapters = [(name, read_peft(folder, loaded.cfg, model.layout, ALL_TARGETS)) for name, folder in config.loras]
    if config.lora_merged:
        (name, adapter), = adapters
        merge_adapter(model, adapter, config.lora_merged_scale, name)
        return
    if not config.lora_slots:
        return
    rank = max([config.max_lora_rank] + [a.rank for _, a in adapters])
    tables = model.enable_lora(config.lora_slots, rank, config.lora_mlp or any(a.adapts_mlp for _, a in adapters))
    for name, adapter in adapters:
        tables.install(name, adapter)
