"""Serving (issue 31, item 7): whole T2I requests through the engine's scheduler, as the server runs them,
at the real shapes with random weights on one GPU, with 1, 4 and 16 concurrent clients:

    python -m bench serving [--builds mxfp4-distil,hybrid4] [--clients 1,4,16] [--per-client 2]
                            [--cot 750] [--max-batch 8] [--max-denoise-batch 1,2,4] [--profile] [--greedy]
                            [--rates sweep|R1,R2,...] [--arrival-process poisson|constant] [--requests 16]
                            [--policy interleave:8,waves,overlap:8] [--arrivals closed,poisson]
                            [--warmup] [--dry]

Builds: `mxfp4-distil` (7a) is the MXFP4-mixed Instruct-Distil as one-gpu builds it, tp1, 8 steps, no CFG;
`hybrid4` (7b) is rank 0 of hybrid4 (AR TP4, denoise TP2 x SP2) in bf16, the BF16 Instruct, 50 steps,
CFG batched, its collectives `FakeComm` (compute only). Every request is a think_recaption T2I at
1024x1024 with a --cot token budget (random weights rarely close the CoT, so it runs to the budget) and
a prompt that makes the real prefill length (1251 tokens with the system prompt); the tokenizer,
system prompts and generation config are the tiny checkpoint's (tools/tiny.py), the shapes the real ones.

The driver is the worker's loop without its processes: the same `Scheduler` and `StepNews`, requests
prepared once where they enter and handed to the engine while fewer than --max-batch run (the server's
dispatch), the rest waiting in line. Two arrival patterns per client count N:
  closed   N clients at once, each sending its next request when its last one ends (--per-client each)
  poisson  N x --per-client requests arriving at exponential gaps, at 0.9x the images/s the closed run
           with N clients reached (a load the engine can hold), at most N in the engine or waiting
Latency is arrival to the last event read (the image's pixels on the host, read off the loop as the
worker's sender reads them: `Reader`); images/min counts finished images over the run's wall
time. --arrivals picks which of the two run; --clients "" runs neither (e.g. only the open loop).

Open loop (--rates, as vLLM's serving benchmark): --requests requests arriving at a fixed rate (requests/min;
Poisson gaps or constant ones, --arrival-process, seeded) whatever is in flight, the engine taking them while
fewer than --max-batch run. First one request alone (its latency L, no graph captured); then each rate's run,
and whether the engine held it: every request gave its image and p90 <= 2 L. `--rates sweep` tries
SWEEP x 60 / L requests/min (60 / L: what one request at a time serves), lowest first, stopping at the
first it does not hold; the highest held is the figure.

--policy: the scheduler's step policies (engine/runtime/scheduler.py: interleave[:K], waves, overlap[:K]),
the runs repeated for each on the same engine (default '': `Engine.new_scheduler()` as the server makes it,
which is also all an older engine has: this file copied into an older tree A/Bs its scheduler, as
docs/benchmarks.md's serving runs do); `tokens/s` is the decode rate the reasoning requests saw
(their sampled tokens over their decode phase's wall time, while others denoised beside them: the mean
and the slowest request's, then the slowest among CoTs of LONG_COT tokens or more: a few tokens that met one
stall read as a slow stream).

--max-denoise-batch: the runs are repeated for each value (one engine each over the same weights):
up to that many requests of one bucket share each denoise forward (engine/runtime/denoise_batch.py);
`requests/forward` is how many they were on average, `same-class company` how many other requests of the
same denoise step class (bucket and rows, engine/runtime/denoise.py `step_class`) waited outside the batch
at each denoise forward (the room a larger one would have).
A first request (not timed; as many at once as the denoise batch takes) captures the graphs of the
common keys (with --warmup the engine's warm-up runs before it, and the first request's captures say what
it missed); `captures` counts the graphs
captured during the timed runs (denoise step keys are per bucket, rows and TAIL_GRAIN of prompt + CoT
length; a batch of n requests is its own key, at its members' largest tail; --greedy gives every request
the same CoT).
--dry: the tiny config on the CPU (fp32), 1 then 2 clients, 2 steps, 4 CoT tokens, Poisson arrivals 10x faster
(no idle waits): the driver and the checks only (--rates as given: on the CPU, figures of the CPU).
"""
from __future__ import annotations

