"""First cached, first evicted.

Blocks are ordered by the time they entered the prefix cache (were published),
not by their last use: a popular block that keeps being hit still leaves in its
original turn. This is the classic baseline that recency-aware policies beat.
"""

from __future__ import annotations

from itertools import count

from sortedcontainers import SortedDict

from .base import PolicyBase


class FIFOPolicy(PolicyBase):
    name = "fifo"

    def __init__(self) -> None:
        self._ticket = count()
        self._cached_at: dict[int, int] = {}   # block -> ticket when it was published
        self._candidates: SortedDict = SortedDict()  # ticket -> block, evictable only

    def on_cached(self, block: int) -> None:
        self._cached_at[block] = next(self._ticket)

    def on_released(self, block: int) -> None:
        self._candidates[self._cached_at[block]] = block

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._candidates[self._cached_at[block]]

    def evict(self) -> int:
        _, block = self._candidates.popitem(0)
        del self._cached_at[block]
        return block

    def clear(self) -> None:
        self._cached_at.clear()
        self._candidates.clear()

    def __len__(self) -> int:
        return len(self._candidates)

    def __contains__(self, block: int) -> bool:
        ticket = self._cached_at.get(block)
        return ticket is not None and ticket in self._candidates

    def snapshot(self) -> tuple:
        return tuple(self._candidates.items()), tuple(sorted(self._cached_at.items()))
