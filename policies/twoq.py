"""2Q: a FIFO for blocks seen once (A1in), an LRU for blocks seen again (Am), and a ghost
FIFO (A1out) that tells the two apart.

Johnson, Shasha, "2Q: A Low Overhead High Performance Buffer Management Replacement
Algorithm", VLDB 1994 (the "full version" of its section 3).

Rules, as in the paper (and libCacheSim's ``TwoQ``): a new block enters A1in; a hit in A1in
changes nothing (correlated references); a block whose hash is in A1out enters Am; a hit in
Am makes it the most recent there. To make room: while A1in holds more than
``kin = int(in_fraction * capacity)`` blocks, its oldest goes and leaves its hash in A1out
(at most ``kout = int(out_fraction * capacity)`` hashes, oldest dropped); otherwise Am's least
recent goes, leaving no ghost. Defaults are the paper's: 25 % and 50 %.

On the evictable set: A1in orders every block by its entry (a block in use keeps its place),
its candidates kept in a sorted map keyed by entry ticket; Am's candidates are in release
order; list sizes count blocks in use. When the list the rule names has no candidate the
other one gives the victim. The ghost is looked up as if before the eviction
(``policies/ghosts.py``), as a simulator does. With one-block requests this is exactly
libCacheSim's ``TwoQ`` (``tests/policies/test_libcachesim_equality.py``).

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) resumes the primary's list and place; the ghost that eviction left is taken back.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from sortedcontainers import SortedDict

from prefixkv.checks import real

from .arc import takes_over
from .base import PolicyBase
from .ghosts import GhostList

_IN, _MAIN = 0, 1


class TwoQPolicy(PolicyBase):
    name = "2q"
    reads_chain = False

    def __init__(self, in_fraction: float = 0.25, out_fraction: float = 0.5) -> None:
        real("in_fraction", in_fraction, low=0.0, high=1.0, high_open=True)
        real("out_fraction", out_fraction, low=0.0)
        self.in_fraction = in_fraction
        self.out_fraction = out_fraction
        self.kin = 1 << 62
        self._tickets = count(1)
        self._where: dict[int, int] = {}        # cached block -> _IN | _MAIN
        self._ticket: dict[int, int] = {}       # A1in block -> entry ticket
        self._size = [0, 0]                     # cached blocks per list, blocks in use included
        self._in_cands: SortedDict = SortedDict()        # A1in: ticket -> candidate, oldest first
        self._main_cands: OrderedDict[int, None] = OrderedDict()  # Am: candidates, least recent first
        self._ghost = GhostList(1 << 62)        # A1out
        self._victim: tuple | None = None       # (hash, list, ticket) of the latest victim, until on_cached

    def bind(self, pool) -> None:
        super().bind(pool)
        self.kin = int(self.in_fraction * pool.num_blocks)
        self._ghost.limit = int(self.out_fraction * pool.num_blocks)

    def on_cached(self, block: int) -> None:
        stale = self._where.get(block)
        if stale is not None:   # its last residency ended in use (taken up a tier), unannounced
            self._size[stale] -= 1
            self._ticket.pop(block, None)
        block_hash = self.pool.block_hash[block]
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            where = victim[1]
            if where == _IN:
                self._ghost.undo(block_hash)
                self._ticket[block] = victim[2]
        elif self._ghost.take(block_hash):
            where = _MAIN
        else:
            where = _IN
            self._ticket[block] = next(self._tickets)
        self._where[block] = where
        self._size[where] += 1

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            if self._where[block] == _IN:
                del self._in_cands[self._ticket[block]]
            else:
                del self._main_cands[block]

    def on_released(self, block: int) -> None:
        if self._where[block] == _IN:
            self._in_cands[self._ticket[block]] = block
        else:
            self._main_cands[block] = None

    def evict(self) -> int:
        if self._in_cands and (self._size[_IN] > self.kin or not self._main_cands):
            ticket, block = self._in_cands.popitem(0)
            del self._ticket[block]
            block_hash = self.pool.block_hash[block]
            self._ghost.add(block_hash)
            self._victim = (block_hash, _IN, ticket)
            where = _IN
        else:
            block = self._main_cands.popitem(last=False)[0]
            self._victim = (self.pool.block_hash[block], _MAIN, None)
            where = _MAIN
        del self._where[block]
        self._size[where] -= 1
        return block

    def clear(self) -> None:
        self._victim = None
        self._where.clear()
        self._ticket.clear()
        self._size = [0, 0]
        self._in_cands.clear()
        self._main_cands.clear()
        self._ghost.clear()

    def __len__(self) -> int:
        return len(self._in_cands) + len(self._main_cands)

    def __contains__(self, block: int) -> bool:
        if block in self._main_cands:
            return True
        ticket = self._ticket.get(block)
        return ticket is not None and ticket in self._in_cands

    def snapshot(self) -> tuple:
        return (tuple(self._in_cands.items()), tuple(self._main_cands), tuple(sorted(self._where.items())),
                tuple(sorted(self._ticket.items())), tuple(self._size), self._ghost.snapshot())