import argparse
import collections
import gc
import json
import queue
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from engine.model.kernel_layouts import fold_mxfp8_weights, lay_out_experts
from engine.model.loader import LoadedModel
from engine.parallel.fake import FakeComm
from engine.parallel.groups import RankGroups
from engine.parallel.layout import PhaseView
from engine.parallel.plan import get_plan
from engine.runtime.events import Done, Error, Image
from engine.runtime.engine import Engine
from engine.runtime.options import EngineOptions
from engine.runtime.request import Request, prepare
from engine.runtime.scheduler import DECODE_STEPS_PER_DENOISE, StepNews
from engine.runtime.warmup import warm_up
from engine.runtime.sequence import text_phase_sequence, user_turn
from engine.checkpoint.buckets import build_buckets
from engine.checkpoint.config import CheckpointConfig
from engine.checkpoint.prompts import SystemPrompts
from engine.checkpoint.tokenizer import Tokenizer

from .. import rank
from ..report import Col, Output
from .one_gpu import resident_formats

DRY = True
# build: (plan, Distil?, expert format or None (bf16), dense-linear format, denoise steps)
SERVED = {
    "mxfp4-distil": ("tp1", True, "mxfp4", "mxfp8", 8),
    "hybrid4": ("hybrid4", False, None, None, 50),
}
PREFILL = 1251              # the real T2I prefill (system prompt + prompt), tokens
LONG_COT = 64              # sampled tokens from which a request's decode rate is read as a stream's (`Reader`)
SWEEP = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # open-loop rates tried by `--rates sweep`, x what one at a time serves


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--builds", default="mxfp4-distil,hybrid4", help=f"of {', '.join(SERVED)}")
    ap.add_argument("--clients", default="1,4,16", help="concurrent client counts")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends")
    ap.add_argument("--cot", type=int, default=750, help="CoT token budget of every request")
    ap.add_argument("--max-batch", type=int, default=8, help="requests the engine runs at once (--max-batch)")
    ap.add_argument("--max-denoise-batch", default="1",
                    help="requests of one bucket per denoise forward (--max-denoise-batch); a list runs each")
    ap.add_argument("--profile", action="store_true",
                    help="a device sync after every engine step, its wall time summed by what the step held "
                         "(AR slots granted, decode rows, denoise rows): where a run's time goes")
    ap.add_argument("--warmup", action="store_true",
                    help="warm the engine up first (--warmup: engine/runtime/warmup.py, at the requests' size): its "
                         "time and graphs, then the first request's latency and captures")
    ap.add_argument("--greedy", action="store_true", help="greedy CoT: every request the same token layout")
    ap.add_argument("--rates", default="",
                    help="open-loop arrival rates, requests/min (comma-separated), or 'sweep' (module doc); '': none")
    ap.add_argument("--arrival-process", default="poisson", choices=("poisson", "constant"),
                    help="open-loop gaps: exponential (seeded) or constant")
    ap.add_argument("--requests", type=int, default=16, help="requests in each open-loop run")
    ap.add_argument("--policy", default="",
                    help="step policies, each run in turn: interleave[:K], waves, overlap[:K] (K: decode steps per "
                         f"turn of heavy work, default {DECODE_STEPS_PER_DENOISE}); '': the engine's default scheduler")
    ap.add_argument("--previews", type=int, default=0,
                    help="a step preview every this many denoise steps, as the server makes them (--preview-every; "
                         "default 0: none)")
    ap.add_argument("--lookahead", default="",
                    help="decode lookahead, each run in turn with every policy: on, off ('': the engine's default, "
                         "on on a GPU)")
    ap.add_argument("--arrivals", default="closed,poisson",
                    help="the runs at each client count: closed and/or poisson (module doc)")
    ap.add_argument("--moe-kernels", default="triton",
                    help="the quantized experts' kernels (engine/model/kernel_layouts.py: triton, humming, humming-fp8)")
    ap.add_argument("--mxfp8-kernels", default="triton",
                    help="the MXFP8 weights' kernels (engine/model/kernel_layouts.py: triton, fp8, auto: fp8 with "
                         "humming-fp8; default triton, as the server's)")


