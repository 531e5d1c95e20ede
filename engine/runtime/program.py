"""The phase program of one request, readable top to bottom: encode the sequence's images -> AR phase
(CoT, ratio) -> KV hand-off -> denoise (step previews) -> VAE decode -> PNG.

The program is a generator (`program`): it runs its own forwards inline and yields its events, and
yields a need (engine/runtime/needs.py) wherever it shares the engine with other requests: an AR slot of
the KV pool, each decode step (batched with every other request's), its denoise rows (its hand-off and
image-prefix prefill then run in that turn of its own), each denoise step (batched with the denoise
batch's), and a turn of its own for its VAE decode. The scheduler
(engine/runtime/scheduler.py) answers them. Each phase is a generator of its own, joined by `yield
from`, which owns its locals and returns what the next one needs. Every rank of a plan runs the same
programs on its part of the model; rank 0's decisions (sampled tokens, which requests run) are agreed by
all, and rank 0 emits the events that matter.

The KV hand-off between the phases is engine/runtime/handoff.py and engine/runtime/kv_pool.py; the
decisions all ranks share are engine/runtime/agreement.py; what a program reads of its engine is its
`Context` (engine/runtime/engine.py makes it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import numpy as np
import torch
import torch.nn.functional as F

from engine.model.attention import KVCache
from engine.model.loader import LoadedModel
from engine.parallel.groups import RankGroups
from engine.parallel.layout import Comm
from engine.runtime.agreement import Agreement
from engine.runtime.conditioning import EncodedImage, EncodingCache, embed_range, encode_sequence_images
from engine.runtime.denoise import DenoiseLayout, DenoiseRunner, FlowSampler, StepInput, step_class, step_keys
from engine.runtime.events import Denoising, Done, Error, Event, Image, Ratio, Started, Step, Timings
from engine.runtime.graphs import Graphs
from engine.runtime.handoff import CacheHeads, gather_sibling_heads, reusable_prefix
from engine.runtime.history import reasoning_of
from engine.runtime.images import HostPixels, Resized, host_pixels, reference_size
from engine.runtime.kv_pool import ARRow, KVPool
from engine.runtime.needs import ARSlot, DenoiseRows, DenoiseStep, ImageDecode, Need
from engine.runtime.options import EngineOptions
from engine.runtime.prefix_cache import PrefixCache, PrefixKey, prefix_key
from engine.runtime.request import Prepared, RequestError
from engine.runtime.request_state import Program
from engine.runtime.sequence import (Sequence, SequenceBuilder, image_phase_sequence, next_turn_view,
                                     text_phase_sequence, user_turn)
from engine.runtime.span import Span
from engine.runtime.step_cache import StepCache, make_step_cache
from engine.runtime.text_phase import StagePlan, TextResult, generate_text
from engine.checkpoint.buckets import Bucket, nearest_bucket
from engine.checkpoint.prompts import COT_TASKS, PromptError

DENOISE_GRAPHS = 8      # denoise step keys whose graphs are kept (least recently used dropped first)


@dataclass
class Context:
    """What a request's program reads of its engine: the loaded model, this rank's groups, the engine's
    options, and the resources every request shares (KV pool and its heads, graphs, the ranks' agreement,
    the conversations' caches). `cuda_graph`: the options' CUDA graphs, where this model's steps can be
    captured; `max_image_tokens`: the largest image's tokens (the room every sequence keeps for it);
    `on_phase` is called with "ar" / "denoise" as a phase starts (tests, tracing)."""
    loaded: LoadedModel
    groups: RankGroups
    options: EngineOptions
    cuda_graph: bool
    heads: CacheHeads
    pool: KVPool
    graphs: Graphs
    agree: Agreement
    prefix: PrefixCache
    encodings: EncodingCache
    max_image_tokens: int
    on_phase: Callable[[str], None] = lambda phase: None
    kernels: str = ""             # the quantized weights' kernels where not ours (set at load: `Started.kernels`)


def program(ctx: Context, p: Prepared) -> Program:
    """The phases of the prepared request `p`: its events, and the needs the scheduler answers."""
    t_start = time.perf_counter()
    lm = ctx.loaded
    try:
        system = lm.prompts.resolve(p.preset, p.bot_task, p.custom_system_prompt)
    except (PromptError, ValueError) as e:       # the preset's text is not in this checkpoint
        yield Error("invalid", str(e), "system_prompt")
        return
    # the user turn, tokenized once: both phases' sequences continue it (engine/runtime/sequence.py), and
    # it is the request's input (the usage a client is told)
    turn = user_turn(lm.tok, system, p.prompt, [i.layout for i in p.images], tuple(t.layout for t in p.history),
                     lm.cfg.cond_token_attn_type)
    yield Started(p.request_id, p.bot_task, "auto" if p.bucket is None else str(p.bucket), p.steps, p.guidance,
                  p.seed, len(turn.seq) - turn.seq.image_tokens, turn.seq.image_tokens, ctx.kernels)
    try:
        yield from _phases(ctx, _Run.begin(ctx, p, turn, t_start))
    except RequestError as e:   # found once the prompt is tokenized, on every rank alike, before any compute
        yield Error("invalid", str(e), e.field)


@dataclass
class _Run:
    """What the phases of one request share, fixed before the first of them runs; `slot`: its AR slot of
    the KV pool while it holds one (from the text phase to the hand-off)."""
    p: Prepared
    turn: SequenceBuilder                      # its user turn (each phase's sequence continues a fork of it)
    t_start: float
    refs: list[EncodedImage]                   # every image of the sequence, encoded, in sequence order
    adapter: int                               # the LoRA table slot of its adapter (0: none)
    image_gen: torch.Generator                 # reference VAE samples, then the noise
    text_gen: torch.Generator                  # CoT sampling (its own stream)
    timings: Timings = field(default_factory=Timings)
    slot: int | None = None
    spans: dict[str, Span] = field(default_factory=dict)     # its device work's timings, read at its VAE decode
    preview_s: float = 0.0                     # the host's seconds in its previews (not the steps')

    @classmethod
    def begin(cls, ctx: Context, p: Prepared, turn: SequenceBuilder, t_start: float) -> "_Run":
        dev = ctx.loaded.model.device
        image_gen = torch.Generator(dev).manual_seed(p.seed)
        # every image of the sequence, earlier turns' first (engine/runtime/history.py), in sequence order;
        # the earlier turns' from the encoding cache (conditioning.py says why)
        past = p.sequence_images[:len(p.sequence_images) - len(p.images)]
        refs = encode_sequence_images(ctx.loaded.model, past, p.images, image_gen, ctx.encodings)
        return cls(p, turn, t_start, refs, _adapter_slot(ctx, p), image_gen, torch.Generator(dev).manual_seed(p.seed))

    @property
    def text_only(self) -> bool:
        return self.p.bot_task == "auto" or self.p.text_only


@dataclass
class _Text:
    """What the text phase leaves the image phase: the AR sequence, what it generated, the room the
    request's sequences may take (`budget`), and the reasoning and size it chose."""
    seq: Sequence
    budget: int
    ran: bool = False
    result: TextResult = field(default_factory=TextResult)
    cot_text: str | None = None
    ratio_index: int | None = None


def _phases(ctx: Context, run: _Run) -> Program:
    try:
        text = yield from _text_phase(ctx, run)
        full_text = ctx.loaded.tok.decode(text.result.tokens) if text.result.tokens else ""
        if run.text_only:
            if run.p.bucket is None and text.ratio_index is not None:
                b = ctx.loaded.buckets[text.ratio_index]
                yield Ratio(b.height, b.width, b.index)
            run.timings.total_s = time.perf_counter() - run.t_start
            yield Done(run.timings, full_text)
            return
        bucket = _bucket(ctx, run.p, text)
        yield Ratio(bucket.height, bucket.width, bucket.index)
        x = yield from _image_phase(ctx, run, text, bucket)
        yield ImageDecode(run.p.images_out)      # a turn of its own (every rank asks: they decide alike)
        if ctx.groups.is_leader:      # one rank decodes and emits the image
            yield from _images(ctx, run, x, full_text)
    finally:           # ended, failed or cancelled (closed where it waited): its share of the engine goes back
        if run.slot is not None:
            ctx.pool.release_slot(run.slot)


def _text_phase(ctx: Context, run: _Run) -> Generator["Event | Need", Any, _Text]:
    """The AR phase (where the request reasons or picks its size): the sequence, then its AR slot, the
    prefill (past a conversation's cached prefix) and the decode steps."""
    p, lm, cfg = run.p, ctx.loaded, ctx.loaded.cfg
    plan = StagePlan.for_task(p.bot_task, p.bucket is None, lm.tok.special)
    seq = text_phase_sequence(run.turn, plan.first_task, cfg.image_base_size)
    if len(seq) + 16 + ctx.max_image_tokens > cfg.max_position_embeddings:
        raise RequestError(f"the prompt and reference images take {len(seq)} tokens, too many for the "
                           f"model's {cfg.max_position_embeddings} positions",
                           "images" if p.sequence_images else "prompt")
    text = _Text(seq, min(len(seq) + p.max_new_tokens + 8 + ctx.max_image_tokens + 8, cfg.max_position_embeddings))
    if not (p.bot_task in COT_TASKS or p.bot_task == "auto" or p.bucket is None):
        return text
    ctx.on_phase("ar")
    max_new = min(p.max_new_tokens, text.budget - len(seq) - ctx.max_image_tokens - 16)
    ar_len = len(seq) + max_new + 8            # the prompt, the CoT and its forced tokens
    run.slot = yield ARSlot(ar_len)
    T = seq.tensors(lm.model.device, length=ar_len)        # positions for every position it may write
    row = ctx.pool.row(run.slot, T["pos"], T["blocks"], run.adapter, p.lora_scale)
    emb = embed_range(lm.model, seq, T["ids"][None], run.refs, 0, len(seq))
    key = prefix_key(seq.ids, [c.vae.start for c in seq.cond_images], [r.identity for r in run.refs], seq.blocks,
                     (p.lora, p.lora_scale))
    row.cached = _restore_prefix(ctx, run, key, row)
    res = yield from generate_text(lm.tok, row, emb, plan, p.sampling, run.text_gen, max_new, ctx.agree.token)
    t = run.timings
    t.ar_prompt_tokens, t.ar_cached_tokens, t.ar_prefill_ms = len(seq), row.cached, res.prefill_ms
    t.ar_tokens, t.ar_forced, t.ar_ms_per_token = res.sampled, len(res.tokens) - res.sampled, res.ms_per_token
    text.ran, text.result = True, res
    if p.bot_task in COT_TASKS:
        text.cot_text = reasoning_of(p.bot_task, lm.tok.decode(res.tokens))
    if res.ratio_token is not None:
        text.ratio_index = lm.tok.special.ratio.index(res.ratio_token)
    if ctx.prefix.enabled:
        _keep_prefix(ctx, run, text, key, row.cache)
    return text


def _restore_prefix(ctx: Context, run: _Run, key: PrefixKey, row: ARRow) -> int:
    """How many leading positions of the AR sequence come from the prefix cache (restored into the row
    here): only a turn that shows earlier turns reads the cache, so a single request runs as it always did."""
    if not (ctx.prefix.enabled and run.p.history):
        return 0
    entry, cached = ctx.prefix.lookup(key, len(key) - 1)
    world = ctx.groups.world
    if world.size > 1:
        # the ranks' caches hold the same keys by construction (prefix_cache.py); the least any rank found
        # is what every rank takes, so that a rank out of step cannot change the prefill's shapes on its own
        # (each rank's entry shares at least that many tokens)
        found = torch.tensor([cached], dtype=torch.long, device=ctx.loaded.model.device)
        cached = int(world.all_gather(found, 0).min())
    if cached:
        ctx.prefix.restore(entry, cached, row.cache)
    return cached


def _keep_prefix(ctx: Context, run: _Run, text: _Text, key: PrefixKey, cache: KVCache) -> None:
    """Keep the AR cache's K/V up to where the next turn's layout of this one leaves the sequence that
    ran (prefix_cache.py): that layout is built here as the next turn would build it."""
    res = text.result
    nxt = next_turn_view(run.turn, text.cot_text or "")
    ran = text.seq.ids + res.tokens
    n = reusable_prefix(nxt.ids, ran, res.fed)
    blocks = text.seq.blocks + [-1] * len(res.tokens)
    images = [(start, identity) for start, identity in key.images if start < n]
    ctx.prefix.store(prefix_key(ran[:n], [s for s, _ in images], [i for _, i in images], blocks[:n], key.adapter),
                     cache)


def _bucket(ctx: Context, p: Prepared, text: _Text) -> Bucket:
    """The size it makes: the request's, else the one the text phase chose."""
    if p.bucket is not None:
        return p.bucket
    if text.ratio_index is not None:
        return ctx.loaded.buckets[text.ratio_index]
    return nearest_bucket(ctx.loaded.buckets, 1, 1)  # size auto always ends with a ratio token: a safety net


def _image_phase(ctx: Context, run: _Run, text: _Text, bucket: Bucket) -> Generator["Event | Need", Any,
                                                                                    torch.Tensor]:
    """The image-stage sequence, its denoise rows (joining the denoise batch), the hand-off from the AR
    slot, then the steps -> the final latents [n, C, h, w]."""
    p, lm, cfg = run.p, ctx.loaded, ctx.loaded.cfg
    f = cfg.vae_downsample_factor
    seq = image_phase_sequence(run.turn, text.cot_text, bucket.height // f[0], bucket.width // f[1], bucket.index,
                               cfg.cfg_distilled)
    prefix = 0
    if text.ran and ctx.options.kv_handoff:
        prefix = reusable_prefix(seq.ids, text.seq.ids + text.result.tokens, text.result.fed)
    # Re-tokenizing the decoded CoT can take more ids than were sampled (e.g. bytes that are not valid UTF-8
    # come back as U+FFFD): the denoise rows hold the longer of the two
    scratch = max(text.budget, step_keys(seq.gen_image))   # SP padding writes here; nothing reads it
    cfg_on = not cfg.cfg_distilled and p.guidance > 1.0
    branches, branch_comm = _branches(ctx, cfg_on)
    key = step_class(seq.gen_image, p.images_out, branches)
    step_cache = make_step_cache(p.taylor_cache, p.steps, p.block_cache, cfg.num_layers)
    # a step cache, or a step that is not one plain forward over local rows, runs alone (denoise_batch.py)
    alone = (type(step_cache) is not StepCache or ctx.options.cfg_serial
             or ctx.groups.denoise.sp.size > 1 or branch_comm.size > 1)
    rows = len(branches) * p.images_out
    asked = time.perf_counter()
    first = yield DenoiseRows(key, rows, scratch + 1, alone)     # these rows are its own until it ends
    yield Denoising(p.steps, (time.perf_counter() - asked) * 1e3)     # the wait for the images ahead
    cache = ctx.pool.take_denoise(rows, scratch + 1, first)       # (the storage may grow: its key is known now)
    starts = [min(prefix, seq.gen_image.meta_start) if b == 0 else 0 for b in branches]
    layout = DenoiseLayout(ctx.groups.denoise, branches, starts, scratch, branch_comm, p.images_out,
                           ctx.options.cfg_serial, ctx.pool.denoise_key)
    runner = _hand_off(ctx, run, seq, cache, first, layout, prefix, cfg_on, step_cache)
    ctx.graphs.keep_recent(runner.key, DENOISE_GRAPHS)
    return (yield from _steps(ctx, run, runner, key, cfg_on, (bucket.height // f[0], bucket.width // f[1])))


def _branches(ctx: Context, cfg_on: bool) -> tuple[list[int], Comm]:
    """The CFG branches this rank computes (0 cond, 1 uncond) and the group that gathers the others."""
    if not cfg_on:
        return [0], Comm()
    if ctx.groups.plan.replica_mode == "cfg":
        return [ctx.groups.replica.rank], ctx.groups.replica
    return [0, 1], Comm()


def _hand_off(ctx: Context, run: _Run, seq: Sequence, cache: KVCache, first: int, layout: DenoiseLayout,
              prefix: int, cfg_on: bool, step_cache: StepCache) -> DenoiseRunner:
    """The request's denoise rows (`cache`, from row `first`): the cond prefix its AR slot holds copied in
    (the slot then goes back), and its runner."""
    pool, heads, dev = ctx.pool, ctx.heads, ctx.loaded.model.device
    rows = len(layout.branches) * layout.images
    if prefix:
        pool.hand_off(run.slot, cache, prefix)            # the cond prefix the AR phase wrote
    if run.slot is not None:
        pool.release_slot(run.slot)
        run.slot = None
    if prefix:
        gather_sibling_heads(cache, heads, prefix, ctx.groups.plan, ctx.groups.replica)
    for ref in run.refs:      # made on the AR lane, read by the image phase on this one (runtime/lanes.py): their
        for t in (ref.vae_tokens, ref.vit_tokens):     # blocks are not reused before this lane's work on them
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
    run.timings.kv_reused_tokens = prefix
    ids = torch.tensor(seq.ids, device=dev)[None]
    if cfg_on:
        ids = torch.cat([ids, torch.tensor(seq.uncond_ids(ctx.loaded.tok.special.cfg), device=dev)[None]])
    lora = pool.set_denoise_adapter(first, rows, run.adapter, run.p.lora_scale)
    return DenoiseRunner(ctx.loaded.model, seq, run.refs, ids, cache.heads(heads.denoise), layout,
                         ctx.graphs if ctx.cuda_graph else None, step_cache, lora)


def _steps(ctx: Context, run: _Run, runner: DenoiseRunner, key: tuple, cfg_on: bool,
           hw: tuple[int, int]) -> Generator["Event | Need", Any, torch.Tensor]:
    """The prefix's prefill, then each step's velocity as the scheduler's denoise turn (one batched forward)
    with a preview now and then -> the final latents."""
    p, model, cfg, dev, timings = run.p, ctx.loaded.model, ctx.loaded.cfg, ctx.loaded.model.device, run.timings
    # image k's noise: seed + k (image 0 continues the stream that drew the reference posteriors)
    gens = [run.image_gen] + [torch.Generator(dev).manual_seed(p.seed + k) for k in range(1, p.images_out)]
    noise = torch.cat([torch.randn((1, int(cfg.vae["latent_channels"]), *hw), generator=g, device=dev,
                                   dtype=torch.bfloat16) for g in gens])
    ctx.on_phase("denoise")
    run.spans["prefill"] = Span(dev)       # (no host sync: engine/runtime/span.py; read in `_images`)
    runner.prefill()                 # the uncached prefix of each branch, once for all its images
    run.spans["prefill"].stop()
    # the time from the first step to the last, as this request saw it (with other requests' decode steps
    # interleaved, engine/runtime/scheduler.py), previews' host time excepted (on a GPU a preview is queued
    # behind its step with no host sync, so the host goes on launching work meanwhile, e.g. the overlap
    # policy's decode steps; its VAE decode, a few ms at 256 tokens, then counts in the steps' time)
    run.spans["steps"] = Span(dev)
    t0 = time.perf_counter()
    spent = 0.0                   # seconds in previews
    sampler = FlowSampler(noise, p.steps, ctx.loaded.gen.flow_shift, p.guidance, cfg_on, cfg.cfg_distilled,
                          cfg.cfg_distilled and model.timestep_r_emb is not None)
    every, share = ctx.options.preview_every, ctx.options.preview_share
    f = cfg.vae_downsample_factor
    aligned = _aligned(ctx, p, (hw[1] * f[1], hw[0] * f[0]))     # the final image's size, if stretched
    for i in range(p.steps):
        x0 = sampler.update(i, (yield DenoiseStep(key, i, StepInput(runner, i, sampler.inputs(i)))))
        png = None
        if ctx.groups.is_leader and every and (i + 1) % every == 0 and i + 1 < p.steps and \
                spent <= share * (time.perf_counter() - t0 - spent):
            tp = time.perf_counter()
            png = _preview(ctx, x0[:1], aligned)
            spent += time.perf_counter() - tp
        yield Step(i + 1, p.steps, png)
    run.spans["steps"].stop()
    run.preview_s = spent
    timings.dit_steps, timings.dit_full_steps = p.steps, runner.step_cache.full_steps
    return sampler.x


def _images(ctx: Context, run: _Run, x: torch.Tensor, full_text: str) -> Generator[Event, Any, None]:
    """The VAE decode of each image, then Done. Nothing here waits for the device: each image leaves as
    pixels on their way to the host (images.HostPixels; resized to the reference's aspect where the request
    asks, when read) and Done's device timings settle when read (events.Done.later), so the engine's loop
    goes on launching other requests' steps while this request's last step and VAE decode run (on a GPU;
    on the CPU they have run already)."""
    p, lm = run.p, ctx.loaded
    vae = Span(lm.model.device)
    pixels: Any = None
    for k in range(p.images_out):
        out = lm.model.decode_image(x[k:k + 1])[0]
        if k == 0:
            vae.stop()
        pixels = host_pixels(out)
        size = (out.shape[-1], out.shape[-2])
        aligned = _aligned(ctx, p, size)
        if aligned is not None:
            pixels, size = Resized(pixels, aligned), aligned
        yield Image(pixels, size[0], size[1], p.seed + k, k)          # its PNG encoded where asked

    def settle(timings: Timings) -> None:      # where Done's timings are read: the work is done by then
        np.asarray(pixels)                      # the last image on the host (every span before it is done)
        timings.vae_ms = vae.ms()
        timings.dit_prefill_ms = run.spans["prefill"].ms()
        timings.dit_ms_per_step = (run.spans["steps"].ms() - run.preview_s * 1e3) / p.steps
        ready = getattr(pixels, "ready_at", None) or time.perf_counter()
        timings.total_s = ready - run.t_start

    done = Done(run.timings, full_text)
    if lm.model.device.type == "cuda":
        yield done.later(settle)
    else:
        settle(done.timings)
        yield done


def _adapter_slot(ctx: Context, p: Prepared) -> int:
    """The LoRA table slot of the request's adapter (0: none, or the adapter merged into the weights, which
    `prepare` checked it names); one unloaded since it was validated is refused."""
    model = ctx.loaded.model
    if p.lora is None or model.merged_lora is not None:
        return 0
    try:
        return model.lora.slot_of(p.lora)
    except (KeyError, AttributeError):
        raise RequestError(f"the LoRA adapter {p.lora!r} is no longer loaded", "lora") from None


def _aligned(ctx: Context, p: Prepared, size: tuple[int, int]) -> tuple[int, int] | None:
    """The (width, height) an output of `size` is resized to when the request takes its first reference's
    aspect (`stretch`, the official infer_align_image_size; images.reference_size); None: it keeps `size`."""
    if not (p.stretch and p.images):
        return None
    lm = ctx.loaded
    return reference_size(size, [i.size for i in p.images], lm.buckets, lm.cfg.image_base_size)


def _preview(ctx: Context, x0: torch.Tensor,
             aligned: tuple[int, int] | None = None) -> np.ndarray | HostPixels | Resized:
    """A small PNG of the current clean-image estimate (VAE decode of a pooled latent) at the final image's
    aspect (`aligned`: its size where it takes its reference's; else its bucket's), resized where read like
    the final image when the pooled one's differs, so the picture keeps its shape from the first preview on."""
    model = ctx.loaded.model
    tokens = ctx.options.preview_tokens or (256 if model.device.type == "cuda" else 64)
    h, w = x0.shape[-2:]
    k = 1
    while (h // k) * (w // k) > tokens and min(h, w) // k > 1:
        k *= 2
    z = F.avg_pool2d(x0.float(), k) if k > 1 else x0.float()
    # no host sync here: its pixels are read and its PNG encoded where asked (events.Step; the worker's sender)
    out = model.decode_image(z)[0]
    f = ctx.loaded.cfg.vae_downsample_factor
    final = aligned or (w * f[1], h * f[0])   # (width, height)
    ph, pw = out.shape[-2:]                   # its height kept, its width from the final image's aspect (the
    width = max(1, round(ph * final[0] / final[1]))        # pooling's floor may have moved it: 19x13 -> 9x6)
    return host_pixels(out) if width == pw else Resized(host_pixels(out), (width, ph))
