"""LeCaR: regret minimisation between two experts, LRU and LFU.

Vietri, Rodriguez, Martinez, Lyons, Liu, Rangaswami, Zhao, Narasimhan, "Driving Cache
Replacement with ML-based LeCaR", USENIX HotStorage 2018.

Rules, as in the paper's algorithm 1: each eviction asks one expert, drawn with probability
``w_lru`` (else LFU): LRU names the least recently released candidate, LFU the least
frequently accessed (ties: least recently released). When the two disagree, the victim's hash
goes to the chosen expert's history (a FIFO of ``c`` hashes each) with the time and its count.
A missed block whose hash is in LRU's history says LRU was wrong: ``w_lfu`` grows by
``exp(learning_rate x discount**(t - t_evicted))`` (LFU's history likewise grows ``w_lru``),
the weights are normalised, and the block resumes its count plus one. ``t`` counts accesses
(publishes and hits); the defaults are the paper's: learning rate 0.45, discount
``0.005 ** (1 / c)``, both weights 0.5 at first.

Randomness: the expert is drawn from ``random.Random(seed)`` (``seed`` 0 by default), so a
replay is reproducible and two policies with the same seed on the same events choose alike
(``check_policy`` requires it); change the seed to sample other draws.

On the evictable set: both experts choose among candidates; the LFU order is a sorted map of
(count, release ticket), so every event is O(log n).

libCacheSim 0.3.5's ``LeCaR`` draws from its own generator, so the two cannot be equal draw
for draw; ``tests/policies/test_libcachesim_equality.py`` pins both counts on one-block
requests and the README says by how much they differ.

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) is no return from a history: it resumes the primary's count, and the history
entry the eviction left is taken back.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from itertools import count

from sortedcontainers import SortedDict

from prefixkv.checks import integer, real

from .arc import takes_over
from .base import PolicyBase
from .ghosts import GhostList


class LeCaRPolicy(PolicyBase):
    name = "lecar"
    reads_chain = False

    def __init__(self, learning_rate: float = 0.45, discount: float | None = None, seed: int = 0) -> None:
        real("learning_rate", learning_rate, low=0.0)
        if discount is not None:
            real("discount", discount, low=0.0, high=1.0, low_open=True)
        self.seed = integer("seed", seed, integral_float=True)
        self.learning_rate = learning_rate
        self._discount_option = discount
        self.discount = discount if discount is not None else 0.995
        self.w_lru = self.w_lfu = 0.5
        self._rng = random.Random(self.seed)
        self._time = 0
        self._tickets = count(1)
        self._freq: dict[int, int] = {}              # cached block -> accesses
        self._lru: OrderedDict[int, None] = OrderedDict()   # candidates, least recently released first
        self._lfu: SortedDict = SortedDict()         # (count, release ticket) -> candidate
        self._key: dict[int, tuple] = {}             # candidate -> its key in _lfu
        self._history = (GhostList(1 << 62), GhostList(1 << 62))   # LRU's, LFU's: hash -> (time, count)
        self._victim: tuple | None = None            # (hash, count, history or None) of the latest victim

    def bind(self, pool) -> None:
        super().bind(pool)
        c = max(1, pool.num_blocks)
        if self._discount_option is None:
            self.discount = 0.005 ** (1.0 / c)
        for history in self._history:
            history.limit = c

    def _regret(self, block_hash) -> int:
        """A returning hash: reward the expert that did not evict it; its count, or 0."""
        for expert, history in enumerate(self._history):
            entry = history.take(block_hash, None)
            if entry is not None:
                evicted_at, freq = entry
                reward = math.exp(self.learning_rate * self.discount ** (self._time - evicted_at))
                if expert == 0:         # LRU evicted it wrongly
                    self.w_lfu *= reward
                else:
                    self.w_lru *= reward
                total = self.w_lru + self.w_lfu
                self.w_lru /= total
                self.w_lfu /= total
                return freq
        return 0

    def on_cached(self, block: int) -> None:
        block_hash = self.pool.block_hash[block]
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            if victim[2] is not None:
                self._history[victim[2]].undo(block_hash)
            self._freq[block] = victim[1]
            return
        self._time += 1
        self._freq[block] = self._regret(block_hash) + 1

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._lru[block]
            del self._lfu[self._key.pop(block)]
        self._time += 1
        self._freq[block] += 1

    def on_released(self, block: int) -> None:
        self._lru[block] = None
        key = (self._freq[block], next(self._tickets))
        self._key[block] = key
        self._lfu[key] = block

    def evict(self) -> int:
        by_lru = next(iter(self._lru))
        by_lfu = self._lfu.peekitem(0)[1]
        expert = 0 if self._rng.random() < self.w_lru else 1
        block = by_lru if expert == 0 else by_lfu
        del self._lru[block]
        del self._lfu[self._key.pop(block)]
        freq = self._freq.pop(block)
        block_hash = self.pool.block_hash[block]
        if by_lru != by_lfu:
            self._history[expert].add(block_hash, (self._time, freq))
        else:
            expert = None
        self._victim = (block_hash, freq, expert)
        return block

    def clear(self) -> None:
        self._victim = None
        self.w_lru = self.w_lfu = 0.5
        self._time = 0
        self._freq.clear()
        self._lru.clear()
        self._lfu.clear()
        self._key.clear()
        for history in self._history:
            history.clear()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block: int) -> bool:
        return block in self._lru

    def snapshot(self) -> tuple:
        return (tuple(self._lru), tuple(self._lfu.items()), tuple(sorted(self._freq.items())), self.w_lru,
                self._time, self._history[0].snapshot(), self._history[1].snapshot())
