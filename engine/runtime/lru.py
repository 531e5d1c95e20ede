"""A byte-bounded least-recently-used map: the engine's caches of encodings and K/V prefixes.

Every rank of a plan holds its own, and every rank must keep the same keys (a cache hit changes the
shapes the ranks' collectives see): so what goes in and what is evicted depends only on the keys and
on the byte counts the caller gives, never on a clock or on which rank it is.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterator, TypeVar

V = TypeVar("V")

# The default bounds, per rank, of the engine's two conversation caches (EngineConfig takes them from here;
# 0 turns one off). K/V: 2 GiB holds ~16k tokens of the real model at TP1 in bf16 (128 KiB a token), three
# 1024x1024 turns of a conversation; encodings: ~40 MiB per 1024x1024 image of the real model.
PREFIX_CACHE_MB = 2048
ENCODING_CACHE_MB = 1024


class ByteLRU(Generic[V]):
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"a cache's byte bound must be >= 0 (got {max_bytes}; 0 turns it off)")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def items(self) -> Iterator[tuple[Hashable, V]]:
        """Least recently used first (a snapshot: the caller may evict while it walks)."""
        return iter([(k, v) for k, (v, _) in self._items.items()])

    def get(self, key: Hashable) -> V | None:
        """The value (now the most recently used), or None."""
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> bool:
        """Keep `value` (replacing the key's old one), evicting the least recently used until it fits;
        False (nothing kept or evicted) where it alone is over the bound."""
        if not self.room(nbytes):
            return False
        self.pop(key)
        self.room(nbytes)
        self._items[key] = (value, nbytes)
        self.nbytes += nbytes
        return True

    def room(self, nbytes: int) -> bool:
        """Evict the least recently used until `nbytes` more fit (before the caller allocates them);
        False, evicting nothing, where they are over the bound alone."""
        if nbytes > self.max_bytes:
            return False
        while self._items and self.nbytes + nbytes > self.max_bytes:
            self.pop(next(iter(self._items)))
        return True

    def pop(self, key: Hashable) -> V | None:
        item = self._items.pop(key, None)
        if item is None:
            return None
        self.nbytes -= item[1]
        return item[0]

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
