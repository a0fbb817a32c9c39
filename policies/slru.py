"""Segmented LRU (the 2Q idea): a probation segment and a protected segment.

A newly cached block is on probation. A prefix-cache hit (while it waits or
while it is in use) promotes it to the protected segment. Victims come from
probation first, least recently released first; protected blocks are evicted
only when no probation candidate is left. So a block used once -- a request's
private tail -- can never push out a prefix that has proved it is shared,
which plain LRU does whenever the one-off was released more recently.

The protected segment holds at most ``protected_size`` blocks (default
``protected_fraction`` of the pool: half, not the textbook 80%, because in
prefix caches the next turn of a conversation comes back long after its
blocks were first released, and a small probation segment drops them first). When a promotion overflows it, the least
recently released protected *candidate* is demoted to the most recent end of
probation (blocks in use cannot be ordered, so an overflow made only of active
blocks waits until one of them is released). Every event is O(1) amortised:
each demotion undoes one earlier promotion.

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) stays in the primary's segment: the hash was
never out of the cache, and one that proved shared stays protected.
"""

from __future__ import annotations

from collections import OrderedDict

from .arc import takes_over
from .base import PolicyBase
from prefixkv.checks import integer, real


class SLRUPolicy(PolicyBase):
    name = "slru"

    def __init__(self, protected_fraction: float = 0.5, protected_size: int | None = None) -> None:
        real("protected_fraction", protected_fraction, low=0.0, high=1.0)
        if protected_size is not None:
            protected_size = integer("protected_size", protected_size, low=0, integral_float=True)
        self.protected_fraction = protected_fraction
        self.protected_size = protected_size
        self._limit = protected_size if protected_size is not None else 1 << 62
        self._protected: dict[int, bool] = {}                 # cached block -> in the protected segment
        self._num_protected = 0                                # cached blocks in the protected segment
        self._probation_c: OrderedDict[int, None] = OrderedDict()  # candidates, release order
        self._protected_c: OrderedDict[int, None] = OrderedDict()
        self._victim: tuple | None = None  # (hash, was protected) of the latest victim, until the next on_cached

    def bind(self, pool) -> None:
        super().bind(pool)
        if self.protected_size is None:
            self._limit = int(self.protected_fraction * pool.num_blocks)

    def _demote_overflow(self) -> None:
        protected_c = self._protected_c
        while self._num_protected > self._limit and protected_c:
            block = protected_c.popitem(last=False)[0]
            self._protected[block] = False
            self._num_protected -= 1
            self._probation_c[block] = None

    def on_cached(self, block: int) -> None:
        if self._protected.get(block):  # its last residency ended in use (taken up a tier), unannounced
            self._num_protected -= 1
        victim, self._victim = self._victim, None
        if victim is not None and victim[1]:
            block_hash = self.pool.block_hash[block]
            if victim[0] == block_hash and takes_over(self.pool, block_hash):
                self._protected[block] = True   # the count is back where it was before the eviction
                self._num_protected += 1
                return
        self._protected[block] = False

    def on_hit(self, block: int, was_evictable: bool) -> None:
        protected = self._protected[block]
        if was_evictable:
            del (self._protected_c if protected else self._probation_c)[block]
        if not protected:
            self._protected[block] = True
            self._num_protected += 1
            self._demote_overflow()

    def on_released(self, block: int) -> None:
        if self._protected[block]:
            self._protected_c[block] = None
            self._demote_overflow()
        else:
            self._probation_c[block] = None

    def evict(self) -> int:
        if self._probation_c:
            block = self._probation_c.popitem(last=False)[0]
        else:
            block = self._protected_c.popitem(last=False)[0]
            self._num_protected -= 1
        self._victim = (self.pool.block_hash[block], self._protected.pop(block))
        return block

    def clear(self) -> None:
        self._victim = None
        self._protected.clear()
        self._num_protected = 0
        self._probation_c.clear()
        self._protected_c.clear()

    def __len__(self) -> int:
        return len(self._probation_c) + len(self._protected_c)

    def __contains__(self, block: int) -> bool:
        return block in self._probation_c or block in self._protected_c

    def snapshot(self) -> tuple:
        return (tuple(self._probation_c), tuple(self._protected_c),
                tuple(sorted(self._protected.items())), self._num_protected)
