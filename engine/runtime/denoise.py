"""The denoise phase: flow-matching Euler with the SD3 shift, CFG or Distil guidance tokens, and the
prefix KV cache (the first step runs the sequence, later steps only the meta + image tokens).

Rectified flow: sigma goes 1 (noise) -> 0 (data), the model predicts v ~ noise - x0 and the update
is x <- x + v * (sigma_next - sigma), in fp32. Model inputs are t = sigma * 1000.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from engine.model.attention import AttnBatch, KVCache, attention_mask, sdpa_mask
from engine.model.hunyuan import HunyuanImage3
from engine.model.lora import LoraRows, lora_key
from engine.parallel.layout import Comm, PhaseView, graph_safe
from engine.runtime.conditioning import embed_range
from engine.runtime.graphs import Graphs
from engine.runtime.sequence import GenImageSpan, Sequence
from engine.runtime.step_cache import StepCache


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """[steps + 1] fp32: linspace(1, 0) then sigma' = s*sigma / (1 + (s - 1)*sigma)."""
    s = torch.linspace(1, 0, steps + 1)
    return (shift * s) / (1 + (shift - 1) * s) if shift != 1.0 else s


def tail_embeddings(model: HunyuanImage3, x: torch.Tensor, t: torch.Tensor, r: torch.Tensor | None,
                    guidance: torch.Tensor | None) -> torch.Tensor:
    """[B, meta + h*w, H] for the latent x [B, C, h, w] at time t [B] (t*1000 units): the <timestep>
    token, Distil's <guidance> and <timestep_r> tokens, then the patch-embedded image tokens."""
    dt = model.dtype
    parts = [model.timestep_emb(t).to(dt)[:, None]]
    if guidance is not None:
        parts.append(model.guidance_emb(guidance).to(dt)[:, None])
    if r is not None:
        parts.append(model.timestep_r_emb(r).to(dt)[:, None])
    parts.append(model.patch_embed(x.to(dt), model.time_embed(t)))
    return torch.cat(parts, dim=1)


def velocity(model: HunyuanImage3, hidden: torch.Tensor, t: torch.Tensor, span: GenImageSpan) -> torch.Tensor:
    """Image-token hidden states [B, h*w, H] (last layer, no ln_f) -> velocity [B, C, h, w] fp32."""
    return model.final_layer(hidden, model.time_embed_2(t), span.h, span.w).float()


TAIL_GRAIN = 512   # cache positions: the step's tokens start at a multiple of this (see `tail_index`)


