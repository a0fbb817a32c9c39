"""First cached, first evicted.

Blocks are ordered by the time they entered the prefix cache (were published),
not by their last use: a popular block that keeps being hit still leaves in its
original turn. This is the classic baseline that recency-aware policies beat.

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) keeps the primary's turn: the hash has been
cached since the primary's publish.
"""

from __future__ import annotations

from itertools import count

from sortedcontainers import SortedDict

from .arc import takes_over
from .base import PolicyBase


class FIFOPolicy(PolicyBase):
    name = "fifo"

    def __init__(self) -> None:
        self._ticket = count()
        self._cached_at: dict[int, int] = {}   # block -> ticket when it was published
        self._candidates: SortedDict = SortedDict()  # ticket -> block, evictable only
        self._victim: tuple | None = None      # (hash, ticket) of the latest victim, until the next on_cached

    def on_cached(self, block: int) -> None:
        victim, self._victim = self._victim, None
        if victim is not None:
            block_hash = self.pool.block_hash[block]
            if victim[0] == block_hash and takes_over(self.pool, block_hash):
                self._cached_at[block] = victim[1]
                return
        self._cached_at[block] = next(self._ticket)

    def on_released(self, block: int) -> None:
        self._candidates[self._cached_at[block]] = block

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._candidates[self._cached_at[block]]

    def evict(self) -> int:
        ticket, block = self._candidates.popitem(0)
        del self._cached_at[block]
        pool = self.pool
        if pool is not None:  # (driven without a pool in tests: no duplicates to take over)
            self._victim = (pool.block_hash[block], ticket)
        return block

    def clear(self) -> None:
        self._victim = None
        self._cached_at.clear()
        self._candidates.clear()

    def __len__(self) -> int:
        return len(self._candidates)

    def __contains__(self, block: int) -> bool:
        ticket = self._cached_at.get(block)
        return ticket is not None and ticket in self._candidates

    def snapshot(self) -> tuple:
        return tuple(self._candidates.items()), tuple(sorted(self._cached_at.items()))
