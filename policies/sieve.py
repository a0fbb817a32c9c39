"""SIEVE: a FIFO queue, a visited bit per block and a hand that sweeps from old to new.

Zhang, Yang, Yue, Vigfusson, Rashmi, "SIEVE is Simpler than LRU: an Efficient Turn-Key
Eviction Algorithm for Web Caches", USENIX NSDI 2024.

Rules, as in the paper (and libCacheSim's ``Sieve``): a block enters at the new end,
unvisited; a hit only sets its visited bit (no reordering). To evict, the hand walks from
where it stopped towards newer blocks, clearing visited bits, and evicts the first unvisited
block; past the newest block it wraps to the oldest. After an eviction the hand rests on the
next newer block, or, when the victim was the newest, starts at the oldest next time.

On the evictable set: the queue orders every cached block by the time it was published, but
the hand only ever stops at candidates (a block in use keeps its place and its bit while it
is held), so the candidates live in a sorted map keyed by their publish ticket and the hand is
a ticket. An eviction is O(log n) plus one step per visited bit it clears, each paid for by
an earlier hit. With one-block requests this is exactly libCacheSim's ``Sieve``
(``tests/policies/test_libcachesim_equality.py``).

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) resumes the primary's place (it was unvisited: it was the victim).
"""

from __future__ import annotations

from itertools import count

from sortedcontainers import SortedDict

from .arc import takes_over
from .base import PolicyBase


class SievePolicy(PolicyBase):
    name = "sieve"
    reads_chain = False     # never reads pool.parent_hash / pool.depth (policies/base.py)

    def __init__(self) -> None:
        self._tickets = count(1)
        self._ticket: dict[int, int] = {}     # cached block -> publish ticket
        self._visited: set[int] = set()       # cached blocks hit since the hand last passed them
        self._cands: SortedDict = SortedDict()  # ticket -> candidate block, oldest first
        self._hand: int | None = None         # the next sweep starts at the first candidate >= this ticket
        self._victim: tuple | None = None     # (hash, ticket) of the latest victim, until the next on_cached

    def on_cached(self, block: int) -> None:
        victim, self._victim = self._victim, None
        self._visited.discard(block)          # a residency that ended in use (taken up a tier) left its bit
        if victim is not None:
            block_hash = self.pool.block_hash[block]
            if victim[0] == block_hash and takes_over(self.pool, block_hash):
                self._ticket[block] = victim[1]
                return
        self._ticket[block] = next(self._tickets)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._cands[self._ticket[block]]
        self._visited.add(block)

    def on_released(self, block: int) -> None:
        self._cands[self._ticket[block]] = block

    def evict(self) -> int:
        cands = self._cands
        visited = self._visited
        i = 0 if self._hand is None else cands.bisect_left(self._hand)
        while True:
            if i >= len(cands):
                i = 0
            ticket, block = cands.peekitem(i)
            if block in visited:
                visited.discard(block)
                i += 1
                continue
            cands.popitem(i)
            break
        # the hand rests on the next newer candidate; none newer: the next sweep starts at the oldest
        self._hand = ticket + 1 if i < len(cands) else None
        del self._ticket[block]
        pool = self.pool
        if pool is not None:  # (driven without a pool in tests: no duplicates to take over)
            self._victim = (pool.block_hash[block], ticket)
        return block

    def clear(self) -> None:
        self._victim = None
        self._hand = None
        self._ticket.clear()
        self._visited.clear()
        self._cands.clear()

    def __len__(self) -> int:
        return len(self._cands)

    def __contains__(self, block: int) -> bool:
        ticket = self._ticket.get(block)
        return ticket is not None and ticket in self._cands

    def snapshot(self) -> tuple:
        return (tuple(self._cands.items()), tuple(sorted(self._ticket.items())), tuple(sorted(self._visited)),
                self._hand)
