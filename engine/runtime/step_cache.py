"""The step cache: a per-request policy inside the denoise loop that says, step by step, whether the
backbone runs in full or its output is forecast from cached features (docs/design.md, Step cache): the official
Taylor cache (below) or an adaptive first-block cache (`BlockCache`).

The official Taylor cache (HunyuanImage-3.0's `use_taylor_cache`, read from its modeling code and
`cache_utils.py`; the parameter names, defaults and CLI options are the official ones):

- What is forecast: the output of the whole backbone (last decoder layer, before the final layer) for
  every token of the image step, i.e. the meta tokens (<timestep>, Distil's <guidance>/<timestep_r>) and
  the image tokens, [rows, meta + h*w, H], every row of the request together (both CFG branches, all n
  images). The tail embeddings (patch embedding, timestep tokens) and the final layer still run every step.
- Which steps run in full: step 0; every `taylor_cache_interval`-th step after the last full one (the
  official counter: a forecast step advances it, the step after `interval - 1` forecasts is full);
  with `taylor_cache_enable_first_enhance` the first `taylor_cache_first_enhance_steps` steps; with
  `taylor_cache_enable_tailing_enhance` the last `taylor_cache_tailing_enhance_steps` steps.
- What a full step records: the output is split along the token axis by an FFT (in fp32) into a low
  band (|frequency| <= 0.1 x the largest) and the high band, each cast back to the model dtype. Per band,
  derivative 0 is the new output and derivative k+1 = (new derivative k - previous derivative k) / d,
  d the steps since the previous full step (a backward finite difference); a band keeps up to
  `taylor_cache_low_freqs_order` / `taylor_cache_high_freqs_order` derivatives, both capped by
  `taylor_cache_order`, and only orders whose lower derivative existed before (one more per full step).
  With first enhance on, the full steps before step `first_enhance_steps - 1` record nothing.
- A forecast step at distance k from the last full step: sum over both bands of d_i * k**i / i!.
- CFG rows are cached and forecast together (each row on its own: the FFT runs along tokens); under
  CFG-parallel each rank forecasts its own branch; under SP every rank holds the gathered tail (the FFT
  spans all tokens) and forecasts it identically, so no rank communicates more than a full step does.

Where ours differs from the official code, on purpose: its state lives on the model and survives the
request (a second request sees the first one's counter and derivatives), ours is per request; its step 0
output spans the whole sequence (no prefix cache), so with first enhance off its step-5 difference fails
on mismatched shapes, while ours records step 0's tail like any other full step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from engine.parallel.layout import Comm

ORDER_RANGE = (0, 4)          # more derivatives cost two [rows, tokens, H] tensors each and help nothing
STEPS_FIELD_RANGE = (0, 200)  # enhance steps, like the request's steps
INTERVAL_RANGE = (1, 200)
FFT_CUTOFF = 0.1              # the official low band: |f| <= 0.1 max|f|


@dataclass(frozen=True)
class TaylorCacheParams:
    """The official Taylor cache's settings, with the official names and CLI defaults."""
    taylor_cache_interval: int = 5
    taylor_cache_order: int = 2
    taylor_cache_enable_first_enhance: bool = False
    taylor_cache_first_enhance_steps: int = 3
    taylor_cache_enable_tailing_enhance: bool = False
    taylor_cache_tailing_enhance_steps: int = 1
    taylor_cache_low_freqs_order: int = 2
    taylor_cache_high_freqs_order: int = 2

    def problem(self) -> tuple[str, str] | None:
        """(field, message) for the first value out of range; None when all are fine."""
        ranges = {"taylor_cache_interval": INTERVAL_RANGE, "taylor_cache_order": ORDER_RANGE,
                  "taylor_cache_first_enhance_steps": STEPS_FIELD_RANGE,
                  "taylor_cache_tailing_enhance_steps": STEPS_FIELD_RANGE,
                  "taylor_cache_low_freqs_order": ORDER_RANGE, "taylor_cache_high_freqs_order": ORDER_RANGE}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.startswith("taylor_cache_enable_"):
                if not isinstance(v, bool):
                    return f.name, f"{f.name} must be true or false (got {v!r})"
                continue
            lo, hi = ranges[f.name]
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                return f.name, f"{f.name} must be an integer from {lo} to {hi} (got {v!r})"
        return None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class TaylorStep:
    """One step of the official schedule: `full` runs the backbone; a full step `records` its output at
    `distance` steps from the previous full one; a forecast step extrapolates `distance` steps ahead."""
    full: bool
    record: bool
    distance: int


