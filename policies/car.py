"""CAR (CLOCK with Adaptive Replacement): ARC's adaptation on two clocks.

Bansal, Modha, "CAR: Clock with Adaptive Replacement", USENIX FAST 2004.

Rules, as in the paper's figure 2: blocks seen once since they entered sit in clock T1,
blocks seen again in clock T2; a hit only sets the block's reference bit. Victims come from
T1 while it holds at least ``max(1, p)`` blocks, else from T2: the hand takes the oldest
block of that clock; with its bit set, the bit is cleared and the block moves to the new end
of T2 (from either clock), and the hand goes on; an unreferenced block is evicted, its hash
remembered in ghost list B1 (from T1) or B2 (from T2). A missed block whose hash is in B1
grows the target ``p`` by ``max(1, |B2|/|B1|)``, one in B2 shrinks it by
``max(1, |B1|/|B2|)``; either way it enters T2, else T1, unreferenced. Before a new hash
enters, the ghosts are trimmed as in the paper: B1 while ``|T1| + |B1| >= c``, otherwise
B2 while all four lists hold ``2c`` or more.

On the evictable set: each clock orders every block by its place (a block in use keeps its
place and its bit), its candidates in a sorted map keyed by their ticket; the list sizes count
blocks in use. When the clock the rule names has no candidate the other gives the victim. The
pool evicts before the missed block is published, so the trim and ``p``'s update run when it
is (after the eviction, as in the paper). Each hand step is O(log n), paid for by a hit.

libCacheSim (0.3.5) has no CAR, so no simulator pins this one;
``tests/policies/test_classic_policies.py`` checks it against a plain-list restatement of the
paper's figure.

A duplicate block that takes over the hash of an evicted primary (the pool's promotion, right
after ``evict``) is no ghost hit: it resumes the primary's clock and place, ``p`` unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

from sortedcontainers import SortedDict

from .arc import takes_over
from .base import PolicyBase

_T1, _T2 = 1, 2


class CARPolicy(PolicyBase):
    name = "car"
    reads_chain = False

    def __init__(self) -> None:
        self.capacity = 1 << 62
        self.p = 0.0                                # target size of T1
        self._tickets = count(1)
        self._list: dict[int, int] = {}             # cached block -> _T1 | _T2
        self._ticket: dict[int, int] = {}           # cached block -> its place in its clock
        self._referenced: set[int] = set()          # cached blocks with the reference bit set
        self._size = [0, 0, 0]                      # [unused, |T1|, |T2|], blocks in use included
        self._cands = (None, SortedDict(), SortedDict())  # per clock: ticket -> candidate, oldest first
        self._b1: OrderedDict = OrderedDict()       # ghost hashes, oldest first
        self._b2: OrderedDict = OrderedDict()
        self._victim: tuple | None = None           # (hash, clock, ticket) of the latest victim

    def bind(self, pool) -> None:
        super().bind(pool)
        self.capacity = pool.num_blocks

    def on_cached(self, block: int) -> None:
        stale = self._list.get(block)
        if stale is not None:   # its last residency ended in use (taken up a tier), unannounced
            self._size[stale] -= 1
        self._referenced.discard(block)
        block_hash = self.pool.block_hash[block]
        b1, b2 = self._b1, self._b2
        victim, self._victim = self._victim, None
        if victim is not None and victim[0] == block_hash and takes_over(self.pool, block_hash):
            which, ticket = victim[1], victim[2]
            (b1 if which == _T1 else b2).pop(block_hash, None)
        else:
            ticket = next(self._tickets)
            size, c = self._size, self.capacity
            if block_hash in b1:
                self.p = min(self.p + max(1.0, len(b2) / len(b1)), float(c))
                del b1[block_hash]
                which = _T2
            elif block_hash in b2:
                self.p = max(self.p - max(1.0, len(b1) / len(b2)), 0.0)
                del b2[block_hash]
                which = _T2
            else:
                if size[_T1] + len(b1) >= c:
                    while b1 and size[_T1] + len(b1) >= c:
                        b1.popitem(last=False)
                else:
                    while b2 and size[_T1] + size[_T2] + len(b1) + len(b2) >= 2 * c:
                        b2.popitem(last=False)
                which = _T1
        self._list[block] = which
        self._ticket[block] = ticket
        self._size[which] += 1

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            del self._cands[self._list[block]][self._ticket[block]]
        self._referenced.add(block)

    def on_released(self, block: int) -> None:
        self._cands[self._list[block]][self._ticket[block]] = block

    def evict(self) -> int:
        _, t1, t2 = self._cands
        size = self._size
        referenced = self._referenced
        while True:
            if t1 and (size[_T1] >= max(1.0, self.p) or not t2):
                which, clock = _T1, t1
            else:
                which, clock = _T2, t2
            ticket, block = clock.popitem(0)
            if block in referenced:             # second chance, in T2 (a T1 block has proved reused)
                referenced.discard(block)
                self._ticket[block] = ticket = next(self._tickets)
                t2[ticket] = block
                if which == _T1:
                    self._list[block] = _T2
                    size[_T1] -= 1
                    size[_T2] += 1
                continue
            break
        del self._list[block], self._ticket[block]
        size[which] -= 1
        block_hash = self.pool.block_hash[block]
        (self._b1 if which == _T1 else self._b2)[block_hash] = None
        self._victim = (block_hash, which, ticket)
        return block

    def clear(self) -> None:
        self.p = 0.0
        self._victim = None
        self._list.clear()
        self._ticket.clear()
        self._referenced.clear()
        self._size = [0, 0, 0]
        self._cands[_T1].clear()
        self._cands[_T2].clear()
        self._b1.clear()
        self._b2.clear()

    def __len__(self) -> int:
        return len(self._cands[_T1]) + len(self._cands[_T2])

    def __contains__(self, block: int) -> bool:
        which = self._list.get(block)
        return which is not None and self._ticket[block] in self._cands[which]

    def snapshot(self) -> tuple:
        return (self.p, tuple(self._cands[_T1].items()), tuple(self._cands[_T2].items()),
                tuple(sorted(self._list.items())), tuple(sorted(self._referenced)), tuple(self._size),
                tuple(self._b1), tuple(self._b2))
