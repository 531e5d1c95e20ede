"""The phase program of one request, readable top to bottom: encode references -> AR phase (CoT,
ratio) -> KV hand-off -> denoise (step previews) -> VAE decode -> PNG; and `Pipeline.run`, one request
on its own through the engine's scheduler.

The program is a generator (`Pipeline.program`): it runs its own forwards inline and yields its events,
and yields a need (engine/runtime/needs.py) wherever it shares the engine with other requests: an AR
slot of the KV pool, each decode step (batched with every other request's), each denoise turn. The
scheduler (engine/runtime/scheduler.py) answers them. Every rank of a plan runs the same programs on
its part of the model; rank 0's decisions (sampled tokens, which requests run) are agreed by all, and
rank 0 emits the events that matter.

The KV hand-off between the phases is engine/runtime/handoff.py and engine/runtime/kv_pool.py; the
decisions all ranks share are engine/runtime/agreement.py.
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time
from typing import Any, Callable, Generator, Iterator

import torch
import torch.nn.functional as F

from engine.model.attention import KVCache
from engine.model.loader import LoadedModel
from engine.model.lora import load_adapter
from engine.parallel.groups import RankGroups
from engine.parallel.layout import Comm
from engine.runtime.agreement import Agreement
from engine.runtime.conditioning import EncodingCache, embed_range, encode_sequence_images
from engine.runtime.denoise import DenoiseLayout, DenoiseRunner, FlowSampler, StepInput, step_key, step_keys
from engine.runtime.denoise_batch import DenoiseBatch
from engine.runtime.events import Done, Error, Event, Image, Ratio, Started, Step, Timings
from engine.runtime.graphs import Graphs
from engine.runtime.handoff import cache_heads, gather_sibling_heads, reusable_prefix
from engine.runtime.history import past_turn_layouts, reasoning_of
from engine.runtime.images import align_to_reference, png_bytes, to_pil
from engine.runtime.kv_pool import KVPool
from engine.runtime.lru import ENCODING_CACHE_MB, PREFIX_CACHE_MB
from engine.runtime.needs import ARSlot, DenoiseTurn, Need
from engine.runtime.prefix_cache import PrefixCache, PrefixKey, prefix_key
from engine.runtime.request import Prepared, Request, RequestError, prepare, with_seed
from engine.runtime.scheduler import Scheduler, StepNews
from engine.runtime.sequence import (CondImageLayout, PastTurnLayout, Sequence, SequenceBuilder,
                                     image_phase_sequence, text_phase_sequence, user_turn)
from engine.runtime.step_cache import StepCache, make_step_cache
from engine.runtime.text_phase import StagePlan, TextResult, generate_text
from engine.spec.buckets import nearest_bucket
from engine.spec.prompts import COT_TASKS, PromptError

Program = Generator["Event | Need", Any, None]
DENOISE_GRAPHS = 8      # denoise step keys whose graphs are kept (least recently used dropped first)


def synchronize(dev: torch.device) -> None:
    """Wait for the queued GPU work, so that a wall-clock reading covers it."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Pipeline:
    def __init__(self, lm: LoadedModel, runtime: RankGroups | None = None, preview_every: int = 1,
                 preview_tokens: int | None = None, kv_handoff: bool = True,
                 on_phase: Callable[[str], None] = lambda phase: None, cfg_serial: bool = False,
                 cuda_graph: bool = True, preview_share: float = 0.25, slots: int = 1,
                 graphs: Graphs | None = None, max_denoise_batch: int = 1,
                 prefix_cache_bytes: int = PREFIX_CACHE_MB << 20,
                 encoding_cache_bytes: int = ENCODING_CACHE_MB << 20):
        """`slots`: requests in their AR phase at once (the engine's batch: its AR slots in the KV pool).
        `graphs`: the owner of the engine's CUDA graphs (default: a new one). `max_denoise_batch`: requests
        of one step key whose denoise steps share a forward (engine/runtime/denoise_batch.py).
        `prefix_cache_bytes` / `encoding_cache_bytes`: the bounds of the cached K/V prefixes and image
        encodings of conversations (prefix_cache.py, conditioning.py; 0: off)."""
        self.lm = lm
        self.graphs = graphs or Graphs()    # every CUDA graph of this engine, by key
        # AR prefill, decode and denoise steps as CUDA-graph replays where every kernel of a step can be
        # captured (Graphs.capturable: CUDA in bf16), decided here, not by a failed capture
        cuda_graph = cuda_graph and self.graphs.capturable(lm.model)
        self.cuda_graph = cuda_graph
        self.cfg_serial = cfg_serial        # CFG branches one after the other instead of batched
        self.on_phase = on_phase            # called with "ar" / "denoise" as a phase starts (tests, tracing)
        self.rt = runtime or RankGroups.single(lm.model.device)
        self.preview_every = preview_every
        # previews may take at most this share of the denoise compute: on a CPU one preview (a VAE
        # decode) costs several denoise steps of a small model, so they are skipped until it is paid
        # for; on a GPU it is cheap beside a step and every step gets one
        self.preview_share = preview_share
        # previews decode a pooled latent of at most this many tokens (cheap on a GPU, tighter on a CPU)
        self.preview_tokens = preview_tokens or (256 if lm.model.device.type == "cuda" else 64)
        self.kv_handoff = kv_handoff
        f = lm.cfg.vae_downsample_factor
        self.max_image_tokens = max((b.height // f[0]) * (b.width // f[1]) for b in lm.buckets)
        model, rt = lm.model, self.rt
        self.heads = cache_heads(rt.plan, rt.rank, rt.denoise.sp.rank, model.transformer.layers[0].self_attn.kv_per_micro)
        # the requests' KV caches, with the AR prefill and batched decode steps (graphs) over them
        self.pool = KVPool(model, self.heads.alloc.stop, self.heads.ar, lm.cfg.max_position_embeddings + 1, slots,
                           rt.ar, self.graphs, cuda_graph, max_denoise_batch)
        self.agree = Agreement(rt.world, model.device)
        self.prefix = PrefixCache(prefix_cache_bytes)            # the AR phase's cond K/V prefixes
        self.encodings = EncodingCache(encoding_cache_bytes)     # history images' encodings, by content
        self._denoise_keys: collections.OrderedDict = collections.OrderedDict()   # step keys, least recent first

    def denoise_batch(self) -> DenoiseBatch:
        """The requests holding denoise rows, for a scheduler (one per scheduler: it owns their order)."""
        return DenoiseBatch(self.lm.model, self.pool, self.heads.denoise, self.rt.denoise, self.graphs,
                            self.pool.denoise_batch)

    # ------------------------------------------------------------------ public
    def run(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Event]:
        """One request on its own (the CLI, tests, tools): validated here, then the engine's steps with
        this one request in them; `cancelled()` is polled between steps (rank 0's answer is every rank's)."""
        try:
            p = prepare(self._agreed_seed(req), self.lm.gen, self.lm.buckets, self.adapters(), self.merged())
        except (RequestError, PromptError, ValueError) as e:
            yield Error("invalid", str(e), getattr(e, "field", None))
            return
        yield from self.run_prepared(p, cancelled)

    def run_prepared(self, p: Prepared, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Event]:
        """The prepared request `p` alone through a scheduler of its own, to its end (`run`, the warm-up)."""
        scheduler = Scheduler(self)
        news = StepNews(join=((0, p),))
        while True:
            scheduler.step(news)
            events, _ = scheduler.drain()
            for _, ev in events:
                yield ev
            if not scheduler.busy:
                return
            news = StepNews(cancel=frozenset({0}) if self.agree.flag(cancelled()) else frozenset())

    def adapters(self) -> list[str]:
        """The names of the LoRA adapters loaded (what a request's `lora` may name), or the one merged."""
        model = self.lm.model
        if model.merged_lora is not None:
            return [model.merged_lora]
        return [] if model.lora is None else model.lora.loaded()

    def merged(self) -> tuple[str, float] | None:
        """(name, strength) of the LoRA adapter merged into the weights, if any (the only one then served)."""
        model = self.lm.model
        return None if model.merged_lora is None else (model.merged_lora, model.merged_strength)

    def change_adapter(self, op: str, name: str, folder: str | None = None) -> None:
        """Load ("load", name, folder) or unload ("unload", name) a LoRA adapter between steps, on every rank
        alike (the server checked it first: a failure here is printed, the engine runs on without it)."""
        tables = self.lm.model.lora
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

    def program(self, p: Prepared) -> Program:
        """The phases of the prepared request `p`: its events, and the needs the scheduler answers."""
        t_start = time.perf_counter()
        try:
            system = self.lm.prompts.resolve(p.preset, p.bot_task, p.req.custom_system_prompt)
        except (PromptError, ValueError) as e:       # the preset's text is not in this checkpoint
            yield Error("invalid", str(e), "system_prompt")
            return
        yield Started(p.req.request_id, p.bot_task, "auto" if p.bucket is None else str(p.bucket), p.steps,
                      p.guidance, p.seed)
        try:
            yield from self._phases(p, system, t_start)
        except RequestError as e:   # found once the prompt is tokenized, on every rank alike, before any compute
            yield Error("invalid", str(e), e.field)

    # ------------------------------------------------------------------ helpers
    def _agreed_seed(self, req: Request) -> Request:
        """A request given to the pipeline directly (the CLI, tests) may come without a seed: rank 0
        draws it and every rank takes rank 0's (the server fixes it before the request gets here)."""
        if req.seed is not None:
            return req
        req = with_seed(req)
        if self.rt.world.size > 1:
            seed = torch.tensor([req.seed], dtype=torch.long, device=self.lm.model.device)
            req = dataclasses.replace(req, seed=int(self.rt.world.broadcast_(seed, 0)[0]))
        return req

    def _branches(self, cfg_on: bool) -> tuple[list[int], Comm]:
        if not cfg_on:
            return [0], Comm()
        if self.rt.plan.replica_mode == "cfg":
            return [self.rt.replica.rank], self.rt.replica
        return [0, 1], Comm()

    # ------------------------------------------------------------------ the request
    def _phases(self, p: Prepared, system: str, t_start: float) -> Program:
        lm, model, tok, rt, pool, heads = self.lm, self.lm.model, self.lm.tok, self.rt, self.pool, self.heads
        cfg, sp, dev = lm.cfg, tok.special, model.device
        timings = Timings()
        image_gen = torch.Generator(dev).manual_seed(p.seed)     # reference VAE samples, then the noise
        text_gen = torch.Generator(dev).manual_seed(p.seed)      # CoT sampling (its own stream)
        # every image of the sequence, earlier turns' first (engine/runtime/history.py), in sequence order;
        # the earlier turns' from the encoding cache (conditioning.py says why)
        past = p.sequence_images[:len(p.sequence_images) - len(p.images)]
        refs = encode_sequence_images(model, past, p.images, lm.buckets, image_gen, p.req.stretch, self.encodings)
        history, layouts = past_turn_layouts(p.history, [r.layout for r in refs])
        need_ratio = p.bucket is None
        run_ar = p.bot_task in COT_TASKS or p.bot_task == "auto" or need_ratio
        text_only = p.bot_task == "auto" or p.req.text_only
        cfg_on = not cfg.cfg_distilled and p.guidance > 1.0 and not text_only
        branches, branch_comm = self._branches(cfg_on)
        plan = StagePlan.for_task(p.bot_task, need_ratio, sp)
        ar_seq = text_phase_sequence(tok, system, p.req.prompt, layouts, plan.first_task, cfg.image_base_size,
                                     cfg.cond_token_attn_type, history)
        if len(ar_seq) + 16 + self.max_image_tokens > cfg.max_position_embeddings:
            raise RequestError(f"the prompt and reference images take {len(ar_seq)} tokens, too many for the "
                               f"model's {cfg.max_position_embeddings} positions",
                               "images" if p.sequence_images else "prompt")
        budget = min(len(ar_seq) + p.max_new_tokens + 8 + self.max_image_tokens + 8, cfg.max_position_embeddings)
        n_img = 1 if text_only else p.images_out
        adapter = self._adapter_slot(p)

        cot_text, ratio_index, text_res = None, None, TextResult()
        slot: int | None = None                 # this request's AR slot of the KV pool, until the hand-off
        runner: DenoiseRunner | None = None
        try:
            if run_ar:
                self.on_phase("ar")
                max_new = min(p.max_new_tokens, budget - len(ar_seq) - self.max_image_tokens - 16)
                ar_len = len(ar_seq) + max_new + 8            # the prompt, the CoT and its forced tokens
                slot = yield ARSlot(ar_len)
                T = ar_seq.tensors(dev, length=ar_len)        # positions for every position it may write
                row = pool.row(slot, T["pos"], T["blocks"], adapter, p.lora_scale)
                emb = embed_range(model, ar_seq, T["ids"][None], refs, 0, len(ar_seq))
                ar_key = prefix_key(ar_seq.ids, [c.vae.start for c in ar_seq.cond_images], [r.identity for r in refs],
                                    ar_seq.blocks, (p.lora, p.lora_scale))
                # only a turn that shows earlier turns reads the cache: a single request runs as it always did
                entry, cached = self.prefix.lookup(ar_key, len(ar_seq) - 1) if self.prefix.enabled and p.history \
                    else (None, 0)
                if p.history and self.prefix.enabled and rt.world.size > 1:
                    # the ranks' caches hold the same keys by construction (prefix_cache.py); the least any rank
                    # found is what every rank takes, so that a rank out of step cannot change the prefill's
                    # shapes on its own (each rank's entry shares at least that many tokens)
                    found = torch.tensor([cached], dtype=torch.long, device=dev)
                    cached = int(rt.world.all_gather(found, 0).min())
                if cached:
                    self.prefix.restore(entry, cached, row.cache)
                    row.cached = cached
                text_res = yield from generate_text(tok, row, emb, plan, p.sampling, text_gen, max_new,
                                                    self.agree.token)
                timings.ar_prompt_tokens, timings.ar_cached_tokens = len(ar_seq), cached
                timings.ar_prefill_ms = text_res.prefill_ms
                timings.ar_tokens = text_res.sampled
                timings.ar_forced = len(text_res.tokens) - text_res.sampled
                timings.ar_ms_per_token = text_res.ms_per_token
                if p.bot_task in COT_TASKS:
                    cot_text = reasoning_of(p.bot_task, tok.decode(text_res.tokens))
                if text_res.ratio_token is not None:
                    ratio_index = sp.ratio.index(text_res.ratio_token)
                if self.prefix.enabled:
                    self._keep_prefix(p, system, ar_seq, ar_key, history, layouts, cot_text, text_res, row.cache)
            full_text = tok.decode(text_res.tokens) if text_res.tokens else ""
            if text_only:
                if need_ratio and ratio_index is not None:
                    b = lm.buckets[ratio_index]
                    yield Ratio(b.height, b.width, b.index)
                timings.total_s = time.perf_counter() - t_start
                yield Done(timings, full_text)
                return

            if p.bucket is not None:
                bucket = p.bucket
            elif ratio_index is not None:
                bucket = lm.buckets[ratio_index]
            else:  # size auto always ends the text phase with a ratio token; this is only a safety net
                bucket = nearest_bucket(lm.buckets, 1, 1)
            yield Ratio(bucket.height, bucket.width, bucket.index)
            f = cfg.vae_downsample_factor
            h, w = bucket.height // f[0], bucket.width // f[1]
            seq = image_phase_sequence(tok, system, p.req.prompt, layouts, cot_text, h, w, bucket.index,
                                       cfg.cfg_distilled, cfg.cond_token_attn_type, history)
            prefix = 0
            if run_ar and self.kv_handoff:
                prefix = reusable_prefix(seq.ids, ar_seq.ids + text_res.tokens, text_res.fed)
            # Re-tokenizing the decoded CoT can take more ids than were sampled (e.g. bytes that are not
            # valid UTF-8 come back as U+FFFD): the denoise rows hold the longer of the two
            scratch = max(budget, step_keys(seq.gen_image))   # SP padding writes here; nothing reads it

            turn = step_key(seq.gen_image, n_img, branches)
            step_cache = make_step_cache(p.taylor_cache, p.steps, p.block_cache, cfg.num_layers)
            # a step cache, or a step that is not one plain forward over local rows, runs alone (denoise_batch.py)
            alone = (type(step_cache) is not StepCache or self.cfg_serial
                     or rt.denoise.sp.size > 1 or branch_comm.size > 1)
            rows = len(branches) * n_img
            first = yield DenoiseTurn(turn, 0, rows, scratch + 1, alone)     # these rows are its own until it ends
            cache = pool.take_denoise(rows, scratch + 1, first)
            if prefix:
                pool.hand_off(slot, cache, prefix)            # the cond prefix the AR phase wrote
            if slot is not None:
                pool.release_slot(slot)
                slot = None
            if prefix:
                gather_sibling_heads(cache, heads, prefix, rt.plan, rt.replica)
            timings.kv_reused_tokens = prefix
            ids = torch.tensor(seq.ids, device=dev)[None]
            if cfg_on:
                ids = torch.cat([ids, torch.tensor(seq.uncond_ids(sp.cfg), device=dev)[None]])
            starts = [min(prefix, seq.gen_image.meta_start) if b == 0 else 0 for b in branches]
            prefill_lora, step_lora = pool.set_denoise_adapter(first, rows, adapter, p.lora_scale)
            layout = DenoiseLayout(rt.denoise, branches, starts, scratch, branch_comm, n_img, self.cfg_serial,
                                   pool.denoise_key)
            runner = DenoiseRunner(model, seq, refs, ids, cache.heads(heads.denoise), layout,
                                   self.graphs if self.cuda_graph else None, step_cache, (prefill_lora, step_lora))
            self._keep_denoise_graph(runner.key)
            # image k's noise: seed + k (image 0 continues the stream that drew the reference posteriors)
            latent_ch = int(cfg.vae["latent_channels"])
            gens = [image_gen] + [torch.Generator(dev).manual_seed(p.seed + k) for k in range(1, n_img)]
            noise = torch.cat([torch.randn((1, latent_ch, h, w), generator=g, device=dev, dtype=torch.bfloat16)
                               for g in gens])

            self.on_phase("denoise")
            t0 = time.perf_counter()
            runner.prefill()                 # the uncached prefix of each branch, once for all its images
            synchronize(dev)
            timings.dit_prefill_ms = (time.perf_counter() - t0) * 1e3
            # wall time from the first step to the last, as this request saw it (with other requests'
            # decode steps interleaved, engine/runtime/scheduler.py), previews excepted
            t0 = time.perf_counter()
            spent = 0.0                   # seconds in previews
            sampler = FlowSampler(noise, p.steps, lm.gen.flow_shift, p.guidance, cfg_on, cfg.cfg_distilled,
                                  cfg.cfg_distilled and model.timestep_r_emb is not None)
            for i in range(p.steps):      # each step's velocity: the scheduler's denoise turn (one batched forward)
                x0 = sampler.update(i, (yield DenoiseTurn(turn, i, job=StepInput(runner, i, sampler.inputs(i)))))
                png = None
                if rt.is_leader and self.preview_every and (i + 1) % self.preview_every == 0 and i + 1 < p.steps and \
                        spent <= self.preview_share * (time.perf_counter() - t0 - spent):
                    synchronize(dev)     # steps are queued asynchronously on a GPU: charge the preview its own time only
                    tp = time.perf_counter()
                    png = self._preview(x0[:1])
                    spent += time.perf_counter() - tp
                yield Step(i + 1, p.steps, png)
            x = sampler.x
            synchronize(dev)
            timings.dit_steps = p.steps
            timings.dit_full_steps = runner.step_cache.full_steps
            timings.dit_ms_per_step = (time.perf_counter() - t0 - spent) * 1e3 / p.steps

            if not rt.is_leader:      # one rank decodes and emits the image
                return
            t0 = time.perf_counter()
            for k in range(n_img):
                img = to_pil(model.decode_image(x[k:k + 1])[0])
                if p.req.stretch and p.images:
                    img = align_to_reference(img, p.images, lm.buckets, cfg.image_base_size)
                yield Image(png_bytes(img), img.width, img.height, p.seed + k, k)
            timings.vae_ms = (time.perf_counter() - t0) * 1e3 / n_img
            timings.total_s = time.perf_counter() - t_start
            yield Done(timings, full_text)
        finally:           # ended, failed or cancelled (closed where it waited): its share of the engine goes back
            if slot is not None:
                pool.release_slot(slot)

    def _adapter_slot(self, p: Prepared) -> int:
        """The LoRA table slot of the request's adapter (0: none, or the adapter merged into the weights, which
        `prepare` checked it names); one unloaded since it was validated is refused."""
        if p.lora is None or self.lm.model.merged_lora is not None:
            return 0
        try:
            return self.lm.model.lora.slot_of(p.lora)
        except (KeyError, AttributeError):
            raise RequestError(f"the LoRA adapter {p.lora!r} is no longer loaded", "lora") from None

    def _keep_prefix(self, p: Prepared, system: str, ar_seq: Sequence, ar_key: PrefixKey,
                     history: tuple[PastTurnLayout, ...], own: list[CondImageLayout], cot_text: str | None,
                     res: TextResult, cache: KVCache) -> None:
        """Keep the AR cache's K/V up to where the next turn's layout of this one leaves the sequence that
        ran (prefix_cache.py): that layout is built here as the next turn would build it."""
        cfg, tok = self.lm.cfg, self.lm.tok
        this = PastTurnLayout(p.req.prompt, tuple(own), cot_text or "", None)
        nxt = user_turn(SequenceBuilder(tok, cfg.cond_token_attn_type), system, "", [], history + (this,)).build()
        ran = ar_seq.ids + res.tokens
        n = reusable_prefix(nxt.ids, ran, res.fed)
        blocks = ar_seq.blocks + [-1] * len(res.tokens)
        images = [(start, identity) for start, identity in ar_key.images if start < n]
        self.prefix.store(prefix_key(ran[:n], [s for s, _ in images], [i for _, i in images], blocks[:n],
                                     ar_key.adapter), cache)

    def _keep_denoise_graph(self, key: tuple) -> None:
        """Denoise step graphs stay for the engine's life, the DENOISE_GRAPHS most recently used keys: a
        key is a resolution bucket at one TAIL_GRAIN of prompt lengths (the keys the step attends to),
        with its batched keys (the key and the batch's size), and each graph holds its static buffers
        (its activations are in the engine's shared graph pool)."""
        self._denoise_keys[key] = None
        self._denoise_keys.move_to_end(key)
        while len(self._denoise_keys) > DENOISE_GRAPHS:
            old, _ = self._denoise_keys.popitem(last=False)
            self.graphs.drop(lambda k: k[:len(old)] != old)

    def _preview(self, x0: torch.Tensor) -> bytes:
        """A small PNG of the current clean-image estimate (VAE decode of a pooled latent)."""
        h, w = x0.shape[-2:]
        k = 1
        while (h // k) * (w // k) > self.preview_tokens and min(h, w) // k > 1:
            k *= 2
        z = F.avg_pool2d(x0.float(), k) if k > 1 else x0.float()
        return png_bytes(to_pil(self.lm.model.decode_image(z)[0]))
