"""The K/V prefix cache of the AR phase: a conversation's next turn does not prefill its history again.

When a request's AR phase ends, the K/V of its cond sequence is kept up to where the next turn's
history layout of it stops sharing that sequence (engine/runtime/history.py: the next turn shows this
one as `User: [images] prompt \\n\\n Assistant: <reasoning>` then its image, where the AR sequence went
on with `<answer><boi>...`): the system prompt, the earlier turns, this turn's instruction and its
reasoning. A new turn that shows earlier turns looks up its longest cached prefix, copies that K/V
into its AR slot and prefills only the rest (a plain forward at sequence indices [n, L), keys [0, L)).
A request without history never reads the cache (it would share at most the system prompt, and its
result would then depend, at rounding level, on which requests ran before it): a single request gives
exactly what it gave without the cache.

What a cached K/V depends on, and so the key: the token ids, the encodings at the image tokens (their
`identity`, engine/runtime/conditioning.py: `<img>` ids alone do not say which image), the LoRA adapter
and its strength (the cache is emptied when adapters change), and the positions and attention blocks,
which the ids and image layouts fix. A prefix is cut only where no attention block straddles the cut
(an image's tokens see each other both ways) and before the prompt's last token (its logits are needed).

Entries are whole prefixes, matched by their longest common prefix with the request (a linear scan:
a few entries of thousands of tokens each, one lookup per request, numpy compares), not vLLM's chain of
fixed-size block hashes: the match is exact to the token (no block rounding at either end) and an entry
is one contiguous copy per layer into the slot, with no paged storage to keep. An entry that a new one
extends (the previous turn of the same conversation) is dropped when the new one is stored, so a linear
conversation holds one entry; a branch keeps its own. Bounded in bytes, least recently used evicted first.

Each rank keeps the K/V of its own AR heads, on its device. Every rank takes the same decisions: they
depend only on the ids, the identities and the token counts (every rank's AR micro has as many heads),
all of which the ranks share; and a hit's length is agreed once per turn (the least any rank found, one
all-gather of one number before the prefill), so a rank out of step could only cost cached tokens. The CFG uncond branch is not cached (the denoise phase prefills it, as
before). A request without an AR phase (no reasoning, size fixed) neither reads nor writes the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.model.attention import KVCache
from engine.runtime.lru import ByteLRU


@dataclass(frozen=True)
class PrefixKey:
    """A sequence prefix as the cache compares it."""
    ids: np.ndarray                          # [n] token ids
    images: tuple[tuple[int, str], ...]      # (first index, identity) of each image span in it
    blocks: np.ndarray                       # [n] attention block ids (-1: causal)
    adapter: tuple[str | None, float]        # the LoRA adapter and its strength

    def __len__(self) -> int:
        return len(self.ids)

    def common(self, other: "PrefixKey") -> int:
        """How many leading tokens the two share, K/V and all: equal ids, the same encodings at image
        tokens, the same adapter; cut back so that no attention block straddles the end."""
        if self.adapter != other.adapter:
            return 0
        n = min(len(self), len(other))
        diff = np.flatnonzero(self.ids[:n] != other.ids[:n])
        n = int(diff[0]) if len(diff) else n
        theirs = dict(other.images)
        for start, identity in self.images:
            if start < n and theirs.get(start) != identity:
                n = start
        return _block_cut(self.blocks, _block_cut(other.blocks, n))


def _block_cut(blocks: np.ndarray, n: int) -> int:
    """n, moved back to the first token of the attention block that holds tokens n - 1 and n."""
    if 0 < n < len(blocks) and blocks[n - 1] >= 0 and blocks[n - 1] == blocks[n]:
        return int(np.flatnonzero(blocks[:n] == blocks[n])[0])
    return n


def prefix_key(ids: list[int], image_starts: list[int], identities: list[str], blocks: list[int],
               adapter: tuple[str | None, float]) -> PrefixKey:
    return PrefixKey(np.asarray(ids, dtype=np.int64), tuple(zip(image_starts, identities)),
                     np.asarray(blocks, dtype=np.int64), adapter)


@dataclass
class _Entry:
    key: PrefixKey
    kv: torch.Tensor          # [layers, 2, heads, n, D]


class PrefixCache:
    """Cached cond-branch K/V prefixes of one rank's AR heads (max_bytes 0: off)."""

    def __init__(self, max_bytes: int):
        self.lru: ByteLRU[_Entry] = ByteLRU(max_bytes)
        self._next = 0
        self.hits = self.misses = 0

    @property
    def enabled(self) -> bool:
        return self.lru.max_bytes > 0

    def lookup(self, key: PrefixKey, limit: int) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `key`, and that length (at most `limit`: the
        prompt's last token is always prefilled); (None, 0) when none shares a token."""
        best, n = None, 0
        for name, entry in self.lru.items():
            m = min(entry.key.common(key), limit)
            if m > n:
                best, n = name, m
        if best is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        return self.lru.get(best), n

    @staticmethod
    def restore(entry: _Entry, n: int, cache: KVCache) -> None:
        """Copy the entry's first n positions into `cache` (a slot row's AR heads, [1, heads, L, D])."""
        for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
            k[0, :, :n] = entry.kv[layer, 0, :, :n]
            v[0, :, :n] = entry.kv[layer, 1, :, :n]

    def store(self, key: PrefixKey, cache: KVCache) -> bool:
        """Keep positions [0, len(key)) of `cache` (a slot row's AR heads) under `key`; an entry it
        extends is dropped, and nothing is stored where one already holds it whole."""
        n = len(key)
        k0 = cache.k[0]
        layers, heads, D = len(cache.k), k0.shape[1], k0.shape[3]
        nbytes = layers * 2 * heads * n * D * k0.element_size()
        if n == 0 or nbytes > self.lru.max_bytes:       # (off, or over the bound alone: the cache stays as it is)
            return False
        for name, entry in self.lru.items():
            shared = entry.key.common(key)
            if shared == n:                          # an entry holds all of it already
                self.lru.get(name)
                return False
            if shared == len(entry.key):             # the new one extends it
                self.lru.pop(name)
        self.lru.room(nbytes)                        # evicted before the new entry is allocated
        kv = torch.empty(layers, 2, heads, n, D, dtype=k0.dtype, device=k0.device)
        for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
            kv[layer, 0] = k[0, :, :n]
            kv[layer, 1] = v[0, :, :n]
        self._next += 1
        return self.lru.put(self._next, _Entry(key, kv), nbytes)

    def clear(self) -> None:
        self.lru.clear()
