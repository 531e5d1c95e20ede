"""Warm-up at start (`--warmup`): the CUDA graphs a default request needs, captured before the engine says
ready, so that the first users do not wait for them: the first request of a fresh engine pays its graphs'
captures (engine/runtime/graphs.py) and the kernels' first-use compiles, which the warm-up pays instead
(several times a request's own time on the H200: docs/benchmarks.md, serving).

What it captures, on this engine's storages (a graph replays on the storage it was captured on, so the
storages are first made as long as a default request makes them: engine/runtime/kv_pool.py):
- the batched decode step at every batch bucket up to the engine's AR slots (all rows idle);
- the padded prefill at every prompt-length bucket (padding only; none on the CPU, whose prefill is not
  padded);
- the denoise step of one request at each size asked for (default: the square bucket), for every
  `TAIL_GRAIN` of prompt + reasoning up to `tail_max` tokens (a step's key depends on that length only by
  grains: engine/runtime/denoise.py `step_key`): each by a real request through the engine's own
  scheduler (reasoning off, one step, the checkpoint's default guidance), longest first, so the denoise
  storage is made once, at its longest. Its events go nowhere;
- then one short reasoning request that samples (`sampled_request`): the sampler's first-use compiles.
Not captured here: denoise batches of several requests (`--max-denoise-batch` > 1), adapters' LoRA modes,
other sizes, and requests longer than the warm-up's (they capture at their first request, as without it).

Every rank runs the same warm-up (same requests, same order), so the collectives of a multi-rank plan stay
in step. Nothing of it stays in what a request sees: the caches of conversations are emptied after it,
and each request draws from its own generators.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from engine.runtime.denoise import TAIL_GRAIN, tail_index
from engine.runtime.engine import Engine
from engine.runtime.events import Error
from engine.runtime.prefill_step import GRAPH_MAX
from engine.runtime.program import DENOISE_GRAPHS
from engine.runtime.request import Request, prepare
from engine.runtime.sequence import GenImageSpan, image_phase_sequence, user_turn
from engine.checkpoint.buckets import nearest_bucket, parse_size

TAIL_MAX = 3072          # prompt + reasoning tokens warmed (a 1251-token T2I prompt + 750 CoT tokens: 2001)
FILLER = "a b c d e f g h i j k l m n o p q r s t u v w x y z"   # the warm-up prompts' words (short: few characters a token)


class WarmupError(RuntimeError):
    """A warm-up step failed; the message names what it was warming."""


@dataclass(frozen=True)
class Warmup:
    seconds: float
    graphs: int                 # graphs captured by the warm-up (0 without CUDA graphs)
    parts: tuple[str, ...]      # what it ran, in order ("decode 4", "prefill 1280", "denoise 1024x1024 2048")

    def summary(self) -> dict:
        return {"seconds": round(self.seconds, 2), "graphs": self.graphs, "parts": len(self.parts)}


def default_size(engine: Engine) -> str:
    """The square bucket, as a request's `size` ("HxW")."""
    b = nearest_bucket(engine.loaded.buckets, 1, 1)
    return f"{b.height}x{b.width}"


def warm_up(engine: Engine, sizes: tuple[str, ...] = ("default",), tail_max: int = TAIL_MAX,
            progress: Callable[[int, int, str], None] = lambda done, total, what: None) -> Warmup:
    """Run the warm-up (module doc) on `engine`, before it serves anything; `progress(done, total, what)`
    after each part. Raises WarmupError naming the part that failed (a failed capture names its key)."""
    t0 = time.perf_counter()
    graphs = engine.graphs
    captured = sum(graphs.captures.values())
    requests = denoise_requests(engine, sizes, tail_max)
    pool = engine.pool
    pool.reserve_ar(min(GRAPH_MAX + engine.loaded.gen.max_new_tokens + 8, pool.limit - 1))
    parts: list[tuple[str, Callable[[], None]]] = []
    for b in pool.decode.buckets:
        parts.append((f"decode {b}", lambda b=b: pool.decode.warm(b)))
    for b in pool.prefill.buckets():
        parts.append((f"prefill {b}", lambda b=b: pool.prefill.warm(b)))
    for what, req in requests:
        parts.append((what, lambda req=req: _run(engine, req)))
    if requests:       # a sampled reasoning request: the sampler's kernels compile here, not in a user's first request
        parts.append(("sampling", lambda: _run(engine, sampled_request(requests[-1][1].size))))
    done: list[str] = []
    for i, (what, run) in enumerate(parts):
        try:
            run()
        except Exception as e:  # noqa: BLE001 - whatever failed, the part says what was being warmed
            raise WarmupError(f"warm-up of {what} failed: {type(e).__name__}: {e}") from e
        done.append(what)
        progress(i + 1, len(parts), what)
    engine.prefix.clear()              # nothing for a next turn is kept from a warm-up request
    return Warmup(time.perf_counter() - t0, sum(graphs.captures.values()) - captured, tuple(done))


