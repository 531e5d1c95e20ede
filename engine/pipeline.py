"""One request in, a stream of events out: validate -> encode references -> AR phase (CoT, ratio)
-> KV hand-off -> denoise (step previews) -> VAE decode -> PNG.

The AR phase writes row 0 of the request's KV cache, which is also the cond branch of the denoise
phase: the image-stage sequence shares the AR prefix token for token (same user turn, same CoT ids
as long as re-tokenizing the decoded CoT gives the sampled ids), so the cond branch starts its first
step at the first token that differs instead of at 0. The uncond branch (CFG) is prefilled.
"""
from __future__ import annotations

import random
import sys
import time
import traceback
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .attention import KVCache
from .buckets import nearest_bucket
from .conditioning import EncodedImage, embed_range, encode_references
from .denoise import denoise
from .events import Done, Error, Event, Image, Ratio, Started, Step, Text, Timings
from .images import align_to_reference, png_bytes, to_pil
from .loader import LoadedModel
from .parallel import PhaseView
from .prompts import PromptError
from .request import Prepared, Request, RequestError, prepare
from .sampling import SamplingParams
from .sequence import Sequence, image_phase_sequence, text_phase_sequence
from .text_phase import StagePlan, TextResult, generate_text

COT_TASKS = ("think", "recaption", "think_recaption")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Pipeline:
    def __init__(self, lm: LoadedModel, ar_view: PhaseView | None = None, denoise_view: PhaseView | None = None,
                 preview_every: int = 1, preview_tokens: int = 256, kv_handoff: bool = True):
        self.lm = lm
        self.ar_view = ar_view or PhaseView()
        self.denoise_view = denoise_view or PhaseView()
        self.preview_every = preview_every
        self.preview_tokens = preview_tokens        # previews decode a latent of at most this many tokens
        self.kv_handoff = kv_handoff
        f = lm.cfg.vae_downsample_factor
        self.max_image_tokens = max((b.height // f[0]) * (b.width // f[1]) for b in lm.buckets)

    # ------------------------------------------------------------------ public
    def run(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Event]:
        t_start = time.perf_counter()
        try:
            p = prepare(req, self.lm.gen, self.lm.buckets, seed=random.randrange(2 ** 31))
            system = self.lm.prompts.resolve(p.preset, p.bot_task, req.custom_system_prompt)
            SamplingParams(**self._sampling_kw(p)).validate()
        except (RequestError, PromptError, ValueError) as e:
            yield Error("invalid", str(e))
            return
        yield Started(req.request_id, p.bot_task, "auto" if p.bucket is None else str(p.bucket), p.steps, p.guidance)
        try:
            with torch.no_grad():
                yield from self._run(p, system, cancelled, t_start)
        except Exception as e:  # a failure while running: reported, never raised into the UI
            traceback.print_exc(file=sys.stderr)
            yield Error("engine", f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ phases
    def _sampling_kw(self, p: Prepared) -> dict:
        g, r = self.lm.gen, p.req
        return dict(temperature=r.temperature if r.temperature is not None else g.temperature,
                    top_k=r.top_k if r.top_k is not None else g.top_k,
                    top_p=r.top_p if r.top_p is not None else g.top_p,
                    greedy=r.greedy or not g.do_sample)

    def _run(self, p: Prepared, system: str, cancelled: Callable[[], bool], t_start: float) -> Iterator[Event]:
        lm, model, tok = self.lm, self.lm.model, self.lm.tok
        cfg, sp, dev = lm.cfg, tok.special, model.device
        timings = Timings()
        image_gen = torch.Generator(dev).manual_seed(p.seed)     # reference VAE samples, then the noise
        text_gen = torch.Generator(dev).manual_seed(p.seed)      # CoT sampling (its own stream)
        refs = encode_references(model, p.images, lm.buckets, image_gen, p.req.stretch)
        layouts = [r.layout for r in refs]
        need_ratio = p.bucket is None
        run_ar = p.bot_task in COT_TASKS or p.bot_task == "auto" or need_ratio
        cfg_on = not cfg.cfg_distilled and p.guidance > 1.0 and not p.req.text_only and p.bot_task != "auto"
        rows = 2 if cfg_on else 1
        plan = StagePlan.for_task(p.bot_task, need_ratio, sp)
        ar_seq = text_phase_sequence(tok, system, p.req.prompt, layouts, plan.first_task, cfg.image_base_size,
                                     cfg.cond_token_attn_type)
        budget = len(ar_seq) + p.max_new_tokens + 8 + self.max_image_tokens + 8
        if budget > cfg.max_position_embeddings:
            budget = max(cfg.max_position_embeddings, len(ar_seq) + 8 + self.max_image_tokens)
        attn = model.transformer.layers[0].self_attn
        cache = KVCache.allocate(cfg.num_layers, rows, attn.kv_per_micro * self.ar_view.micro_count, budget,
                                 cfg.head_dim, model.dtype, dev)

        cot_text, ratio_index, text_res = None, None, TextResult()
        if run_ar:
            if len(ar_seq) + 8 > cfg.max_position_embeddings:
                raise RequestError(f"the prompt and reference images take {len(ar_seq)} tokens, more than the "
                                   f"model's {cfg.max_position_embeddings}")
            max_new = min(p.max_new_tokens, budget - len(ar_seq) - self.max_image_tokens - 16)
            T = ar_seq.tensors(dev, length=budget)
            emb = embed_range(model, ar_seq, T["ids"][None], refs, 0, len(ar_seq))
            for ev in generate_text(model, tok, emb, T["pos"], T["blocks"], cache.rows(slice(0, 1)), plan,
                                    SamplingParams(**self._sampling_kw(p)), text_gen, max_new, self.ar_view,
                                    cancelled):
                if isinstance(ev, TextResult):
                    text_res = ev
                else:
                    yield ev
            timings.ar_prefill_ms = text_res.prefill_ms
            timings.ar_tokens = len(text_res.tokens)
            timings.ar_ms_per_token = text_res.ms_per_token
            if text_res.cancelled:
                yield Error("cancelled", "stopped by the user")
                return
            if p.bot_task in COT_TASKS:
                cot_text = self._cot_text(text_res.tokens, p.bot_task)
            if text_res.ratio_token is not None:
                ratio_index = sp.ratio.index(text_res.ratio_token)
        full_text = tok.decode(text_res.tokens) if text_res.tokens else ""
        if p.bot_task == "auto" or p.req.text_only:
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
                                   cfg.cfg_distilled, cfg.cond_token_attn_type)
        if seq.gen_image.stop > cache.max_len:
            raise RequestError(f"the image sequence ({len(seq)} tokens) exceeds the model's budget")
        prefix = 0
        if run_ar and self.kv_handoff:
            prefix = common_prefix(seq.ids, ar_seq.ids + text_res.tokens)
            prefix = min(prefix, text_res.fed)
        timings.kv_reused_tokens = prefix
        latent_ch = int(cfg.vae["latent_channels"])
        noise = torch.randn((1, latent_ch, h, w), generator=image_gen, device=dev, dtype=torch.bfloat16)

        t0 = time.perf_counter()
        x = None
        for i, x, x0 in denoise(model, seq.gen_image, noise, p.steps, lm.gen.flow_shift, p.guidance, cfg_on,
                                cfg.cfg_distilled, *self._steppers(seq, refs, cache, prefix, cfg_on), cancelled):
            preview = self._preview(x0) if self.preview_every and (i + 1) % self.preview_every == 0 else None
            yield Step(i + 1, p.steps, preview)
        if cancelled() or x is None:
            yield Error("cancelled", "stopped by the user")
            return
        timings.dit_steps = p.steps
        timings.dit_ms_per_step = (time.perf_counter() - t0) * 1e3 / p.steps

        t0 = time.perf_counter()
        img = to_pil(model.vae.decode_latent(x.float())[0])
        timings.vae_ms = (time.perf_counter() - t0) * 1e3
        if p.req.stretch and p.images:
            img = align_to_reference(img, p.images, lm.buckets, cfg.image_base_size)
        yield Image(png_bytes(img), img.width, img.height, p.seed)
        timings.total_s = time.perf_counter() - t_start
        yield Done(timings, full_text)

    def _cot_text(self, tokens: list[int], bot_task: str) -> str:
        sp = self.lm.tok.special
        end = sp.end_recaption if "recaption" in bot_task else sp.end_think
        cut = tokens.index(end) + 1 if end in tokens else len(tokens)
        opener = "<think>" if bot_task.startswith("think") else "<recaption>"
        return opener + self.lm.tok.decode(tokens[:cut])

    def _steppers(self, seq: Sequence, refs: list[EncodedImage], cache: KVCache, prefix: int, cfg_on: bool):
        """The first-step and later-step backbone calls for `denoise` (see its docstring)."""
        model, view, span = self.lm.model, self.denoise_view, seq.gen_image
        T = seq.tensors(model.device)
        ids = T["ids"][None]
        if cfg_on:
            ids = torch.cat([ids, torch.tensor(seq.uncond_ids(self.lm.tok.special.cfg), device=ids.device)[None]])
        stop, meta, hw = span.stop, span.meta_start, span.h * span.w
        pos, blocks = T["pos"], T["blocks"]
        dev = model.device

        def run(x: torch.Tensor, start: int, rows: slice) -> torch.Tensor:
            index = torch.arange(start, stop, device=dev)
            return model.backbone(x, index, pos, blocks, cache.rows(rows), stop, view)[:, -hw:]

        def first(tail: torch.Tensor) -> torch.Tensor:
            if cfg_on and prefix > 0:   # cond continues the AR cache; uncond is prefilled from 0
                xc = torch.cat([embed_range(model, seq, ids[0:1], refs, prefix, meta), tail[0:1]], dim=1)
                xu = torch.cat([embed_range(model, seq, ids[1:2], refs, 0, meta), tail[1:2]], dim=1)
                return torch.cat([run(xc, prefix, slice(0, 1)), run(xu, 0, slice(1, 2))])
            x = torch.cat([embed_range(model, seq, ids, refs, prefix, meta), tail], dim=1)
            return run(x, prefix, slice(None))

        def later(tail: torch.Tensor) -> torch.Tensor:
            return run(tail, meta, slice(None))

        return first, later

    def _preview(self, x0: torch.Tensor) -> bytes:
        """A small PNG of the current clean-image estimate (VAE decode of a pooled latent)."""
        h, w = x0.shape[-2:]
        k = 1
        while (h // k) * (w // k) > self.preview_tokens and min(h, w) // k > 1:
            k *= 2
        z = F.avg_pool2d(x0.float(), k) if k > 1 else x0.float()
        return png_bytes(to_pil(self.lm.model.vae.decode_latent(z)[0]))
