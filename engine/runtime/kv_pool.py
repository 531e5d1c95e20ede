"""The KV caches of the engine's requests, allocated once and reused, with the AR steps bound to them.

Two storages, each [rows, heads, length, head_dim] per layer (heads: this rank's allocation, the union
of its AR and denoise heads, engine/runtime/handoff.py):
- AR slots: `slots` rows, one per request from its prefill to its hand-off, plus one staging row. A slot
  row is the request's AR cache; the pool keeps each slot's position table (reference images give a
  request 2D positions of its own). The batched decode step (engine/runtime/decode_step.py) runs over
  the slot rows; the padded prefill (engine/runtime/prefill_step.py) runs on the staging row, and the
  prompt's K/V is then copied to the request's slot, so one prefill graph per length bucket serves
  every slot. The last position of every row is scratch: idle decode rows write there, nothing reads it.
- Denoise rows: the caches of the requests in their denoise phase (branches x images rows each, side by
  side from row 0: a denoise batch, engine/runtime/denoise_batch.py). At the hand-off the AR slot's
  prefix is copied into the request's cond row (no recompute; a copy on the device) and the slot is free
  for the next request. The denoise step graphs (engine/runtime/denoise.py) are captured on
  this storage, once per step key, and replayed by every later request of the key until it grows.
  Each denoise row has its request's LoRA adapter (`set_denoise_adapter`, every row of the request, CFG
  rows included; set when it takes its rows, moved with them), so requests with different adapters (or
  none) share a denoise batch's forward.

A storage grows (whole grains of positions) only while nobody holds it: the AR slots when every slot is
free, the denoise rows while no request holds any. The AR steps (and their graphs) are bound to one AR
storage and made again when it grows. Nothing a request reads is left over from an earlier one: every
phase writes the positions it then attends to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.model.attention import KVCache
from engine.model.hunyuan import HunyuanImage3
from engine.model.lora import LoraRows, RowAdapters
from engine.parallel.layout import PhaseView
from engine.runtime.decode_step import DecodeStep
from engine.runtime.graphs import Graphs
from engine.runtime.prefill_step import PrefillStep

GRAIN = 1024            # positions are allocated in multiples of this (fewer regrowths, fewer captures)


def _grains(length: int, limit: int) -> int:
    return max(length, min(-(-length // GRAIN) * GRAIN, limit))


@dataclass
class ARRow:
    """A request's AR slot as its text phase uses it (engine/runtime/text_phase.py): the slot's cache row
    (its AR heads), the request's positions and blocks [n, 2], [n], its LoRA adapter rows, and the two
    forwards a text phase runs on its own (the batched decode steps are the pool's): the prompt's prefill
    and a few tokens fed together (forced ones). `cached`: the leading positions whose K/V the row already
    holds (a conversation's prefix, engine/runtime/prefix_cache.py), which the prefill skips."""
    pool: "KVPool"
    slot: int
    pos: torch.Tensor
    blocks: torch.Tensor
    cached: int = 0

    @property
    def cache(self) -> KVCache:
        return self.pool.slot_cache(self.slot).heads(self.pool.ar_heads)

    @property
    def length(self) -> int:
        """Positions the request may write: its position table's, within the slot's."""
        return min(self.cache.max_len, self.pos.shape[0])

    def prefill(self, embeds: torch.Tensor) -> torch.Tensor:
        """The prompt's forward (embeds [1, L, H] at sequence indices [0, L)), past the cached prefix ->
        the fp32 logits [vocab] of its last token."""
        if not self.cached:
            return self.pool.prefill_into(self.slot, embeds, self.pos, self.blocks)
        return self.feed_embeds(embeds[:, self.cached:], self.cached)

    def feed(self, ids: list[int], start: int) -> torch.Tensor:
        """The forward of tokens `ids` at sequence indices [start, start + len(ids)) -> the fp32 logits
        [vocab] of the last."""
        m = self.pool.model
        return self.feed_embeds(m.transformer.embed(torch.tensor([ids], device=m.device)), start)

    def feed_embeds(self, embeds: torch.Tensor, start: int) -> torch.Tensor:
        """The plain forward (no graph) of embeds [1, T, H] at sequence indices [start, start + T) on the
        slot's own row, whose K/V [0, start) are there -> the fp32 logits [vocab] of the last token."""
        m, view = self.pool.model, self.pool.view
        stop = start + embeds.shape[1]
        batch = m.attn_batch(torch.arange(start, stop, device=embeds.device), self.pos, self.blocks, stop, view,
                             lora=self.pool.slot_lora(self.slot))
        return m.transformer.logits(m.backbone(embeds, batch, self.cache, view)[:, -1], view)[0]


class KVPool:
    def __init__(self, model: HunyuanImage3, heads: int, ar_heads: slice, limit: int, slots: int, view: PhaseView,
                 graphs: Graphs, use_graph: bool, denoise_batch: int = 1):
        """heads: KV heads allocated per row; ar_heads: the AR phase's slice of them; limit: positions a
        row may need (the model's, plus the scratch); slots: requests in their AR phase at once;
        denoise_batch: requests in their denoise phase at once (their rows side by side)."""
        self.model, self.heads, self.ar_heads, self.limit, self.slots = model, heads, ar_heads, limit, slots
        self.denoise_batch = denoise_batch
        self.view, self.graphs, self.use_graph = view, graphs, use_graph
        self.ar: KVCache | None = None                 # [slots + 1, heads, L, D]: the slots, then staging
        self.pos: torch.Tensor | None = None           # [slots, L, 2] each slot's position table
        self.free: list[int] = list(range(slots))      # free AR slots, lowest first (small decode buckets)
        # slots given back by work on the overlap policy's image lane (a hand-off, which reads the slot there:
        # engine/runtime/lanes.py), each with the event after which that lane is done with it; `fence` (the
        # scheduler's Lanes.fence) records it, and where it gives None a slot is free at once
        self.draining: list[tuple[int, torch.cuda.Event]] = []
        self.fence: Callable[[], torch.cuda.Event | None] | None = None
        self.decode: DecodeStep | None = None
        self.prefill: PrefillStep | None = None
        self.denoise: KVCache | None = None            # [rows, heads, L, D] of the denoising requests
        self.allocations = 0                           # how often a storage was (re)allocated (tests)
        # each AR slot's (and the staging row's) LoRA adapter, and each denoise row's (engine/model/lora.py):
        # set once per request, read by every forward (None: the engine has no adapter tables; the denoise
        # rows' are made with their storage)
        self.lora_tables = tables = model.lora
        self.ar_adapters = None if tables is None else RowAdapters(tables, slots)
        self.staging_adapters = None if tables is None else RowAdapters(tables, 1)
        self.denoise_adapters: RowAdapters | None = None
        self._ar_generation = 0
        self._denoise_generation = 0

    @property
    def ar_length(self) -> int:
        """Positions a slot holds for a request (the last one of the storage is scratch)."""
        return 0 if self.ar is None else self.ar.max_len - 1

    # ------------------------------------------------------------------ AR slots
    def take_slot(self, length: int) -> int | None:
        """A free slot for a request whose AR phase writes `length` positions, or None (all taken, or the
        storage is too short while other slots are in use: it grows once they are free)."""
        self._drain()
        if not self.free or (length > self.ar_length and len(self.free) < self.slots):
            return None
        if length > self.ar_length:
            self._allocate_ar(length)
        return self.free.pop(0)

    def reserve_ar(self, length: int) -> None:
        """The AR storage made now for requests that write up to `length` positions (engine/runtime/warmup.py:
        the steps' graphs are captured on the storage a default request would otherwise grow it to)."""
        if length > self.ar_length:
            if len(self.free) < self.slots:
                raise ValueError("the AR storage grows only while every slot is free")
            self._allocate_ar(length)

    def release_slot(self, slot: int) -> None:
        """The slot goes back: free at once, or, given back on the image lane, once that lane's work queued so
        far is done (`_drain`), so the AR lane never waits for the image lane to reuse it."""
        if self.ar_adapters is not None:
            self.ar_adapters.clear(slot)
        done = self.fence() if self.fence is not None else None
        if done is None:
            self.free.append(slot)
            self.free.sort()
        else:
            self.draining.append((slot, done))

    def _drain(self) -> None:
        """The draining slots whose event has passed, free (the event queried: no host wait)."""
        passed = [slot for slot, done in self.draining if done.query()]
        if passed:
            self.draining = [(slot, done) for slot, done in self.draining if slot not in passed]
            self.free = sorted(self.free + passed)

    def slot_cache(self, slot: int) -> KVCache:
        """The slot's AR cache row (every allocated head), [1, heads, L, D]."""
        return self.ar.rows(slice(slot, slot + 1))

    def slot_lora(self, slot: int) -> LoraRows | None:
        """The adapter rows of a forward on the slot's cache row alone (None: no adapter)."""
        return None if self.ar_adapters is None else self.ar_adapters.row(slot)

    def row(self, slot: int, pos: torch.Tensor, blocks: torch.Tensor, adapter: int = 0, strength: float = 1.0
            ) -> ARRow:
        """Slot `slot` for a request of positions pos [n, 2] and blocks [n] (n <= ar_length), with its LoRA
        adapter (table slot, 0: none) and strength: set for the decode steps of its slot, and its handle."""
        self.pos[slot, :pos.shape[0]].copy_(pos)
        if self.ar_adapters is not None:
            self.ar_adapters.set(slot, adapter, strength)
        return ARRow(self, slot, pos, blocks)

    def prefill_into(self, slot: int, embeds: torch.Tensor, pos: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The prompt's forward (embeds [1, L, H]) on the staging row, its K/V then copied to the slot;
        returns the fp32 logits [vocab] of its last token."""
        L, staging, heads = embeds.shape[1], self.slots, self.ar_heads
        if self.ar_adapters is not None:
            self.staging_adapters.set(0, *self.ar_adapters.of(slot))
        logits = self.prefill(embeds, pos, blocks)
        for buf in (*self.ar.k, *self.ar.v):
            buf[slot, heads, :L] = buf[staging, heads, :L]
        return logits

    def _allocate_ar(self, length: int) -> None:
        m, cfg = self.model, self.model.cfg
        length = _grains(length + 1, self.limit)        # + the scratch position
        self.ar = self.decode = self.prefill = None      # the old storage (and its graphs) go first
        self._ar_generation += 1
        gen = self._ar_generation
        self.graphs.drop(lambda key: key[-1] != ("ar", gen - 1))
        self.ar = KVCache.allocate(cfg.num_layers, self.slots + 1, self.heads, length, cfg.head_dim, m.dtype, m.device)
        self.pos = torch.zeros(self.slots, length, 2, dtype=torch.long, device=m.device)
        key = (self.slots, ("ar", gen))
        slot_rows = self.ar.rows(slice(0, self.slots)).heads(self.ar_heads)
        self.decode = DecodeStep(m, slot_rows, self.pos, self.view, self.graphs, key, self.use_graph,
                                 adapters=self.ar_adapters)
        staging = self.ar.rows(slice(self.slots, self.slots + 1)).heads(self.ar_heads)
        self.prefill = PrefillStep(m, staging, self.view, self.use_graph, graphs=self.graphs, key=key,
                                   adapters=self.staging_adapters)
        self.allocations += 1

    # ------------------------------------------------------------------ denoise rows
    def take_denoise(self, rows: int, length: int, first: int = 0) -> KVCache:
        """A denoising request's cache: rows [first, first + rows) of `length` positions (views of the
        storage). The storage grows only for the first of a denoise batch (first == 0: nobody else holds
        rows), then with room for `denoise_batch` requests of its rows."""
        have = self.denoise
        if not self.denoise_fits(first + rows, length):
            if first:
                raise ValueError(f"denoise rows [{first}, {first + rows}) x {length} positions do not fit the "
                                 f"storage while other requests hold rows of it")
            self.denoise = None                          # the old storage goes before the new is made
            self._denoise_generation += 1                # and the denoise graphs captured on it
            gen = self._denoise_generation
            self.graphs.drop(lambda key: ("rows", gen - 1) not in key)
            n = max(rows * self.denoise_batch, 0 if have is None else have.k[0].shape[0])
            L = _grains(max(length, 0 if have is None else have.max_len), self.limit)
            m, cfg = self.model, self.model.cfg
            self.denoise = KVCache.allocate(cfg.num_layers, n, self.heads, L, cfg.head_dim, m.dtype, m.device)
            if self.lora_tables is not None:
                self.denoise_adapters = RowAdapters(self.lora_tables, n)
            self.allocations += 1
        return self.denoise.rows(slice(first, first + rows)).prefix(length)

    def denoise_fits(self, stop: int, length: int) -> bool:
        """Whether rows [0, stop) of `length` positions fit the denoise storage as it is."""
        have = self.denoise
        return have is not None and stop <= have.k[0].shape[0] and length <= have.max_len

    def move_denoise(self, src: int, dst: int, rows: int, length: int) -> KVCache:
        """Rows [src, src + rows) moved down to [dst, ...) (dst + rows <= src: no overlap), positions
        [0, length); returns the moved rows' new cache (a denoise batch keeps its rows contiguous from 0
        when one of its requests ends)."""
        if dst + rows > src:
            raise ValueError(f"moving denoise rows {src} -> {dst} ({rows} rows) would overlap")
        for t in (*self.denoise.k, *self.denoise.v):
            t[dst:dst + rows, :, :length] = t[src:src + rows, :, :length]
        if self.denoise_adapters is not None:          # the rows' adapters go with them
            self.denoise_adapters.copy(slice(dst, dst + rows), slice(src, src + rows))
        return self.denoise.rows(slice(dst, dst + rows)).prefix(length)

    def set_denoise_adapter(self, first: int, rows: int, adapter: int,
                            strength: float) -> tuple[LoraRows | None, LoraRows | None]:
        """The LoRA adapter (table slot, 0: none) of the denoising request in rows [first, first + rows), every
        row of it. Returns the adapter rows of its prefill (its first row: one adapter for all its rows) and
        of its steps alone (from row 0, where the one request of a denoise batch sits); None without one."""
        ad = self.denoise_adapters
        if ad is None:
            return None, None
        ad.set(slice(first, first + rows), adapter, strength)
        return ad.row(first), ad.rows(slice(0, 1), ad.alone(adapter))

    def clear_denoise_adapter(self, first: int, rows: int) -> None:
        """Rows [first, first + rows) are idle (their request left them)."""
        if self.denoise_adapters is not None:
            self.denoise_adapters.clear(slice(first, first + rows))

    def denoise_lora(self, stop: int) -> tuple[str, LoraRows | None]:
        """The LoRA mode of the denoise rows in use (those of a denoise batch's forward, [0, stop)) and their
        adapter rows in that mode (engine/model/lora.py `RowAdapters`)."""
        ad = self.denoise_adapters
        return ("off", None) if ad is None else (ad.mode, ad.rows(slice(0, stop)))

    @property
    def denoise_key(self) -> tuple:
        """Names the denoise storage in the denoise step's graph keys (its graphs replay on it)."""
        return (("rows", self._denoise_generation),)

    def hand_off(self, slot: int, cache: KVCache, prefix: int) -> None:
        """Copy the AR slot's K/V [0, prefix) (its AR heads) into the cond row of the denoise cache."""
        heads = self.ar_heads
        for src, dst in zip((*self.ar.k, *self.ar.v), (*cache.k, *cache.v)):
            dst[0, heads, :prefix] = src[slot, heads, :prefix]
