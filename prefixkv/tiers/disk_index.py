"""One process's view of which blocks a disk namespace holds: hash -> file bytes, least recently used first.

The view can be stale in both directions (other processes write and evict): a
block it lists may have vanished (a read then misses and ``forget`` drops it), a
block it lacks may be there (the store ``stat``s on a miss and ``touch``es what it
finds; ``merge`` adopts a whole ``scan``). Recency is this process's: writes and
verified reads make a block the most recent; after a ``merge`` the blocks it did not
know come first (oldest), in file modification order, ties by hash.

Thread-safe: the caller's thread (reads) and the store's writer thread (writes,
evictions) share it; every method holds the lock for O(1) work except ``merge`` (O(n)).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Sequence

__all__ = ["BlockIndex"]


class BlockIndex:
    def __init__(self) -> None:
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._lru

    @property
    def bytes(self) -> int:
        return self._bytes

    def touch(self, block_hash: bytes, size: int) -> None:
        """``block_hash`` is on disk in ``size`` bytes and was just used."""
        with self._lock:
            old = self._lru.pop(block_hash, None)
            self._bytes += size - (old or 0)
            self._lru[block_hash] = size

    def touch_many(self, keys: Sequence[bytes], sizes: Sequence[int]) -> None:
        """``touch(keys[j], sizes[j])`` for each ``j`` in order, under one acquisition of the lock."""
        with self._lock:
            lru, grown = self._lru, 0
            for block_hash, size in zip(keys, sizes):
                old = lru.pop(block_hash, None)
                grown += size - (old or 0)
                lru[block_hash] = size
            self._bytes += grown

    def sizes(self, keys: Sequence[bytes]) -> list:
        """File bytes of each of ``keys`` as this view knows them (None: not listed), under one
        acquisition of the lock: what a fetch reads without an ``fstat`` per file."""
        with self._lock:
            get = self._lru.get
            return [get(block_hash) for block_hash in keys]

    def forget(self, block_hash: bytes) -> int:
        """Drop a block from the view; its bytes (0 where it was not listed)."""
        with self._lock:
            size = self._lru.pop(block_hash, 0)
            self._bytes -= size
            return size

    def pop_oldest(self) -> tuple[bytes, int] | None:
        """The least recently used block, taken out of the view (None when empty)."""
        with self._lock:
            if not self._lru:
                return None
            block_hash, size = self._lru.popitem(last=False)
            self._bytes -= size
            return block_hash, size

    def merge(self, found: list) -> None:
        """Adopt a scan (``(mtime ns, hash, bytes)`` per file): listed blocks no longer found are
        dropped, found blocks not listed come first (oldest, by modification time, ties by hash),
        known ones keep their order."""
        with self._lock:
            lru = self._lru
            # plain tuples sort without a key function: at an open of 100,000 blocks this sort is the index
            merged = OrderedDict((h, size) for _, h, size in sorted(f for f in found if f[1] not in lru))
            if lru:
                sizes = {h: size for _, h, size in found}
                for h in lru:
                    size = sizes.get(h)
                    if size is not None:
                        merged[h] = size
            self._lru = merged
            self._bytes = sum(merged.values())

    def order(self) -> list[bytes]:
        """Hashes, least recently used first (tests, operators)."""
        with self._lock:
            return list(self._lru)

    def clear(self) -> None:
        with self._lock:
            self._lru.clear()
            self._bytes = 0