def tail_index(span: GenImageSpan) -> int:
    """Where a denoise step's tokens (meta + image) sit in the cache: the request's prefix [0, meta_start)
    stays where the AR phase and the prefill wrote it, the step's tokens start at meta_start rounded up
    to TAIL_GRAIN, and the keys between them are hidden from every row (AttnBatch.key_mask). So a step's
    shapes depend on the prompt + CoT length only by TAIL_GRAIN steps: one graph serves every request of
    a resolution bucket whose prefix ends in the same grain (not one capture per sampled CoT length), at
    the price of masked attention over at most TAIL_GRAIN - 1 hidden keys. RoPE keeps the tokens'
    sequence positions: the cache index is only where their K/V live."""
    return -(-span.meta_start // TAIL_GRAIN) * TAIL_GRAIN


def step_keys(span: GenImageSpan) -> int:
    """The keys a denoise step attends to (its static kv_len): up to the end of its tokens in the cache."""
    return tail_index(span) + span.stop - span.meta_start


def step_key(span: GenImageSpan, images: int, branches: list[int], tail: int | None = None) -> tuple:
    """What a denoise step's graph depends on besides the plan (one per engine): its shapes, i.e. the
    image's latent size, where its tokens sit in the cache (`tail`, default `tail_index`: the prompt + CoT
    length only by TAIL_GRAIN steps), its rows (images x the CFG branches this rank computes)."""
    return "denoise", span.h, span.w, tail_index(span) if tail is None else tail, images, tuple(branches)


def step_class(span: GenImageSpan, images: int, branches: list[int]) -> tuple:
    """What requests whose steps share one forward agree on: the step key without its tail. Their prefixes
    may end anywhere: the batch puts every member's step tokens at the largest tail among them (a member's
    tail may move up, step to step: each step writes the K/V of its own tokens before it attends, and its
    key mask hides the gap after its prefix), engine/runtime/denoise_batch.py."""
    key = step_key(span, images, branches, 0)
    return key[:3] + key[4:]


@dataclass
class StepInputs:
    """What a denoise step varies: the latents x [images, C, h, w], the time t [1] (t*1000 units), Distil's
    r and g [1] (None without them). A request's own (`FlowSampler.inputs`), or the static copy a step
    graph reads (`StepBuffers`, engine/runtime/denoise_batch.py `BatchBuffers`)."""
    x: torch.Tensor
    t: torch.Tensor
    r: torch.Tensor | None = None
    g: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.x, self.t, self.r, self.g

    def clone(self) -> "StepInputs":
        return StepInputs(*(None if v is None else v.clone() for v in self.tensors()))

    def copy_(self, src: "StepInputs") -> None:
        for dst, v in zip(self.tensors(), src.tensors()):
            if dst is not None:
                dst.copy_(v)


@dataclass
class StepBuffers:
    """The static inputs of one step key's graph, owned with it (engine/runtime/graphs.py): the step's
    inputs, and the step's attention tables (RoPE, the meta rows' mask, the keys of the request's own
    prefix, the token indices). Each request of the key writes its own values into them; the shapes are
    the key's."""
    inputs: StepInputs
    batch: AttnBatch

    def fill_batch(self, new: AttnBatch) -> None:
        """This request's step layout into the key's tables (the same shapes: the key says so)."""
        old = self.batch
        if (new.kv_len, new.masked_rows) != (old.kv_len, old.masked_rows):
            raise ValueError(f"a denoise step layout of {new.kv_len} keys, {new.masked_rows} masked rows "
                             f"under a step key of {old.kv_len} keys, {old.masked_rows} masked rows")
        for name in ("index", "cos", "sin", "mask", "gathered", "key_mask"):
            dst, src = getattr(old, name), getattr(new, name)
            if (dst is None) != (src is None):
                raise ValueError(f"a denoise step layout {'with' if src is not None else 'without'} {name} "
                                 f"under a step key {'without' if dst is None else 'with'} it")
            if dst is not None:
                dst.copy_(src)


@dataclass(frozen=True)
class DenoiseLayout:
    """Where one request's denoise rows are on this rank and how its step runs over them.

    view: the denoise phase's view (TP x SP: under SP each forward's tokens are split over `view.sp`).
    branches: the CFG branches this rank computes, as rows of the runner's `ids` (0 = cond, 1 = uncond):
      both (batched CFG), the one of its replica (CFG-parallel, gathered over `branch_comm`), or [0].
    starts: each branch's first position not in its cache (the cond branch continues the AR cache).
    scratch: the cache slot that SP padding tokens write and no real query reads (past the step's keys).
    images: how many images share the request's reasoning; each branch has one cache row per image
      (rows are branch-major: branch j, image k is row j * images + k).
    serial: one forward per branch (less activation memory) instead of one batch.
    storage: names the KV storage its rows are views of (a step graph replays on the storage it was
      captured on: it joins the step's graph key).
    """
    view: PhaseView
    branches: list[int]
    starts: list[int]
    scratch: int
    branch_comm: Comm = Comm()
    images: int = 1
    serial: bool = False
    storage: tuple = ()


class DenoiseRunner:
    """Runs the backbone for the denoise phase of one request on one rank of any plan, over its rows as
    `layout` lays them out (DenoiseLayout).

    `prefill()` computes, once, each branch's uncached prefix up to the image's meta tokens (from the
    branch's `starts`) for one image row and copies its K/V to the branch's other image rows: the prefix
    never attends to the image, so every image of a branch shares it. Each step then runs only the meta +
    image tokens of every row (their K/V at `tail_index` in the cache, so that the step's shapes are its
    key's), as one batch or one branch after the other (`serial`).
    step_cache: the request's policy (engine/runtime/step_cache.py), asked before each step whether the
      backbone runs in full or its output is forecast; default: every step in full.
    """

    def __init__(self, model: HunyuanImage3, seq: Sequence, refs: list, ids: torch.Tensor, cache: KVCache,
                 layout: DenoiseLayout, graphs: Graphs | None = None, step_cache: StepCache | None = None,
                 lora: tuple[LoraRows | None, LoraRows | None] = (None, None)):
        """ids [branches, L]: the sequence's ids per CFG branch (row 1: the uncond branch's); refs: its
        images' encodings. `graphs`: the engine's graph owner, where each step runs as its step key's graph
        when it can be captured (None: eagerly). `lora`: the request's LoRA adapter rows (the pool's static
        buffers: the graphs read them) of its prefix (the request's rows where it joined) and of its steps
        (one row for all its rows)."""
        self.model, self.seq, self.refs, self.ids, self.cache = model, seq, refs, ids, cache
        self.layout, self.view, self.images = layout, layout.view, layout.images
        if layout.scratch < step_keys(seq.gen_image):
            raise ValueError(f"the scratch slot {layout.scratch} lies among the step's {step_keys(seq.gen_image)} keys")
        T = seq.tensors(model.device, length=layout.scratch + 1)
        self.pos, self.blocks = T["pos"], T["blocks"]
        self.span = seq.gen_image
        self._batches: dict[tuple[int, int], tuple] = {}   # (start, stop) -> (chunk, n, AttnBatch)
        self.tail = tail_index(seq.gen_image)                  # where its step's tokens sit when it runs alone
        self._step: dict[int, tuple[int, int, AttnBatch]] = {}   # the step's layout in the cache, by tail
        self._shared: tuple[int, int, AttnBatch] | None = None  # ... and as copied into its key's graph buffers
        # every step runs the same kernels on the same shapes: on CUDA in bf16 (and groups a graph can hold)
        # the step is one graph (no launch gaps), captured once per step key for the engine's life and
        # replayed by every later request of that key over the key's static buffers (`StepBuffers`)
        self.graphs = graphs
        self.use_graph = (graphs is not None and not layout.serial and graphs.capturable(model)
                          and graph_safe(layout.view.tp, layout.view.sp, layout.branch_comm))
        self.key = self.key_at(self.tail)
        self._static: StepBuffers | None = None
        self.step_cache = step_cache if step_cache is not None else StepCache(0)
        self.prefill_lora, self.lora = lora

    @property
    def graph_key(self) -> tuple:
        """The key of its step's graph (and buffers) when it runs alone: the step key, and whether the step
        adds an adapter (one for all its rows) or runs the base weights."""
        return self.key + lora_key("off" if self.lora is None else "one+mlp" if self.lora.mlp else "one")

    def key_at(self, tail: int) -> tuple:
        """Its step key with its step's tokens at cache index `tail` (its own, or a denoise batch's)."""
        return step_key(self.span, self.layout.images, self.layout.branches, tail) + self.layout.storage

    def _layout(self, start: int, stop: int, dev: torch.device) -> tuple[int, int, object]:
        """This rank's share of tokens [start, stop): (chunk, n, AttnBatch), built once per range."""
        if (start, stop) not in self._batches:
            sp = self.view.sp
            n = stop - start
            index = torch.arange(start, stop, device=dev)
            gathered, chunk = None, n
            if sp.size > 1:    # split over SP ranks; padding tokens write the scratch slot
                chunk = -(-n // sp.size)
                pad = torch.full((chunk * sp.size - n,), self.layout.scratch, device=dev)
                gathered = torch.cat([index, pad])
                index = gathered[sp.rank * chunk:(sp.rank + 1) * chunk]
            batch = self.model.attn_batch(index, self.pos, self.blocks, stop, self.view, gathered=gathered,
                                          masked_rows=self._masked_rows(start, stop, chunk), lora=self.prefill_lora)
            self._batches[(start, stop)] = (chunk, n, batch)
        return self._batches[(start, stop)]

    def step_layout(self, dev: torch.device, at: int | None = None) -> tuple[int, int, AttnBatch]:
        """The step's tokens [meta_start, stop) moved to their cache place, `at` (default its own tail,
        `tail_index`; a denoise batch's may be later): their sequence-space layout with the cache indices
        shifted, the meta rows' mask and the key mask over the step's keys (the request's prefix and its
        own step tokens visible, the gap hidden). Built once per request and tail, on the host's side of
        the step; a step graph reads a copy (`StepBuffers`, the batch's `BatchBuffers`)."""
        at = self.tail if at is None else at
        if at < self.tail:
            raise ValueError(f"a denoise step's tokens at {at}, inside the request's prefix (its tail {self.tail})")
        if at not in self._step:
            span = self.span
            start, stop = span.meta_start, span.stop
            chunk, n, seq = self._layout(start, stop, dev)
            K = at + stop - start

            def moved(i: torch.Tensor | None) -> torch.Tensor | None:     # SP padding keeps its scratch slot
                return None if i is None else torch.where(i < stop, i + (at - start), i)

            rows = seq.gathered if seq.gathered is not None and self.view.sp_kind == "ulysses" else seq.index
            natural = attention_mask(rows[:seq.masked_rows], self.blocks, stop)      # [m, stop], sequence space
            mask = natural.new_zeros(natural.shape[0], K)
            mask[:, :start], mask[:, at:] = natural[:, :start], natural[:, start:]
            keys = torch.arange(K, device=dev)
            own = (keys < start) | (keys >= at)
            dt = self.model.dtype
            self._step[at] = chunk, n, AttnBatch(moved(seq.index), seq.cos, seq.sin, K, sdpa_mask(mask[None, None], dt),
                                                 moved(seq.gathered), seq.masked_rows,
                                                 key_mask=sdpa_mask(own.view(1, 1, 1, K), dt), lora=self.lora)
        return self._step[at]

    def _masked_rows(self, start: int, stop: int, chunk: int) -> int | None:
        """For the step's tokens [meta_start, stop): how many of this rank's leading query rows are meta
        tokens (causal, masked); the image tokens after them see every key before the image's end. None
        for other ranges (the prefix keeps its full mask). Host arithmetic, once per range."""
        if (start, stop) != (self.span.meta_start, self.span.stop):
            return None
        meta = self.span.start - start
        sp = self.view.sp
        if sp.size == 1 or self.view.sp_kind == "ulysses":     # rows: the whole range (Ulysses: gathered)
            return meta
        return min(max(meta - sp.rank * chunk, 0), chunk)     # KV all-gather: this rank's own chunk

    def _run(self, x: torch.Tensor, layout: tuple[int, int, AttnBatch], rows: slice,
             layers: range | None = None) -> torch.Tensor:
        """The tokens of `layout` (`_layout` or `step_layout`) with embeddings x [B, n, H] into cache rows
        `rows` -> hidden [B, n, H] (`layers`: only these, x the residual stream entering the first)."""
        sp = self.view.sp
        chunk, n, batch = layout
        if sp.size > 1:
            x = torch.cat([x, x.new_zeros(x.shape[0], chunk * sp.size - n, x.shape[2])], dim=1)
            x = x[:, sp.rank * chunk:(sp.rank + 1) * chunk]
        h = self.model.backbone(x, batch, self.cache.rows(rows), self.view, layers)
        if sp.size > 1:
            h = sp.all_gather(h, dim=1)[:, :n]
        return h

    def _rows(self, j: int) -> slice:
        return slice(j * self.images, (j + 1) * self.images)

    def prefill(self) -> None:
        """Each branch's uncached prefix [start, meta), once, shared by the branch's image rows."""
        meta = self.span.meta_start
        for j, b in enumerate(self.layout.branches):
            start, row = self.layout.starts[j], j * self.images
            if start < meta:
                x = embed_range(self.model, self.seq, self.ids[b:b + 1], self.refs, start, meta)
                self._run(x, self._layout(start, meta, x.device), slice(row, row + 1))
            if self.images > 1:      # the other images of the branch see the same prefix
                for t in (*self.cache.k, *self.cache.v):
                    t[row + 1:row + self.images, :, :meta] = t[row:row + 1, :, :meta]

    def velocity(self, i: int, inputs: StepInputs) -> torch.Tensor:
        """Step i at `inputs` (x [images, C, h, w]) -> v [branches_total * images, C, h, w] (fp32,
        branch-major), identical on all ranks. `prefill()` must have run. The result may be the graph's
        output buffer: use it before the next step. Step i runs the backbone or, where the step cache says
        so, forecasts its output from cached features (eagerly: a few elementwise ops) and runs only the
        final layer."""
        cache = self.step_cache
        if not cache.full(i):
            return self._head(cache.forecast(i), inputs.t)
        if not self.use_graph or not cache.graphable:
            v, hidden = self._velocity(inputs, i)
        else:
            if self._static is None:
                self._static = self._take_buffers(inputs)
            s = self._static
            s.inputs.copy_(inputs)
            v, hidden = self.graphs.replay(self.graph_key, lambda: self._velocity(s.inputs), warmup=2)
        cache.record(i, hidden)
        return v

    def _take_buffers(self, inputs: StepInputs) -> StepBuffers:
        """The step key's buffers, this request's step layout copied into them (the first request of the
        key makes them from its own). Once per request, before its first step."""
        chunk, n, mine = self.step_layout(inputs.x.device)
        s = self.graphs.buffers(self.graph_key, lambda: StepBuffers(inputs.clone(), mine))
        if s.batch is not mine:
            s.fill_batch(mine)
        self._shared = chunk, n, s.batch
        return s

    def _velocity(self, inputs: StepInputs, i: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(v, the backbone's output for the step's tokens [rows, meta + h*w, H]) at step i."""
        n, nb = self.images, len(self.layout.branches)
        x, t, r, g = inputs.tensors()
        # the branches differ only in their prefix: the meta + image embeddings (the patch embedding's
        # 4096-channel convolutions among them) are computed once per image and shared by every branch
        tail = tail_embeddings(self.model, x, t.expand(n), None if r is None else r.expand(n),
                               None if g is None else g.expand(n)).repeat(nb, 1, 1)
        hidden = self.step_cache.backbone(i, tail, self._forward, self.layout.branch_comm)
        return self._head(hidden, t), hidden

    def _forward(self, x: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        """The step's tokens of every row through `layers` (default all): one batch, or branch by branch."""
        layout = self._shared or self.step_layout(x.device)      # a graph's step reads its key's tables
        if not self.layout.serial:
            return self._run(x, layout, slice(None), layers)
        return torch.cat([self._run(x[self._rows(j)], layout, self._rows(j), layers)
                          for j in range(len(self.layout.branches))])

    def _head(self, hidden: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The backbone's output [rows, meta + h*w, H] -> v of every branch (gathered over `branch_comm`)."""
        span = self.span
        v = velocity(self.model, hidden[:, -span.h * span.w:], t.expand(hidden.shape[0]), span)
        return self.layout.branch_comm.all_gather(v, dim=0)


@dataclass
class StepInput:
    """What one request's denoise step i needs from the backbone: its runner and its inputs; answered with
    v [rows, C, h, w] (fp32)."""
    runner: DenoiseRunner
    i: int
    inputs: StepInputs


class FlowSampler:
    """One request's flow-matching Euler sampler over its latents `noise` [images, C, h, w]: `inputs(i)`
    for step i's velocity, then `update(i, v)`. With CFG v is [cond images ; uncond images]."""

    def __init__(self, noise: torch.Tensor, steps: int, shift: float, guidance: float, cfg: bool, distil: bool,
                 use_r: bool):
        dev = noise.device
        self.sig = flow_sigmas(steps, shift).to(dev)
        self.ts = self.sig * 1000.0
        self.x = noise.float()
        self.g = torch.tensor([1000.0 * guidance], device=dev).to(torch.bfloat16).float() if distil else None
        self.use_r, self.cfg, self.guidance = use_r, cfg, guidance

    def inputs(self, i: int) -> StepInputs:
        """The inputs of step i."""
        return StepInputs(self.x, self.ts[i:i + 1], self.ts[i + 1:i + 2] if self.use_r else None, self.g)

    def update(self, i: int, v: torch.Tensor) -> torch.Tensor:
        """Step i with the velocity v: x moves on; returns the clean-image estimate x0."""
        if self.cfg:
            n = self.x.shape[0]
            v = v[n:2 * n] + self.guidance * (v[:n] - v[n:2 * n])
        x0 = self.x - self.sig[i] * v
        self.x = self.x + (self.sig[i + 1] - self.sig[i]) * v
        return x0


def denoise(runner: DenoiseRunner, noise: torch.Tensor, steps: int, shift: float, guidance: float, cfg: bool,
            distil: bool, cancelled: Callable[[], bool] = lambda: False
            ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """One request on its own: yields (i, x_next, x0_estimate) after each step for the latents `noise`
    [images, C, h, w]; stops early when `cancelled()`. With CFG the runner's rows are [cond images ;
    uncond images]."""
    sampler = FlowSampler(noise, steps, shift, guidance, cfg, distil, distil and runner.model.timestep_r_emb is not None)
    for i in range(steps):
        if cancelled():
            return
        x0 = sampler.update(i, runner.velocity(i, sampler.inputs(i)))
        yield i, sampler.x, x0