def denoise_requests(engine: Engine, sizes: tuple[str, ...], tail_max: int) -> list[tuple[str, Request]]:
    """One request per (size, tail grain up to `tail_max`), longest first: reasoning off, one step, a prompt
    whose length puts the image's tokens at that grain. Grains a request of that size cannot reach (the
    model's positions) are left out. Raises ValueError for a size the checkpoint does not take, or when
    the keys would not all stay (the engine keeps DENOISE_GRAPHS denoise step keys)."""
    lm = engine.loaded
    cfg, f = lm.cfg, lm.cfg.vae_downsample_factor
    out: list[tuple[str, Request]] = []
    for size in (default_size(engine) if s == "default" else s for s in sizes):
        bucket = parse_size(size, lm.buckets)
        if bucket is None:
            raise ValueError(f"a warm-up size names a size (HxW), not {size!r}")
        h, w = bucket.height // f[0], bucket.width // f[1]
        base = prepare(Request(prompt="a", bot_task="image", size=size, steps=1, seed=0), lm)
        system = lm.prompts.resolve(base.preset, base.bot_task, None)

        def span(prompt: str) -> GenImageSpan:
            turn = user_turn(lm.tok, system, prompt, [], (), cfg.cond_token_attn_type)
            return image_phase_sequence(turn, None, h, w, bucket.index, cfg.cfg_distilled).gen_image

        room = cfg.max_position_embeddings - h * w - 64        # the image's tokens and its markers after it
        for grain in range(min(tail_max, room) // TAIL_GRAIN * TAIL_GRAIN, 0, -TAIL_GRAIN):
            prompt = _prompt_reaching(lambda p: span(p).meta_start, grain - TAIL_GRAIN // 2)
            if prompt is None or tail_index(span(prompt)) != grain:
                continue                 # the template alone is past this grain (a short grain, a long system prompt)
            out.append((f"denoise {bucket.height}x{bucket.width} {grain}",
                        Request(prompt=prompt, bot_task="image", size=size, steps=1, seed=0)))
    if len(out) > DENOISE_GRAPHS:
        raise ValueError(f"the warm-up would capture {len(out)} denoise step keys; the engine keeps {DENOISE_GRAPHS} "
                         f"(fewer sizes, or a shorter tail)")
    return out


def sampled_request(size: str) -> Request:
    """A short think_recaption request that samples its tokens with the checkpoint's defaults (temperature,
    top-k, top-p) and picks its ratio token: the decode's sampling paths, which the denoise parts (reasoning
    off) never run: without it the first request after a warm-up pays their first-use compiles, with no
    graph captured (docs/benchmarks.md, serving). Its denoise key is the shortest grain's, already warmed."""
    return Request(prompt="a", bot_task="think_recaption", max_new_tokens=8, size=size, steps=1, seed=0)


def _prompt_reaching(start_of: Callable[[str], int], target: int) -> str | None:
    """A prompt of FILLER words whose image tokens start within a few tokens of `target` (`start_of(prompt)`:
    where they start), or None when one word is already past it."""
    words = FILLER.split()

    def text(n: int) -> str:
        return " ".join(words[i % len(words)] for i in range(n))

    at = start_of(text(1))
    if at > target:
        return None
    rate = max((start_of(text(65)) - at) / 64, 0.25)      # tokens a word, near constant
    n = 1
    for _ in range(8):               # a few corrections reach it
        n = max(1, n + round((target - at) / rate))
        at = start_of(text(n))
        if abs(at - target) <= 8:
            break
    return text(n)


def _run(engine: Engine, req: Request) -> None:
    """One warm-up request alone, to its end; its events are dropped (an error raises)."""
    # checked with a short prompt: a warm-up prompt may have more characters than a user's (MAX_PROMPT_CHARS);
    # its tokens are what it is for (a user's prompt + reasoning reach them)
    p = prepare(dataclasses.replace(req, prompt="a"), engine.loaded)
    for ev in engine.run_prepared(dataclasses.replace(p, prompt=req.prompt)):
        if isinstance(ev, Error):
            raise RuntimeError(ev.message)
