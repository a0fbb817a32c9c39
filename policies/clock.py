"""CLOCK: FIFO with second chances (a reference counter per block, the hand at the oldest).

Corbató, "A Paging Experiment with the Multics System", in *In Honor of Philip M. Morse*,
MIT Press, 1969 (Project MAC report MAC-M-384, 1968); the n-bit generalisation is the
GCLOCK of Smith, "Sequentiality and Prefetching in Database Systems", ACM TODS 1978.

Rules, as libCacheSim's ``Clock`` states them: a block enters at the new end with counter
``init_freq`` (0); a hit adds one, up to ``2**counter_bits - 1`` (1: the classic reference
bit); to evict, the oldest block is taken: with a counter above 0 it loses one and goes
back to the new end, else it is evicted.

On the evictable set: every cached block keeps its place in the ring while it is in use, but
the hand only takes candidates, kept in a sorted map keyed by their place (a ticket, renewed
on each second chance). An eviction is O(log n) per step; each extra step is paid for by an
earlier hit. With one-block requests this is exactly libCacheSim's ``Clock``
(``tests/policies/test_libcachesim_equality.py``).

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) resumes the primary's place and counter.
"""

from __future__ import annotations

from itertools import count

from sortedcontainers import SortedDict

from prefixkv.checks import integer

from .arc import takes_over
from .base import PolicyBase


class ClockPolicy(PolicyBase):
    name = "clock"
    reads_chain = False

    def __init__(self, counter_bits: int = 1, init_freq: int = 0) -> None:
        counter_bits = integer("counter_bits", counter_bits, low=1, high=30, integral_float=True)
        self.counter_bits = counter_bits
        self.max_freq = (1 << counter_bits) - 1
        self.init_freq = integer("init_freq", init_freq, low=0, high=self.max_freq, integral_float=True)
        self._tickets = count(1)
        self._ticket: dict[int, int] = {}       # cached block -> its place in the ring
        self._freq: dict[int, int] = {}         # cached block -> reference counter
        self._cands: SortedDict = SortedDict()  # ticket -> candidate block, oldest first
        self._victim: tuple | None = None       # (hash, ticket) of the latest victim, until the next on_cached

    def on_cached(self, block: int) -> None:
        victim, self._victim = self._victim, None
        if victim is not None:
            block_hash = self.pool.block_hash[block]
            if victim[0] == block_hash and takes_over(self.pool, block_hash):
                self._ticket[block] = victim[1]
                self._freq[block] = 0           # the victim's counter was 0
                return
        self._ticket[block] = next(self._tickets)
        self._freq[block] = self.init_freq

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._cands[self._ticket[block]]
        freq = self._freq[block]
        if freq < self.max_freq:
            self._freq[block] = freq + 1

    def on_released(self, block: int) -> None:
        self._cands[self._ticket[block]] = block

    def evict(self) -> int:
        cands = self._cands
        freq = self._freq
        while True:
            ticket, block = cands.popitem(0)
            if freq[block]:                      # second chance: back to the new end
                freq[block] -= 1
                self._ticket[block] = ticket = next(self._tickets)
                cands[ticket] = block
                continue
            break
        del self._ticket[block], freq[block]
        pool = self.pool
        if pool is not None:
            self._victim = (pool.block_hash[block], ticket)
        return block

    def clear(self) -> None:
        self._victim = None
        self._ticket.clear()
        self._freq.clear()
        self._cands.clear()

    def __len__(self) -> int:
        return len(self._cands)

    def __contains__(self, block: int) -> bool:
        ticket = self._ticket.get(block)
        return ticket is not None and ticket in self._cands

    def snapshot(self) -> tuple:
        return tuple(self._cands.items()), tuple(sorted(self._ticket.items())), tuple(sorted(self._freq.items()))