# ---------------------------------------------------------------------------------------- the engine
def checkpoint_folder(folder: Path, dry: bool, distil: bool) -> Path:
    """A checkpoint folder without weights: the real config (or the tiny one), the tiny tokenizer,
    system prompts and generation config; the token ids the config names are the tokenizer's."""
    from tools.tiny import SYSTEM_PROMPT_PY, build_tokenizer, generation_config, tiny_config
    tok = build_tokenizer(0)
    tok.save(str(folder / "tokenizer.json"))
    vocab = -(-tok.get_vocab_size() // 64) * 64
    cfg = tiny_config(vocab, distil) if dry else json.loads(rank.CONFIG.read_text())
    if distil:
        cfg |= {"cfg_distilled": True, "use_meanflow": True}
    ids = {k: tok.token_to_id(t) for k, t in (("bos_token_id", "<|startoftext|>"), ("eos_token_id", "<|endoftext|>"),
                                              ("pad_token_id", "<pad>"), ("image_token_id", "<img>"))}
    (folder / "config.json").write_text(json.dumps(cfg | ids))
    gen = generation_config(distil) | {"eos_token_id": [ids["eos_token_id"]], "pad_token_id": ids["pad_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    (folder / "system_prompt.py").write_text(SYSTEM_PROMPT_PY)
    return folder


def engine(build: str, folder: Path, dev: str) -> tuple[LoadedModel, RankGroups]:
    """The build's rank-0 model with random weights and that rank's groups (FakeComm), for its engines."""
    plan_name, distil, experts, dense, _ = SERVED[build]
    cc = CheckpointConfig.load(folder)
    buckets = build_buckets(cc.model.image_base_size)
    plan = get_plan(plan_name)
    resident = resident_formats(cc.model, experts, dense) if experts and dev == "cuda" else None
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = rank.build(cc.model, plan, dtype, dev, resident)
    lm = LoadedModel(folder, cc.model, cc.generation, Tokenizer(folder / "tokenizer.json", cc.model.image_base_size,
                                                                 len(buckets)),
                     SystemPrompts.load(folder), buckets, model, 0.0, 0)
    groups = RankGroups(plan, 0, torch.device(dev), FakeComm(plan.world), rank.ar_view(plan),
                        PhaseView(0, plan.micros, FakeComm(plan.storage_tp), FakeComm(plan.sp), plan.sp_kind),
                        FakeComm(plan.world // plan.storage_tp))
    return lm, groups


def prefill_tokens(lm: LoadedModel, req: Request) -> int:
    """The AR prefill length of `req` (its system prompt, template and prompt)."""
    p = prepare(req, lm)
    system = lm.prompts.resolve(p.preset, p.bot_task, p.custom_system_prompt)
    turn = user_turn(lm.tok, system, p.prompt, [], (), lm.cfg.cond_token_attn_type)
    return len(text_phase_sequence(turn, "think", lm.cfg.image_base_size))


def prompt_of(lm: LoadedModel, tokens: int) -> str:
    """A prompt that, with the system prompt, takes about `tokens` tokens."""
    system = prefill_tokens(lm, Request(prompt="x", bot_task="think_recaption", seed=0))
    words, text = "a red fox in the snow under a pale moon, ".split(" "), []
    while len(lm.tok.encode(" ".join(text))) < max(tokens - system, 8):
        text.extend(words)
    return " ".join(text).strip()


# ---------------------------------------------------------------------------------------- the driver
def step_kind(last: dict[str, int]) -> str:
    """What an engine step held, as the profile groups steps: 'slots 1 + decode 8 + denoise 1' (or its turn of
    own work: 'handoff 1', 'vae 1')."""
    parts = [f"{name} {last[key]}" for name, key in (("slots", "slots"), ("decode", "decode_rows"),
                                                     ("denoise", "denoise_rows"), ("handoff", "handoffs"),
                                                     ("vae", "image_decodes")) if last.get(key)]
    return " + ".join(parts) or "idle"


def arrival_times(n: int, rate: float, process: str, seed: int) -> list[float]:
    """`n` arrival times (seconds from the start) at `rate` requests/s: exponential gaps (Poisson, seeded)
    or constant ones."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if process == "poisson" else 1 / rate
    return out


class Reader:
    """The worker's sender thread as far as the figures go (engine/serve/worker.py `Sender`): each step's events
    read in order, off the loop, an image's pixels waited for (on a GPU they leave the engine's loop on their
    way to the host) and a Done's timings read; a request has ended for its client when its last event has
    been read (`ended`: (seq, seconds from the start)). An older tree's events (PNGs, plain timings) read the
    same way."""

    def __init__(self, t0: float):
        self.t0, self.images, self.errors, self.token_rates = t0, 0, [], []
        self.cot_tokens: list[int] = []                 # tokens each request sampled
        self.ended: queue.SimpleQueue = queue.SimpleQueue()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._read, name="bench-reader", daemon=True)
        self._thread.start()

    def put(self, done: list, ended: list) -> None:
        self._q.put((done, ended))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _read(self) -> None:
        while (item := self._q.get()) is not None:
            done, ended = item
            for seq, ev in done:
                if isinstance(ev, Image):
                    data = getattr(ev, "data", None)
                    if data is not None and not isinstance(data, bytes):
                        np.asarray(data)                  # its pixels on the host
                    self.images += 1
                elif isinstance(ev, Error):
                    self.errors.append(f"request {seq}: {ev.kind}: {ev.message}")
                elif isinstance(ev, Done):
                    self.cot_tokens.append(ev.timings.ar_tokens)
                    if ev.timings.ar_ms_per_token > 0:
                        self.token_rates.append((1000 / ev.timings.ar_ms_per_token, ev.timings.ar_tokens))
            end = time.perf_counter() - self.t0
            for seq in ended:
                self.ended.put((seq, end))


def _ends(reader: Reader, latency: dict, arrived: dict, arrivals: list | None, total: int) -> None:
    """The requests the reader has seen end: their latency, and (`arrivals`: a closed loop's, until it holds
    `total`) each one's client's next request, now."""
    while True:
        try:
            seq, end = reader.ended.get_nowait()
        except queue.Empty:
            return
        latency.setdefault(seq, end - arrived[seq])
        if arrivals is not None and len(arrivals) < total:
            arrivals.append(end)


def serve(pipe: Engine, make: Callable[[int], Request], clients: int, per_client: int, max_batch: int,
          rate: float | None, seed: int = 0, profile: bool = False, open_loop: bool = False,
          process: str = "poisson", policy: str = "", lookahead: bool | None = None) -> dict:
    """Requests through the scheduler as the worker and the server's dispatch run them. `rate` None:
    closed loop (N clients at once); else arrivals at `rate` requests/s (`process`: poisson or constant gaps),
    at most N in the engine or waiting, or with `open_loop` whatever is in flight (clients x per_client
    requests in all), through a scheduler of step `policy` ("name[:K]"; "": the engine's default) and decode
    `lookahead` (None: the engine's default). Returns the figures.
    `profile`: the device is synchronized after every step (a denoise forward is otherwise only waited for
    by the next step's token read) and each step's wall time is summed under `step_kind`."""
    total = clients * per_client
    if rate is None:
        arrivals = [0.0] * clients                         # the first request of every client; more follow ends
    else:
        arrivals = arrival_times(total, rate, process, seed)
    name, _, k = policy.partition(":")
    scheduler = pipe.scheduler = (pipe.new_scheduler(int(k or DECODE_STEPS_PER_DENOISE), name, lookahead)
                                  if policy else pipe.new_scheduler(lookahead=lookahead))   # the worker's loop
    captured = sum(pipe.graphs.captures.values())
    waiting: collections.deque = collections.deque()
    arrived: dict[int, float] = {}                        # seq -> arrival (seconds from the start)
    latency: dict[int, float] = {}
    sent, next_seq = 0, 0
    spent: dict[str, list] = {}                           # step kind -> [steps, seconds] (profile)
    cuda = torch.cuda.is_available() and pipe.loaded.model.device.type == "cuda"
    t0 = time.perf_counter()
    reader = Reader(t0)
    while len(latency) < total:                           # every request ends: with its image or an error
        now = time.perf_counter() - t0
        while sent < len(arrivals) and arrivals[sent] <= now and (rate is None or open_loop
                                                                   or len(arrived) - len(latency) < clients):
            waiting.append((next_seq, prepare(make(next_seq), pipe.loaded)))   # once, as it enters
            arrived[next_seq] = arrivals[sent]       # latency counts its wait to get in
            sent, next_seq = sent + 1, next_seq + 1
        join = []
        while waiting and len(join) + len(scheduler.requests) < max_batch:
            join.append(waiting.popleft())
        if not join and not scheduler.busy:
            time.sleep(max(0.0, min(arrivals[sent] - now, 0.05)) if sent < len(arrivals) else 0.001)
            _ends(reader, latency, arrived, arrivals if rate is None else None, total)
            continue
        t_step = time.perf_counter()
        pipe.step(StepNews(join=tuple(join)))
        if profile:
            if cuda:
                torch.cuda.synchronize()
            kind = spent.setdefault(step_kind(scheduler.last), [0, 0.0])
            kind[0] += 1
            kind[1] += time.perf_counter() - t_step
        reader.put(*scheduler.drain())
        _ends(reader, latency, arrived, arrivals if rate is None else None, total)
    wall = time.perf_counter() - t0
    reader.close()
    images, errors, token_rates = reader.images, reader.errors, [rate for rate, _ in reader.token_rates]
    # a CoT of a few tokens whose decode met one stall (a graph captured mid-run, a 0.2 s denoise turn) reads as
    # a slow stream (5 tokens over 1 s: 5 tokens/s); among CoTs of LONG_COT tokens or more the slowest rate is
    # the one a reader of reasoning sees
    long_rates = [rate for rate, tokens in reader.token_rates if tokens >= LONG_COT]
    lat = sorted(latency.values())
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: float("nan"))
    done = scheduler.totals
    return {"requests": total, "images": images, "errors": errors, "wall_s": wall,
            "decode_rows": done["decode_rows"] / max(1, done["decode_steps"]), "decode_steps": done["decode_steps"],
            "denoise_forwards": done["denoise_forwards"], "profile": spent,
            "images_per_min": 60 * images / wall, "p50_s": pick(0.5), "p90_s": pick(0.9), "mean_s": sum(lat) / max(1, len(lat)),
            "engine_steps": scheduler.steps, "captures": sum(pipe.graphs.captures.values()) - captured,
            "requests_per_forward": scheduler.denoising.member_steps / max(1, scheduler.denoising.forwards),
            "tokens_per_s": sum(token_rates) / len(token_rates) if token_rates else float("nan"),
            "tokens_per_s_min": min(token_rates, default=float("nan")),
            "tokens_per_s_min_long": min(long_rates, default=float("nan")),
            "policy": policy or f"default ({scheduler.policy}:{scheduler.k})",
            "cot_tokens": sum(reader.cot_tokens) / len(reader.cot_tokens) if reader.cot_tokens else float("nan"),
            "lookahead": scheduler.lookahead,
            # per denoise turn, the other requests waiting for a step of the same key (denoise batching's room)
            "denoise_company": scheduler.denoise_company["same_key"] / max(1, scheduler.denoise_company["turns"])}


def run(args: argparse.Namespace, out: Output) -> bool:
    dev = "cpu" if args.dry else "cuda"
    clients = [int(c) for c in args.clients.split(",") if c] if not args.dry else [1, 2] if args.clients else []
    per_client = args.per_client if not args.dry else 1
    cot = 4 if args.dry else args.cot
    rows, ok = [], True
    for build in filter(None, args.builds.split(",")):
        if build not in SERVED:
            raise SystemExit(f"unknown build {build!r} ({', '.join(SERVED)})")
        steps = 2 if args.dry else SERVED[build][4]
        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            folder = checkpoint_folder(Path(tmp), args.dry, SERVED[build][1])
            if dev == "cuda":
                torch.cuda.empty_cache()
            lm, groups = engine(build, folder, dev)
            out.data["moe_kernels"] = lay_out_experts(lm.model, args.moe_kernels)
            out.data["mxfp8_kernels"] = fold_mxfp8_weights(lm.model, args.mxfp8_kernels, out.data["moe_kernels"])
            out.say(f"{build}: quantized experts on {out.data['moe_kernels']}, MXFP8 weights on "
                    f"{out.data['mxfp8_kernels']}")
            for batch in [int(d) for d in args.max_denoise_batch.split(",")]:
                pipe = Engine(lm, groups, EngineOptions(max_batch=args.max_batch, max_denoise_batch=batch,
                                                        preview_every=args.previews))
                ok = serve_all(pipe, args, build, batch, steps, cot, clients, per_client, rows, out) and ok
                del pipe
                gc.collect()                       # its KV pool and graphs go before the next one's
                if dev == "cuda":
                    torch.cuda.empty_cache()
            del lm
    out.data.update(rows=rows, max_batch=args.max_batch, per_client=per_client, greedy=args.greedy)
    out.table(rows, [Col("build", "build"), Col("denoise batch", "max_denoise_batch"), Col("policy", "policy"),
                     Col("lookahead", "lookahead"),
                     Col("arrivals", "mode"),
                     Col("clients", "clients"), Col("rate /min", "rate_per_min", ".2f"),
                     Col("images/min", "images_per_min", ".2f"), Col("p50 s", "p50_s", ".2f"),
                     Col("p90 s", "p90_s", ".2f"), Col("wall s", "wall_s", ".1f"),
                     Col("captures", "captures"), Col("steps", "engine_steps"),
                     Col("decode rows", "decode_rows", ".2f"),
                     Col("requests/forward", "requests_per_forward", ".2f"),
                     Col("CoT tokens", "cot_tokens", ".0f"),
                     Col("tokens/s", "tokens_per_s", ".1f"), Col("slowest tokens/s", "tokens_per_s_min", ".1f"),
                     Col(f"slowest tokens/s, CoT >= {LONG_COT}", "tokens_per_s_min_long", ".1f"),
                     Col("same-class company", "denoise_company", ".2f"),
                     Col("p90 / alone", "p90_over_alone", ".2f"), Col("held", "held")],
              f"Serving through the scheduler, max-batch {args.max_batch}, {per_client} request(s) per client, "
              f"think_recaption {cot} CoT tokens" + (" (greedy)" if args.greedy else ""))
    return ok


def serve_all(pipe: Engine, args: argparse.Namespace, build: str, batch: int, steps: int, cot: int,
              clients: list[int], per_client: int, rows: list, out: Output) -> bool:
    """The first request, then closed and Poisson runs at each client count, into `rows`; whether every
    request gave its image."""
    ok = True
    size = "256x256" if args.dry else "1024x1024"
    prompt = prompt_of(pipe.loaded, 40 if args.dry else PREFILL)

    def make(seq: int) -> Request:
        return Request(prompt=prompt, bot_task="think_recaption", size=size, steps=steps,
                       max_new_tokens=cot, seed=1000 + seq, greedy=args.greedy)
    out.data.setdefault("prefill_tokens", {})[build] = prefill_tokens(pipe.loaded, make(0))
    if args.warmup:
        w = warm_up(pipe, (size,))
        out.data.setdefault("warmup", {})[f"{build}/{batch}"] = w.summary()
        out.say(f"{build}, denoise batch {batch}: warm-up {w.seconds:.2f} s, {w.graphs} graphs ({len(w.parts)} parts)")
    first = serve(pipe, make, batch, 1, args.max_batch, None, seed=1)     # a full denoise batch's keys too
    out.say(f"{build}, denoise batch {batch}: first {batch} request(s) (capture their graphs) {first['mean_s']:.2f} s, "
            f"{first['captures']} graphs")
    lookaheads = [{"on": True, "off": False}[a] for a in args.lookahead.split(",") if a] or [None]
    for policy in args.policy.split(",") if args.policy else [""]:
        for ahead in lookaheads:
            ok = serve_policy(pipe, make, args, policy, build, batch, steps, cot, clients, per_client, rows, out,
                              ahead) and ok
    return ok


def serve_policy(pipe: Engine, make: Callable[[int], Request], args: argparse.Namespace, policy: str, build: str,
                 batch: int, steps: int, cot: int, clients: list[int], per_client: int, rows: list,
                 out: Output, lookahead: bool | None = None) -> bool:
    """The closed and Poisson runs at each client count and the open-loop runs, with step `policy` and decode
    `lookahead` (None: the engine's default). A closed row's "p90 / alone" divides by the 1-client closed
    row's latency of the same policy when that ran first (issue 42's bar: p90 at 4 clients <= 2x alone)."""
    ok = True
    ahead = {"lookahead": lookahead}
    alone: float | None = None                    # the 1-client closed run's latency, when it ran first
    for n in clients:
        runs = {"closed": serve(pipe, make, n, per_client, args.max_batch, None, profile=args.profile, policy=policy,
                                **ahead)}
        rate = (10 if args.dry else 0.9) * runs["closed"]["images_per_min"] / 60      # dry: no idle waits
        if "poisson" in args.arrivals:
            runs["poisson"] = serve(pipe, make, n, per_client, args.max_batch, rate, seed=n, profile=args.profile,
                                    policy=policy, **ahead)
        if "closed" not in args.arrivals:
            del runs["closed"]
        for mode, r in runs.items():
            row = {"build": build, "max_denoise_batch": batch, "mode": mode, "clients": n, "steps": steps,
                   "cot": cot} | r
            if mode == "poisson":
                row["rate_per_s"] = rate
            elif n == 1 and r["captures"] == 0:
                alone = r["p50_s"]
            if mode == "closed" and alone:
                row["p90_over_alone"] = r["p90_s"] / alone
            rows.append(row)
            ok = ok and complete(r)
            out.say(f"{build} denoise batch {batch} {r['policy']} lookahead {r['lookahead']} {mode} x{n}: "
                    f"{r['images_per_min']:.2f} images/min, "
                    f"p50 {r['p50_s']:.2f} s, p90 {r['p90_s']:.2f} s, {r['requests_per_forward']:.2f} requests a "
                    f"denoise forward, {r['decode_rows']:.2f} rows a decode step, {r['tokens_per_s']:.1f} tokens/s "
                    f"(slowest {r['tokens_per_s_min']:.1f}; of CoTs >= {LONG_COT} tokens {r['tokens_per_s_min_long']:.1f}), "
                    f"{r['captures']} graphs captured" +
                    (f", errors: {r['errors'][:2]}" if r["errors"] else ""))
            if r["profile"]:
                stepped = sum(sec for _, sec in r["profile"].values())
                out.say(f"  profile: {r['wall_s']:.1f} s wall, {stepped:.1f} s in engine steps, "
                        f"{r['wall_s'] - stepped:.1f} s between them (arrivals, prepare, the driver)")
                for kind, (count, sec) in sorted(r["profile"].items(), key=lambda kv: -kv[1][1]):
                    out.say(f"    {kind:<32} {count:>6} steps {sec:8.2f} s {1000 * sec / count:9.2f} ms a step")
    if args.rates:
        ok = open_loop(pipe, make, args, policy, build, batch, steps, cot, rows, out, lookahead) and ok
    return ok


def complete(r: dict) -> bool:
    """Whether every request of a run gave its image."""
    return not r["errors"] and r["images"] == r["requests"]


def open_loop(pipe: Engine, make: Callable[[int], Request], args: argparse.Namespace, policy: str, build: str,
              batch: int, steps: int, cot: int, rows: list, out: Output, lookahead: bool | None = None) -> bool:
    """One request alone (its latency L), then the open-loop runs at each of --rates (module doc), into
    `rows`; the highest rate held (p90 <= 2 L) into the output's data. Whether every request gave its image."""
    alone = serve(pipe, make, 1, 1, args.max_batch, None, policy=policy, lookahead=lookahead)
    limit = 2 * alone["p50_s"]
    sweep = args.rates == "sweep"
    rates = [f * 60 / alone["p50_s"] for f in SWEEP] if sweep else [float(r) for r in args.rates.split(",")]
    out.say(f"{build}, denoise batch {batch}, {policy}: one request alone {alone['p50_s']:.2f} s "
            f"({alone['captures']} graphs captured); open loop ({args.arrival_process}, {args.requests} requests a "
            f"rate), held: p90 <= {limit:.2f} s")
    ok, held = complete(alone), None
    for k, rate in enumerate(rates):
        r = serve(pipe, make, args.requests, 1, args.max_batch, rate / 60, seed=100 + k, profile=args.profile,
                  open_loop=True, process=args.arrival_process, policy=policy, lookahead=lookahead)
        r["held"] = complete(r) and r["p90_s"] <= limit
        rows.append({"build": build, "max_denoise_batch": batch, "mode": f"open {args.arrival_process}",
                     "clients": None, "steps": steps, "cot": cot, "rate_per_min": rate, "alone_s": alone["p50_s"],
                     "p90_over_alone": r["p90_s"] / alone["p50_s"]} | r)
        ok = ok and complete(r)
        out.say(f"{build} denoise batch {batch} {policy} open {rate:.2f}/min: {r['images_per_min']:.2f} images/min, "
                f"p50 {r['p50_s']:.2f} s, p90 {r['p90_s']:.2f} s ({r['p90_s'] / alone['p50_s']:.2f}x alone), "
                f"{'held' if r['held'] else 'not held'}, {r['captures']} graphs captured")
        if r["held"]:
            held = rate if held is None else max(held, rate)
        elif sweep:
            break                        # a higher rate holds less
    out.data.setdefault("open_loop", {})[f"{build}/{batch}/{policy}"] = {
        "alone_s": alone["p50_s"], "held_per_min": held, "process": args.arrival_process}
    out.say(f"{build}, denoise batch {batch}, {policy}: highest open-loop rate held "
            + (f"{held:.2f} requests/min" if held is not None else "none of those tried"))
    return ok
