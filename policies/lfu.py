"""Least frequently used, with counts that halve every ``half_life`` accesses.

Plain in-cache counts let a block that was hot once squat forever. Here every
access (publish or hit) adds ``2**epoch`` to a block's weight, where the epoch
is ``accesses // half_life``: measured at any later time, an access made ``k``
epochs ago counts ``2**-k`` -- every count is halved each ``half_life``
accesses, lazily and exactly. Because all candidates age at the same rate, the
order among them never changes while they wait, so it lives in one sorted map:
O(log n) per event, nothing rescanned.

The weight is stored normalised as ``(E, w)`` meaning ``w * 2**E`` with
``1 <= w < 2``, so tuples compare exactly like the weights themselves and no
float overflows however long the run. Ties (equal weight) go to the least
recently released block: with every block touched once in the same epoch this
is plain LRU.

``half_life`` defaults to the pool's capacity in blocks (one turnover of the
cache), at least 16.

A duplicate block that takes over the hash of an evicted primary (the pool's
promotion, right after ``evict``) is no access: it resumes the primary's weight.
"""

from __future__ import annotations

import numbers
from itertools import count
from math import ldexp

from sortedcontainers import SortedDict

from prefixkv.errors import InvalidArgument

from .arc import takes_over
from .base import PolicyBase


class LFUPolicy(PolicyBase):
    name = "lfu"

    def __init__(self, half_life: int | None = None) -> None:
        if half_life is not None and (isinstance(half_life, bool) or not isinstance(half_life, numbers.Integral)
                                      or half_life <= 0):
            raise InvalidArgument("half_life", f"must be a positive int (accesses), got {half_life!r}")
        self._half_life_option = half_life
        self.half_life = half_life or 1024
        self._accesses = 0
        self._ticket = count()
        self._weight: dict[int, tuple[int, float]] = {}  # cached block -> (E, w)
        self._key: dict[int, tuple[int, float, int]] = {}  # candidate -> its key in _candidates
        self._candidates: SortedDict = SortedDict()        # (E, w, ticket) -> block
        self._victim: tuple | None = None  # (hash, weight) of the latest victim, until the next on_cached

    def bind(self, pool) -> None:
        super().bind(pool)
        if self._half_life_option is None:
            self.half_life = max(16, pool.num_blocks)

    def _epoch(self) -> int:
        epoch = self._accesses // self.half_life
        self._accesses += 1
        return epoch

    def on_cached(self, block: int) -> None:
        victim, self._victim = self._victim, None
        if victim is not None:
            block_hash = self.pool.block_hash[block]
            if victim[0] == block_hash and takes_over(self.pool, block_hash):
                self._weight[block] = victim[1]
                return
        self._weight[block] = (self._epoch(), 1.0)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._candidates[self._key.pop(block)]
        k = self._epoch()
        e, w = self._weight[block]
        top = e if e > k else k
        w = ldexp(w, e - top) + ldexp(1.0, k - top)  # exact while epochs are < 53 apart
        if w >= 2.0:                                  # w < 3 here, so one halving normalises
            w *= 0.5
            top += 1
        self._weight[block] = (top, w)

    def on_released(self, block: int) -> None:
        e, w = self._weight[block]
        key = (e, w, next(self._ticket))
        self._key[block] = key
        self._candidates[key] = block

    def evict(self) -> int:
        key, block = self._candidates.popitem(0)
        del self._key[block]
        self._victim = (self.pool.block_hash[block], self._weight.pop(block))
        return block

    def clear(self) -> None:
        self._victim = None
        self._weight.clear()
        self._key.clear()
        self._candidates.clear()
        self._accesses = 0

    def weight(self, block: int) -> float:
        """The block's current (decayed) access count; for inspection and tests."""
        e, w = self._weight[block]
        return ldexp(w, e - self._accesses // self.half_life)

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def snapshot(self) -> tuple:
        return (tuple(self._candidates.items()), tuple(sorted(self._weight.items())), self._accesses)