def taylor_schedule(p: TaylorCacheParams, steps: int) -> list[TaylorStep]:
    """The official cache's decisions for a `steps`-step request (host arithmetic, before step 0)."""
    out, counter, last_full = [], 0, 0
    for i in range(steps):
        full = (i == 0 or counter == p.taylor_cache_interval - 1
                or (p.taylor_cache_enable_first_enhance and i < p.taylor_cache_first_enhance_steps)
                or (p.taylor_cache_enable_tailing_enhance and i >= steps - p.taylor_cache_tailing_enhance_steps))
        if full:
            record = not (p.taylor_cache_enable_first_enhance and i < p.taylor_cache_first_enhance_steps - 1)
            out.append(TaylorStep(True, record, i - last_full))
            counter, last_full = 0, i
        else:
            counter += 1
            out.append(TaylorStep(False, False, counter))
    return out


def split_bands(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [B, T, H] -> (low, high) along the token axis, each in h's dtype (fp32 FFT, as the official)."""
    spec = torch.fft.fft(h.float(), dim=1)
    f = torch.fft.fftfreq(h.shape[1], device=h.device).abs()
    low_mask = (f <= FFT_CUTOFF * f.max())[None, :, None]
    low = torch.fft.ifft(spec * low_mask, dim=1).real
    high = torch.fft.ifft(spec * ~low_mask, dim=1).real
    return low.to(h.dtype), high.to(h.dtype)


class StepCache:
    """No cache: every step runs in full. The base of the policies the denoise runner consults."""
    graphable = True                 # the step's work is the same kernels every step (a CUDA graph can hold it)

    def __init__(self, steps: int):
        self.steps = steps
        self.full_steps = 0          # steps that ran the backbone (the timings report it)

    def full(self, i: int) -> bool:
        return True

    def backbone(self, i: int, tail: torch.Tensor, forward: Callable[..., torch.Tensor], comm: Comm) -> torch.Tensor:
        """Step i's backbone output for the tail embeddings [rows, T, H]: `forward(x, layers)` runs layers
        (default all) of every row; `comm` joins the ranks that hold the request's other CFG rows."""
        return forward(tail)

    def record(self, i: int, hidden: torch.Tensor) -> None:
        """After full step i: its backbone output `hidden` [rows, meta + h*w, H] (the caller's buffer)."""
        self.full_steps += 1

    def forecast(self, i: int) -> torch.Tensor:
        raise AssertionError("a policy without a forecast was asked for one")


class TaylorCache(StepCache):
    """The official Taylor cache for one request (see the module docstring)."""

    def __init__(self, params: TaylorCacheParams, steps: int):
        super().__init__(steps)
        self.params = params
        self.schedule = taylor_schedule(params, steps)
        order = params.taylor_cache_order
        # per band: the derivatives recorded so far (order 0 first); a band's limit is its own order capped
        # by the container's (`taylor_cache_order`)
        self.limits = {"low": min(params.taylor_cache_low_freqs_order, order),
                       "high": min(params.taylor_cache_high_freqs_order, order)}
        self.d: dict[str, list[torch.Tensor]] = {"low": [], "high": []}

    def full(self, i: int) -> bool:
        return self.schedule[i].full

    def record(self, i: int, hidden: torch.Tensor) -> None:
        super().record(i, hidden)
        s = self.schedule[i]
        if not s.record:
            return
        new = dict(zip(("low", "high"), split_bands(hidden)))
        fresh = {}
        for band in ("low", "high"):
            old, chain = self.d[band], [new[band]]
            # derivative k+1 needs derivative k of the previous record
            while len(chain) <= self.limits[band] and len(chain) <= len(old):
                k = len(chain) - 1
                chain.append((chain[k] - old[k]) / s.distance)
            fresh[band] = chain
        # the official container moves the bands' new derivatives order by order and stops at the first
        # order without a new high-band one (after taking that order's low-band one)
        n_high = len(fresh["high"])
        fresh["low"] = fresh["low"][:n_high + 1]
        for band in ("low", "high"):
            self.d[band] = fresh[band] + self.d[band][len(fresh[band]):]

    def forecast(self, i: int) -> torch.Tensor:
        k = self.schedule[i].distance
        out = None
        for band in ("low", "high"):
            part = None
            for j, d in enumerate(self.d[band]):
                term = d * (1 / math.factorial(j)) * (k ** j)
                part = term if part is None else part + term
            out = part if out is None else out + part
        return out


@dataclass(frozen=True)
class BlockCacheParams:
    """The adaptive first-block cache (DBCache / first-block-cache style; not measured yet: the defaults
    are the usual ones of those caches, to be set by `python -m bench step-cache`)."""
    block_cache_threshold: float = 0.08      # skip when the first blocks' residual changed less than this
    block_cache_first_blocks: int = 1        # layers every step runs (the probe)
    block_cache_max_skips: int = 3           # consecutive skipped steps at most
    block_cache_warmup_steps: int = 2        # first steps always in full
    block_cache_tail_steps: int = 1          # last steps always in full

    def problem(self) -> tuple[str, str] | None:
        t = self.block_cache_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 1:
            return "block_cache_threshold", f"block_cache_threshold must be a number from 0 to 1 (got {t!r})"
        for name, (lo, hi) in (("block_cache_first_blocks", (1, 64)), ("block_cache_max_skips", (0, 200)),
                               ("block_cache_warmup_steps", (1, 200)), ("block_cache_tail_steps", (0, 200))):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                return name, f"{name} must be an integer from {lo} to {hi} (got {v!r})"
        return None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class BlockCache(StepCache):
    """Every step runs the first `block_cache_first_blocks` layers; their residual (stream out - stream in)
    is compared with the one of the last full step: relative L1 change = sum|r - r_full| / sum|r_full|
    over every row of the request (both CFG branches and all images decide together; CFG-parallel ranks
    add their sums over `comm`). Under the threshold (and within the skip limits) the other layers are
    skipped and the last full step's residual of those layers is added instead; otherwise they run and
    their residual is kept. Under SP the probe is the gathered stream, so every rank sees the same sums
    and TP ranks the same all-reduced stream: all ranks take the same branch without a further message.
    The decision is data: one host read per step, so this policy runs eagerly (no CUDA graph)."""
    graphable = False

    def __init__(self, params: BlockCacheParams, steps: int, layers: int):
        super().__init__(steps)
        self.params, self.layers = params, layers
        self.first = min(params.block_cache_first_blocks, layers)
        self.probe: torch.Tensor | None = None      # the first blocks' residual at the last full step
        self.rest: torch.Tensor | None = None       # the other layers' residual at the last full step
        self.skipped_run = 0

    def record(self, i: int, hidden: torch.Tensor) -> None:
        pass                                         # `backbone` counts the steps whose other layers ran

    def may_skip(self, i: int) -> bool:
        p = self.params
        return (self.rest is not None and i >= p.block_cache_warmup_steps and i < self.steps - p.block_cache_tail_steps
                and self.skipped_run < p.block_cache_max_skips)

    def backbone(self, i: int, tail: torch.Tensor, forward: Callable[..., torch.Tensor], comm: Comm) -> torch.Tensor:
        p = self.params
        head = forward(tail, range(0, self.first))
        if self.first == self.layers:                # the probe is the whole backbone: nothing to skip
            self.full_steps += 1
            return head
        probe = head - tail
        if self.may_skip(i):
            sums = torch.stack([(probe - self.probe).abs().float().sum(), self.probe.abs().float().sum()])
            comm.all_reduce_(sums)
            change, scale = sums.tolist()            # the step's one host read
            if change <= p.block_cache_threshold * scale:
                self.skipped_run += 1
                return head + self.rest
        out = forward(head, range(self.first, self.layers))
        self.probe, self.rest, self.skipped_run = probe, out - head, 0
        self.full_steps += 1
        return out


def make_step_cache(taylor: TaylorCacheParams | None, steps: int, block: BlockCacheParams | None = None,
                    layers: int = 0) -> StepCache:
    """The request's policy: the Taylor cache or the block cache (of a `layers`-layer backbone) when it
    asked for one, else every step in full."""
    if taylor is not None:
        return TaylorCache(taylor, steps)
    if block is not None:
        return BlockCache(block, steps, layers)
    return StepCache(steps)


def named_setting(name: str) -> tuple[TaylorCacheParams | None, BlockCacheParams | None]:
    """(Taylor settings, block-cache settings) of a setting's name, the names a page, the evaluation and
    the benchmark share: `none`; `taylor` (the official defaults: interval 5, order 2, no enhance);
    `taylor-enhance` (the same with first enhance, 3 steps, and tailing enhance, 1 step); `taylor-N`
    (interval N); `block` (the block cache at its defaults); `block-T` (threshold T). The CLI and `/v1`
    take every field on its own. ValueError names what is not known."""
    if name == "none":
        return None, None
    if name == "taylor":
        return TaylorCacheParams(), None
    if name == "taylor-enhance":
        return TaylorCacheParams(taylor_cache_enable_first_enhance=True, taylor_cache_enable_tailing_enhance=True), None
    if name.startswith("taylor-") and name[7:].isdigit():
        p: TaylorCacheParams | BlockCacheParams = TaylorCacheParams(taylor_cache_interval=int(name[7:]))
    elif name == "block":
        return None, BlockCacheParams()
    elif name.startswith("block-"):
        try:
            p = BlockCacheParams(block_cache_threshold=float(name[6:]))
        except ValueError:
            p = None
    else:
        p = None
    bad = p.problem() if p is not None else ("", "")
    if bad is not None:
        raise ValueError(f"step cache setting {name!r}: {bad[1] or 'not a setting'}; the settings: none, taylor, "
                         "taylor-enhance, taylor-N, block, block-T")
    return (p, None) if isinstance(p, TaylorCacheParams) else (None, p)
